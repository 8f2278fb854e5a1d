"""RMSNorm: normalise in fp32, scale in the input dtype (as the reference checkpoints do)."""

import torch
from torch import nn

from helix.layers.weights import load_full


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = load_full
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
