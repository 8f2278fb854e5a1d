"""Linear layers that own their sharding and their collective.

ColumnShard: this rank holds output features [start, stop) of the checkpoint's weight; no comm.
RowShard:    this rank holds input features [start, stop); the partial products are summed with
             an all-reduce over `axis` inside forward (bias added once, after the reduce).
MergedColumn: several column shards (or whole weights) of one input in ONE GEMM; no comm;
             add_norm_joint takes the RMS norm before it (and its residual add) in the launch.
The product is helix.layers.skinny_gemm.linear: F.linear, or one PDL Triton launch for
decode-sized rows on CUDA. A layer converted by `to_fp8` holds its weight in block fp8 with
`weight_scale` beside it and takes helix.layers.fp8.linear instead.
"""

from __future__ import annotations

import torch
from torch import nn

from helix.layers import fp8
from helix.layers.skinny_gemm import add_norm_linear, linear
from helix.layers.weights import load_full, sliced_loader
from helix.parallel.comm import Comm


def _param(shape, dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class _Projection(nn.Module):
    """A weight [out, in] (16-bit, or block fp8 with its weight_scale after to_fp8)."""

    def __init__(self):
        super().__init__()
        self.register_parameter("weight_scale", None)

    def product(self, x, bias=None):
        if self.weight_scale is not None:
            return fp8.linear(x, self.weight, self.weight_scale, bias)
        return linear(x, self.weight, bias)

    def to_fp8(self) -> bool:
        """Hold the weight in block fp8 (helix.layers.fp8) where every checkpoint slice this
        rank keeps is made of whole 128-blocks -> whether it was converted."""
        w = self.weight
        parts = getattr(w, "checkpoint_parts", None)
        loaders = [f for _, f in parts] if parts else [w.weight_loader]
        if not all(fp8.keeps_blocks(f, w.shape[f.dim]) for f in loaders):
            return False
        q = nn.Parameter(torch.zeros(w.shape, dtype=fp8.DTYPE, device=w.device),
                         requires_grad=False)
        self.weight_scale = fp8.scale_param(*w.shape, device=w.device)
        if parts:
            q.checkpoint_parts = [(name, fp8.block_loader(f, self.weight_scale))
                                  for name, f in parts]
        else:
            q.weight_loader = fp8.block_loader(w.weight_loader, self.weight_scale)
        self.weight = q
        return True


class ColumnShardLinear(_Projection):
    """x [T, in] (replicated) -> [T, stop - start]: output features [start, stop) of [out, in]."""

    def __init__(self, in_f: int, out_f: int, start: int, stop: int, bias: bool = False,
                 dtype=torch.float32):
        super().__init__()
        self.weight = _param((stop - start, in_f), dtype,
                             sliced_loader((out_f, in_f), 0, start, stop))
        self.bias = (_param((stop - start,), dtype, sliced_loader((out_f,), 0, start, stop))
                     if bias else None)

    def forward(self, x):
        return self.product(x, self.bias)


class MergedColumnLinear(_Projection):
    """Several column shards in ONE GEMM: x [T, in] -> [T, sum of parts].

    parts: (checkpoint name, full out features, start, stop); part i's rows [start, stop) of the
    checkpoint tensor `<parent>.<name>.weight` land after the previous parts' rows. The loader
    (helix.loader.expected_tensors) reads the parts by their checkpoint names. bias: one flag
    for all parts, or one per part; a part without a checkpoint bias adds zeros (exact).
    """

    def __init__(self, in_f: int, parts: list[tuple[str, int, int, int]],
                 bias: bool | list[bool] = False, dtype=torch.float32):
        super().__init__()
        self.sizes = [stop - start for _, _, start, stop in parts]
        offsets = [sum(self.sizes[:i]) for i in range(len(parts))]
        self.weight = _param((sum(self.sizes), in_f), dtype, None)
        self.weight.checkpoint_parts = [
            (name, sliced_loader((out_f, in_f), 0, a, b, dst))
            for (name, out_f, a, b), dst in zip(parts, offsets)]
        self.bias = None
        has = list(bias) if isinstance(bias, (list, tuple)) else [bool(bias)] * len(parts)
        assert len(has) == len(parts), (bias, parts)
        if any(has):
            self.bias = _param((sum(self.sizes),), dtype, None)
            self.bias.checkpoint_parts = [
                (name, sliced_loader((out_f,), 0, a, b, dst))
                for (name, out_f, a, b), dst, h in zip(parts, offsets, has) if h]

    def joint(self, x):
        """-> [T, sum of parts]: the parts side by side, as one tensor."""
        return self.product(x, self.bias)

    def add_norm_joint(self, a, residual, norm):
        """-> (joint(norm(residual + a)), residual + a) for an RMSNorm `norm`: the residual add
        and the norm in the GEMM's launch where skinny_gemm.add_norm_linear can."""
        return add_norm_linear(a, residual, norm.weight, norm.eps, self.weight, self.bias,
                               self.weight_scale)

    def forward(self, x):
        """-> one [T, size_i] view per part."""
        return self.joint(x).split(self.sizes, dim=-1)


class RowShardLinear(_Projection):
    """x [T, stop - start] (this rank's input features) -> [T, out], all-reduced over `axis`."""

    def __init__(self, in_f: int, out_f: int, start: int, stop: int, comm: Comm,
                 axis: str = "world", bias: bool = False, dtype=torch.float32,
                 reduce: bool = True):
        super().__init__()
        self.weight = _param((out_f, stop - start), dtype,
                             sliced_loader((out_f, in_f), 1, start, stop))
        self.bias = _param((out_f,), dtype, load_full) if bias else None
        self.comm, self.axis, self.reduce = comm, axis, reduce

    def forward(self, x):
        y = self.product(x)
        if not self.reduce:  # partial sum: the caller reduces; bias counted once, on rank 0
            return y + self.bias if self.bias is not None and self.comm.mesh.rank == 0 else y
        y = self.comm.all_reduce(y, self.axis)
        return y + self.bias if self.bias is not None else y
