"""MoE routers, replicated on every rank (all ranks compute the same choice).

softmax top-k (Qwen3-MoE, DeepSeek-V2 greedy), DeepSeek-V2 group-limited greedy, and DeepSeek-V3
sigmoid scoring with e_score_correction_bias and group-limited top-k (noaux_tc).

On CUDA with Triton the routing is one kernel (helix.layers.triton_router; for decode batches
the router GEMM is inside it too); elsewhere `route_torch`. Both rank ties lowest expert id
(and group id) first, rank softmax routing by the logits, and rank experts outside the kept
groups -inf, so every rank and both paths choose the same experts (triton_router's docstring
has the details). HELIX_ROUTER_KERNEL=torch|select|fused|auto (default auto: fused for at most
triton_router.MAX_FUSED_ROWS rows, else GEMM + select) picks the path on CUDA.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from helix.config import ModelConfig
from helix.layers.fused_ops import use_triton
from helix.layers.weights import load_full

try:
    from helix.layers import triton_router
except ImportError:                      # pragma: no cover - triton is the optional "kernels" extra
    triton_router = None

KERNEL = os.environ.get("HELIX_ROUTER_KERNEL", "auto")
KERNELS = ("torch", "select", "fused", "auto")


def topk_lowest_id(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k largest of key [T, E] fp32, descending; equal values: lowest
    index first. torch.topk's order among ties is unspecified, so it ranks an int64 key that
    orders (value, -index) instead: the fp32 bits made order-preserving in the high half."""
    E = key.shape[-1]
    bits = (key.float() + 0.0).contiguous().view(torch.int32)       # + 0.0: -0.0 -> +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    rank = ordered * (1 << 32) + (E - 1 - torch.arange(E, device=key.device))
    return rank.topk(k, dim=-1).indices


def _group_keep(key: torch.Tensor, n_group: int, topk_group: int, v3: bool) -> torch.Tensor:
    """[T, E] ranking key -> [T, E] bool: experts in each token's best `topk_group` groups.
    Group score: the best key (V2) or the sum of the two best (V3)."""
    T, E = key.shape
    grouped = key.view(T, n_group, E // n_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1) if v3 else grouped.max(-1).values
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, topk_lowest_id(group_score, topk_group), True)
    return keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def route_torch(logits: torch.Tensor, bias: torch.Tensor | None, spec) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k]); spec: triton_router.RouteSpec
    (or anything with its fields)."""
    k = spec.k
    if spec.sigmoid:                                    # DeepSeek-V3
        scores = logits.sigmoid()
        key = scores + bias.float() if bias is not None else scores
    else:
        scores = logits.softmax(dim=-1)
        key = logits                                    # softmax is monotonic in the logits
    if spec.group_rule != "none":
        keep = _group_keep(key, spec.groups, spec.topk_group, spec.group_rule == "top2")
        key = key.masked_fill(~keep, float("-inf"))
    ids = topk_lowest_id(key, k)
    w = scores.gather(1, ids)
    if spec.norm:
        tot = w.sum(-1, keepdim=True)
        w = w / (tot + 1e-20 if spec.sigmoid else tot)
    return w * spec.scaling, ids


class _Spec:
    """RouteSpec without triton (the fields route_torch reads)."""

    def __init__(self, cfg: ModelConfig):
        self.k, self.sigmoid, self.scaling = (cfg.experts_per_token, cfg.scoring == "sigmoid",
                                              float(cfg.routed_scaling_factor))
        if self.sigmoid:
            self.group_rule = "top2" if cfg.n_group > 1 else "none"
        else:
            self.group_rule = "max" if cfg.topk_method == "group_limited_greedy" else "none"
        self.groups, self.topk_group = ((cfg.n_group, cfg.topk_group)
                                        if self.group_rule != "none" else (1, 1))
        self.norm = bool(cfg.norm_topk_prob)


def route_spec(cfg: ModelConfig):
    """The routing rule of a model: triton_router.RouteSpec, or _Spec without triton."""
    return triton_router.RouteSpec.of(cfg) if triton_router else _Spec(cfg)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        # DeepSeek keeps the router in fp32; Qwen3-MoE in the model dtype
        wdtype = torch.float32 if cfg.arch.startswith("deepseek") else dtype
        self.weight = nn.Parameter(torch.zeros((cfg.num_experts, cfg.hidden_size), dtype=wdtype),
                                   requires_grad=False)
        self.weight.weight_loader = load_full
        self.e_score_correction_bias = None
        if cfg.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = load_full
        self.spec = route_spec(cfg)

    def path(self, x: torch.Tensor) -> str:
        """'torch', 'select' (GEMM + routing kernel) or 'fused' (one kernel) for this input."""
        if triton_router is None or not x.is_cuda or KERNEL == "torch":
            return "torch"
        if KERNEL == "auto":
            return "fused" if x.shape[0] <= triton_router.MAX_FUSED_ROWS else "select"
        if KERNEL == "fused" and x.shape[0] > triton_router.MAX_FUSED_ROWS:
            return "select"
        return KERNEL

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
        bias = self.e_score_correction_bias
        path = self.path(x)
        if path == "fused":
            return triton_router.route_fused_triton(x.contiguous(), self.weight, bias, self.spec)
        logits = F.linear(x.to(self.weight.dtype), self.weight).float()
        if path == "select":
            return triton_router.route_select_triton(logits, bias, self.spec, x.dtype)
        w, ids = route_torch(logits, bias, self.spec)
        return w.to(x.dtype), ids

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The RMSNorm before the router, then the router: -> (norm(residual + x),
        residual + x, weights, ids), the values of norm.add_forward and forward. On the fused
        path, with the fused ops on (HELIX_FUSED_OPS), one launch
        (triton_router.route_add_norm_triton), else those two calls."""
        if (self.path(x) == "fused" and use_triton(x) and x.stride(1) == 1
                and residual.stride(1) == 1 and residual.shape == x.shape):
            return triton_router.route_add_norm_triton(
                x, residual, norm.weight, norm.eps, self.weight, self.e_score_correction_bias,
                self.spec)
        y, h = norm.add_forward(x, residual)
        return (y, h, *self(y))
