"""GQA/MHA attention in the Helix layout (Llama 3.x, Qwen2, Qwen3, Qwen3-MoE).

Rank (kvp k, tpa a) computes q for heads [a*H/tpa, (a+1)*H/tpa) and k, v for the KV heads those
query heads read, redundantly across KVP ranks (no all-gather of Q); appends the new KV only where
it owns the position (slot -1 elsewhere); attends over its local shard -> (O, LSE); the exchange
merges to its H/N heads; o_proj is row-parallel over all N ranks + all-reduce.
TP baseline (kvp = 1, tpa = N > Hkv): each rank keeps a copy of the one KV head it reads.
"""

from __future__ import annotations

import torch
from torch import nn

from helix.config import ModelConfig
from helix.layers.attention_input import NormedInput
from helix.layers.cp_attention import ContextParallel
from helix.layers.exchange import KVPExchange
from helix.layers.fused_qk_norm import qk_norm_rope, rope_append, rope_append_fits
from helix.layers.hopb import overlapped
from helix.layers.linear import MergedColumnLinear, RowShardLinear
from helix.layers.norm import RMSNorm
from helix.layers.regions import region
from helix.layers.rope import RotaryEmbedding
from helix.parallel.comm import Comm
from helix.tracing import phase


def kv_head_range(cfg: ModelConfig, tpa: int, tpa_rank: int) -> tuple[int, int]:
    """KV heads held by TP_A rank `tpa_rank` (one replicated head when tpa > Hkv)."""
    hkv = cfg.num_kv_heads
    if tpa <= hkv:
        per = hkv // tpa
        return tpa_rank * per, (tpa_rank + 1) * per
    first_q = tpa_rank * (cfg.num_heads // tpa)
    h = first_q // (cfg.num_heads // hkv)
    return h, h + 1


class GQAAttention(NormedInput, nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, rope: RotaryEmbedding, dtype=torch.float32):
        super().__init__()
        lay, mesh = comm.mesh.layout, comm.mesh
        H, d, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        self.hq = H // lay.tpa                                  # query heads on this rank
        q0 = mesh.tpa_rank * self.hq
        kv0, kv1 = kv_head_range(cfg, lay.tpa, mesh.tpa_rank)
        self.hkv, self.d = kv1 - kv0, d
        kv_width = cfg.num_kv_heads * d
        self.qkv_proj = MergedColumnLinear(D, [("q_proj", H * d, q0 * d, (q0 + self.hq) * d),
                                               ("k_proj", kv_width, kv0 * d, kv1 * d),
                                               ("v_proj", kv_width, kv0 * d, kv1 * d)],
                                           cfg.qkv_bias, dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_eps, dtype)
        self.qk_norm = cfg.qk_norm
        # after the exchange this rank holds heads [merged0, merged0 + H/N)
        merged0 = q0 + mesh.kvp_rank * (H // lay.world_size)
        self.o_proj = RowShardLinear(H * d, D, merged0 * d, (merged0 + H // lay.world_size) * d,
                                     comm,
                                     "world", cfg.attention_bias, dtype)
        self.exchange = KVPExchange(comm)
        self.cp = ContextParallel(comm)
        self.rope = rope
        self.scale = cfg.softmax_scale

    def kv_cache_shape(self, num_pages: int, page_size: int) -> list[tuple[int, ...]]:
        return [(num_pages, page_size, self.hkv, self.d)] * 2

    def exchange_rows(self) -> tuple[int, int]:
        """(one token's K + V elements, one token's partial O + LSE elements) on this rank: the
        message sizes of context-parallel prefill's pass-KV / pass-Q rule."""
        return 2 * self.hkv * self.d, self.hq * (self.d + 1)

    @property
    def in_proj(self):
        return self.qkv_proj

    def attend_projected(self, y, pos, T, meta, cache, backend, ctx=None):
        """y [R, q + k + v] the projection of the rows this rank projects (NormedInput), pos
        [R] their global positions -> [T, D] replicated."""
        cp = meta.cp
        R = y.shape[0]
        k_cache, v_cache = cache
        slots = meta.slots
        with phase("qkv"):
            q, k, v = y.split(self.qkv_proj.sizes, dim=-1)              # one GEMM, three views
            q = q.view(R, self.hq, self.d)
            k = k.view(R, self.hkv, self.d)
            v = v.view(R, self.hkv, self.d)
            rope = self.rope
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            # without context parallelism the rows' KV goes to the cache at meta.slots: the
            # rotation's launch writes it (no append launch; under a graph, in the captured part)
            appended = cp is None and rope_append_fits(q, k, v, k_cache, v_cache, qw, kw)
            if appended:
                q = rope_append(q, k, v, qw, kw, self.q_norm.eps if self.qk_norm else 0.0,
                                rope.cos, rope.sin, pos, rope.adjacent_pairs, k_cache, v_cache,
                                slots)
            elif self.qk_norm:      # both norms and both rotations: one launch
                q, k = qk_norm_rope(q, k, qw, kw, self.q_norm.eps, rope.cos, rope.sin, pos,
                                    rope.adjacent_pairs)
            else:  # q and k are adjacent columns of the GEMM output: rotate both in one launch
                qk = self.rope(q.as_strided((R, self.hq + self.hkv, self.d), q.stride()), pos)
                q, k = qk.split([self.hq, self.hkv], dim=1)

        def append():
            if not appended:
                backend.append_kv_pair(k_cache, v_cache, k, v, slots)  # owner rank only (slot -1)

        def attend_rows(a, b, m):
            return backend.attend_gqa(q[a:b], k_cache, v_cache, m, self.scale)

        if cp is None and meta.micro_batches > 1:                   # HOP-B (decode steps)
            with phase("attn"):
                append()
            o = overlapped(lambda a, b: attend_rows(a, b, meta.rows(a, b)),
                           lambda o, lse: self.exchange(o, lse, backend), T,
                           meta.micro_batches, q.device)
        elif cp is None:
            def attend():
                append()
                return attend_rows(0, T, meta)                         # local shard

            with phase("attn"):
                o, lse = region(ctx, "attention", attend)
            o = self.exchange(o, lse, backend)                        # [T, H/N, d]
        else:
            o = region(ctx, "attention", lambda: self._attend_cp(q, k, v, meta, cache, backend, T))
        with phase("oproj"):
            return self.o_proj(o.reshape(T, -1))

    def _attend_cp(self, q, k, v, meta, cache, backend, T):
        """Pass-KV (meta.cp): append this rank's rows, attend its decode rows the Helix way and
        its own chunk queries over the whole causal prefix -> o [T, H/N, d] in step order.
        Under a captured prefill step this is the eager break "attention", run on the step's
        plan: q, k, v [R', ...] may hold padding rows past the plan's R, and o is padded with
        zero rows to T."""
        cp = meta.cp
        R, D = cp.host_rows.numel(), cp.num_decode
        k_cache, v_cache = cache
        with phase("attn"):                                       # decode rows + own positions
            backend.append_kv_pair(k_cache, v_cache, k[:R], v[:R], meta.slots[cp.rows[:R]])
        o_decode = None
        if D:                                                     # decode rows: pass-Q
            with phase("attn"):
                o, lse = backend.attend_gqa(q[:D], k_cache, v_cache, meta.split(D)[0],
                                            self.scale)
            o_decode = self.exchange(o, lse, backend)             # [D, H/N, d]
        with phase("attn.cp"):
            own = self.cp.attend(lambda kv, m: backend.prefill_gqa(q[D:R], kv[0], kv[1], m,
                                                                   self.scale),
                                 cache, cp)                       # [T_own, H/tpa, d]
        with phase("a2a.cp"):
            return self.cp.to_heads(own, cp, o_decode, T)         # [T, H/N, d]
