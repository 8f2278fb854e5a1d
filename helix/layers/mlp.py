"""Gated SiLU MLP, tensor-parallel over all N ranks: gate/up column shards, down row shard +
all-reduce. With reduce=False the caller sums the partial output (MoE shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from helix.layers import fp8
from helix.layers.fused_ops import silu_mul
from helix.layers.linear import MergedColumnLinear, RowShardLinear
from helix.parallel.comm import Comm


class ParallelMLP(nn.Module):
    def __init__(self, dim: int, width: int, comm: Comm, bias: bool = False, dtype=torch.float32,
                 reduce: bool = True):
        super().__init__()
        n, r = comm.size("world"), comm.mesh.rank
        part = width // n
        a, b = r * part, (r + 1) * part
        self.gate_up_proj = MergedColumnLinear(dim, [("gate_proj", width, a, b),
                                                     ("up_proj", width, a, b)], bias, dtype)
        self.down_proj = RowShardLinear(width, dim, a, b, comm, "world", bias, dtype, reduce=reduce)

    def shards(self):
        """-> (gate [I/n, dim], up [I/n, dim], down [dim, I/n]): this rank's weight shards,
        views (moe_decode streams the shared experts from them); None with biases or fp8."""
        if (self.gate_up_proj.bias is not None or self.down_proj.bias is not None
                or self.gate_up_proj.weight_scale is not None
                or self.down_proj.weight_scale is not None):
            return None
        gate, up = self.gate_up_proj.weight.split(self.gate_up_proj.sizes, dim=0)
        return gate, up, self.down_proj.weight

    def fp8_shards(self):
        """-> ((gate, up, down) block-fp8 weight views, (gate, up, down) their block-scale views)
        of an fp8 MLP (helix.layers.fp8), or None: 16-bit, biases, or gate / up split inside a
        128-block (the merged scale grid then holds rows of both)."""
        gu, dn = self.gate_up_proj, self.down_proj
        if (gu.weight_scale is None or dn.weight_scale is None or gu.bias is not None
                or dn.bias is not None or gu.sizes[0] % fp8.BLOCK):
            return None
        gate, up = gu.weight.split(gu.sizes, dim=0)
        g_s, u_s = gu.weight_scale.split([fp8.blocks(n) for n in gu.sizes], dim=0)
        return (gate, up, dn.weight), (g_s, u_s, dn.weight_scale)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """x [T, D] replicated -> [T, D] (replicated if reduce, else this rank's partial sum)."""
        return self.down_proj(silu_mul(self.gate_up_proj.joint(x)))   # [T, 2I] -> [T, I]

    def add_norm_forward(self, a: torch.Tensor, residual: torch.Tensor, norm, ctx=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(residual + a)), residual + a): the add + norm in gate/up's launch
        where it can be (MergedColumnLinear.add_norm_joint)."""
        gate_up, residual = self.gate_up_proj.add_norm_joint(a, residual, norm)
        return self.down_proj(silu_mul(gate_up)), residual
