"""RMSNorm: normalise in fp32, scale in the input dtype (as the reference checkpoints do).
On CUDA one Triton kernel (helix.layers.fused_ops); add_forward also folds in the residual add."""

import torch
from torch import nn

from helix.layers.fused_ops import add_rms_norm, rms_norm
from helix.layers.weights import load_full


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = load_full
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> weight * (x / rms(x)), normalised in fp32, rounded to x.dtype first."""
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (self(residual + x), residual + x): the residual add and the norm in one kernel."""
        return add_rms_norm(x, residual, self.weight, self.eps)
