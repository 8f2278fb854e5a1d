"""Mixture of experts in the TP_F x EP layout.

EP rank e owns experts [e*E/ep, (e+1)*E/ep); each of them is TP_F-sharded (gate/up rows, down
columns) across the tpf ranks of that EP group. Every rank sees all T tokens (h is replicated),
runs the replicated router, computes its experts' partial outputs for the tokens routed to them,
adds its shard of the shared experts (at decode, in the experts' own two launches:
helix.layers.moe_decode), and ONE all-reduce over all N ranks sums experts and TP_F
partials. Only experts that received tokens are read. Experts in block fp8
(LocalExperts.to_fp8, helix.layers.fp8) run fused_moe's kernels with their scales (the decode
kernels at decode sizes, the sorted ones past them; not the one-row Gluon launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helix.config import ModelConfig
from helix.layers import fp8
from helix.layers import fused_moe as fm
from helix.layers import gluon_moe, moe_decode
from helix.layers.fused_moe import HAS_TRITON, fused_moe
from helix.layers.fused_ops import use_triton
from helix.layers.mlp import ParallelMLP
from helix.layers.regions import region
from helix.layers.router import Router
from helix.layers.weights import sliced_loader
from helix.parallel.comm import Comm

PROJS = ("gate_proj", "up_proj", "down_proj")


class LocalExperts(nn.Module):
    """This rank's experts, stacked: gate/up [E_local, I/tpf, D], down [E_local, D, I/tpf].

    On CUDA with Triton: the fused kernel (graph safe, reads only experts that got tokens).
    Elsewhere: a loop over the experts that got tokens, which asks the host which ones did.
    """

    def __init__(self, cfg: ModelConfig, comm: Comm, dtype=torch.float32):
        super().__init__()
        lay, mesh = comm.mesh.layout, comm.mesh
        n_local = cfg.num_experts // lay.ep
        self.first = mesh.ep_rank * n_local
        self.n_local = n_local
        width, dim = cfg.moe_intermediate_size, cfg.hidden_size
        part = width // lay.tpf
        a, b = mesh.tpf_rank * part, (mesh.tpf_rank + 1) * part
        self.gate_proj = nn.Parameter(torch.zeros((n_local, part, dim), dtype=dtype),
                                      requires_grad=False)
        self.up_proj = nn.Parameter(torch.zeros((n_local, part, dim), dtype=dtype),
                                    requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros((n_local, dim, part), dtype=dtype),
                                      requires_grad=False)
        self.loaders = {"gate_proj": sliced_loader((width, dim), 0, a, b),
                        "up_proj": sliced_loader((width, dim), 0, a, b),
                        "down_proj": sliced_loader((dim, width), 1, a, b)}
        for proj in PROJS:                  # block scales of fp8 stacks (to_fp8)
            self.register_parameter(f"{proj}_scale", None)

    @property
    def fp8(self) -> bool:
        return fp8.is_fp8(self.gate_proj)

    def scales(self):
        """-> (gate, up, down) block scales [E_local, rows / 128, cols / 128], or None."""
        return tuple(getattr(self, f"{p}_scale") for p in PROJS) if self.fp8 else None

    def to_fp8(self) -> bool:
        """Hold the stacks in block fp8 where this rank's expert slices keep whole 128-blocks
        (helix.layers.fp8.keeps_blocks) -> whether they were converted."""
        if not all(fp8.keeps_blocks(f, getattr(self, p).shape[1 + f.dim])
                   for p, f in self.loaders.items()):
            return False
        for proj in PROJS:
            w = getattr(self, proj)
            setattr(self, proj, nn.Parameter(torch.zeros(w.shape, dtype=fp8.DTYPE,
                                                         device=w.device), requires_grad=False))
            setattr(self, f"{proj}_scale",
                    fp8.scale_param(*w.shape[1:], lead=w.shape[:1], device=w.device))
        return True

    @property
    def graph_safe(self) -> bool:
        return HAS_TRITON and self.gate_proj.is_cuda

    def load_expert(self, expert: int, proj: str, full: torch.Tensor, name: str) -> None:
        stack, e = getattr(self, proj), expert - self.first
        if self.fp8:
            scale = getattr(self, f"{proj}_scale")[e]
            fp8.block_loader(self.loaders[proj], scale)(stack[e], full, name)
        else:
            self.loaders[proj](stack[e], fp8.dense(full, stack.dtype), name)

    def expert(self, proj: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Local expert e's `proj` weight in dtype (fp8 stacks dequantized)."""
        w = getattr(self, proj)[e]
        return fp8.dequantize(w, getattr(self, f"{proj}_scale")[e], dtype) if self.fp8 else w

    def takes_shared(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether forward can add the shared experts' shard in its own launches (the decode
        kernels)."""
        return (self.graph_safe and fm.FOLD_SHARED and fm.decode_kernels(ids.numel())
                and (self.fp8 or x.dtype == self.gate_proj.dtype))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared=None, shared_scales=None) -> torch.Tensor:
        """x [T, D], weights/ids [T, k] -> partial [T, D] from this rank's experts, plus the
        shared experts' shard (gate, up, down) where given (only if takes_shared)."""
        if self.graph_safe:
            return fused_moe(x, self.gate_proj, self.up_proj, self.down_proj, weights, ids,
                             self.first, shared=shared, scales=self.scales(),
                             shared_scales=shared_scales)
        assert shared is None
        out = torch.zeros_like(x)
        local = ids - self.first
        hit = (local >= 0) & (local < self.n_local)
        for e in torch.unique(local[hit]).tolist():
            tok, slot = torch.nonzero(local == e, as_tuple=True)
            h = x[tok]
            gate, up, down = (self.expert(p, e, x.dtype) for p in PROJS)
            y = F.silu(h @ gate.t()) * (h @ up.t())
            y = (y @ down.t()) * weights[tok, slot].unsqueeze(-1)
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, dtype=torch.float32):
        super().__init__()
        self.gate = Router(cfg, dtype)
        self.experts = LocalExperts(cfg, comm, dtype)
        self.shared_experts = (
            ParallelMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, comm,
                        dtype=dtype, reduce=False) if cfg.num_shared_experts else None)
        self.comm = comm

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """x [T, D] replicated -> [T, D] replicated."""
        return self._experts(x, *self.gate(x), ctx)

    def add_norm_forward(self, a: torch.Tensor, residual: torch.Tensor, norm, ctx=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(residual + a)) and residual + a, the norm in the router's launch where
        it can be (Router.add_norm_forward), at one row on sm_90 the router inside the
        experts' launch (`_routed_row`) -> (out, new residual)."""
        row = self._routed_row(a, residual, norm)
        if row is not None:
            y, residual = region(ctx, "moe", row)
            return self.comm.all_reduce(y, "world"), residual
        x, residual, weights, ids = self.gate.add_norm_forward(a, residual, norm)
        return self._experts(x, weights, ids, ctx), residual

    def _routed_row(self, a, residual, norm):
        """A call of gluon_moe.moe_row_routed (the add, the norm, the router, the routed and
        shared experts of one row in one launch) -> (this rank's out, new residual), or None
        where it does not apply: not one row, the router not on its fused path, the shared
        experts not folded, or the launch's own rules (moe_decode.row_launch,
        gluon_moe.route_unsupported); module flag gluon_moe.ROUTED."""
        ex, gate, mlp = self.experts, self.gate, self.shared_experts
        if not (gluon_moe.ROUTED and a.shape[0] == 1 and ex.graph_safe and use_triton(a)
                and gate.path(a) == "fused" and (mlp is None or fm.FOLD_SHARED)):
            return None
        shared = shared_scales = None
        if mlp is not None:          # the shard in the experts' format (both 16-bit or fp8)
            folded = mlp.fp8_shards() if ex.fp8 else (mlp.shards(), None)
            if folded is None or folded[0] is None:
                return None
            shared, shared_scales = folded
        bias, scales = gate.e_score_correction_bias, ex.scales()
        if (not moe_decode.row_launch(a, ex.gate_proj, ex.up_proj, ex.down_proj, shared,
                                      gate.spec.k, scales, shared_scales)
                or gluon_moe.route_unsupported(a, residual, norm.weight, gate.weight, bias,
                                               gate.spec)):
            return None

        def run():
            out, h, *_ = gluon_moe.moe_row_routed(
                a, residual, norm.weight, norm.eps, gate.weight, bias, gate.spec, ex.gate_proj,
                ex.up_proj, ex.down_proj, ex.first, shared, scales, shared_scales)
            return out, h
        return run

    def _folded(self, x, ids):
        """-> (shared expert shards, their block scales or None) for the experts' launches
        (LocalExperts.takes_shared), or None: the shared experts then run as their own MLP.
        Both 16-bit, or both block fp8 with the shard scales fitting moe_decode's tiles."""
        mlp, ex = self.shared_experts, self.experts
        if mlp is None or not ex.takes_shared(x, ids):
            return None
        if not ex.fp8:
            shards = mlp.shards()
            return None if shards is None else (shards, None)
        folded = mlp.fp8_shards()
        if folded is None or not moe_decode.shared_scales_fit(ex.gate_proj.shape[1]):
            return None
        return folded

    def _experts(self, x, weights, ids, ctx):
        mlp = self.shared_experts
        folded = self._folded(x, ids)
        shared, scales = folded if folded is not None else (None, None)
        y = region(ctx, "moe", lambda: self.experts(x, weights, ids, shared, scales))
        if mlp is not None and shared is None:
            y = y + mlp(x)
        return self.comm.all_reduce(y, "world")
