"""The collectives of context-parallel prefill (pass-KV, see helix/kv/context_parallel.py), in
one layer that the attention modules own:

- `attend`: this rank's own queries against the KV of every KVP rank. The chunk's sequences'
  pages are gathered over the KVP group (one all-gather of [slots, page, ...] per cache), or,
  when that copy would be too large, passed around the ring (each rank sends what it holds to
  the next and attends over what arrives, kvp - 1 times). Each source gives a partial (O, LSE);
  they are merged exactly, in source order whichever way they came.
- `to_heads`: the bridge to the output projection. In: this rank's own tokens, all H/tpa heads
  of its slice [T_own, H/tpa, d]. Out: every token of the step, this rank's H/N heads
  [T, H/N, d], the layout the row-parallel o_proj (and after its all-reduce the FFN / MoE,
  unchanged) expects. One all-to-all over KVP: rank k sends head chunk j of its own tokens to
  rank j.

    own tokens ──(proj QKV, append own KV)──> q_own, K/V pages ──gather / ring over kvp──>
      attend vs each source j ──LSE merge──> o_own [T_own, H/tpa, d] ──all-to-all over kvp──>
      o [Tc, H/N, d] ──o_proj (row-parallel over N) + all-reduce──> h [Tc, D] replicated ──> FFN
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from helix.attention.merge import merge_partials
from helix.kv.context_parallel import CPPlan
from helix.parallel.comm import Comm


class ContextParallel(nn.Module):
    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm
        self.kvp = comm.size("kvp")

    def _sources(self, caches: list[torch.Tensor], plan: CPPlan):
        """(source KVP rank, its pages in the slots layout, one tensor per cache) in arrival
        order."""
        local = [c[plan.gather_pages] for c in caches]          # [slots, page, ...]
        if not plan.ring:
            gathered = [self.comm.all_gather(x, "kvp") for x in local]    # [kvp, slots, ...]
            for j in range(self.kvp):
                yield j, [g[j] for g in gathered]
            return
        me = self.comm.mesh.kvp_rank
        for i in range(self.kvp):
            yield (me - i) % self.kvp, local
            if i < self.kvp - 1:
                local = [self.comm.ring_shift(x, "kvp") for x in local]

    def attend(self, attend_one: Callable, caches: list[torch.Tensor], plan: CPPlan
               ) -> torch.Tensor:
        """attend_one(cache views, source meta) -> (o [T_own, h, dv], lse [T_own, h]) for this
        rank's own queries; returns the exact attention over all sources [T_own, h, dv]."""
        parts = {j: attend_one(views, plan.sources[j]) for j, views in self._sources(caches, plan)}
        o = torch.stack([parts[j][0] for j in range(self.kvp)])
        lse = torch.stack([parts[j][1] for j in range(self.kvp)])
        return merge_partials(o, lse)[0]

    def to_heads(self, o_own: torch.Tensor, plan: CPPlan, o_decode: torch.Tensor | None,
                 rows: int) -> torch.Tensor:
        """o_own [T_own, H/tpa, d], o_decode [D, H/N, d] (the decode rows, merged; None when
        D = 0) -> [rows, H/N, d]: the step's tokens in step order, then zero rows up to `rows`
        (a captured bucket's padding)."""
        kvp = self.kvp
        t_own, h, d = o_own.shape
        width = max(plan.own_counts + [1])
        send = o_own.new_zeros(width, h, d)
        send[:t_own] = o_own
        send = send.view(width, kvp, h // kvp, d).transpose(0, 1).contiguous()  # [kvp, M, H/N, d]
        recv = self.comm.all_to_all(send, "kvp")        # block i: rank i's own tokens, my heads
        # one spare row past the step's: the all-to-all's padding rows land there
        out = o_own.new_zeros(max(rows, plan.num_decode + plan.num_chunk_rows + 1), h // kvp, d)
        if o_decode is not None:
            out[:plan.num_decode] = o_decode
        out[plan.dest] = recv.view(kvp * width, h // kvp, d)
        return out[:rows]
