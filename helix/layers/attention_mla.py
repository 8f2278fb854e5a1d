"""Multi-head latent attention (DeepSeek-V2/V3), Helix layout.

Every rank holds the latent KV rows [kv_lora | rope key] of the positions it owns (one latent
"head": tpa = 1, all H query heads per rank), or all positions and H/N heads in the TP baseline
(kvp = 1). Decode rows run the absorbed form: q_nope is absorbed through W_UK into latent space;
attention returns the latent output and LSE; the exchange merges to H/N heads; W_UV maps those to
v dims; o_proj is row-parallel over N ranks + all-reduce. A step's prefill chunks run the
absorbed or the decompressed form, whichever costs fewer FLOPs (helix/layers/mla_prefill.py);
decompressed rows come out of attention in value space, so their exchange merges v-dim
partials and no W_UV follows.
"""

from __future__ import annotations

import torch
from torch import nn

from helix.config import ModelConfig
from helix.layers.attention_input import NormedInput
from helix.layers.cp_attention import ContextParallel
from helix.layers.exchange import KVPExchange
from helix.layers.hopb import overlapped
from helix.layers.fused_mla import mla_absorb_kv_row
from helix.layers.linear import ColumnShardLinear, MergedColumnLinear, RowShardLinear
from helix.layers.mla_prefill import MLADims, decompress_plan, decompressed_attention
from helix.layers.norm import RMSNorm
from helix.layers.regions import region
from helix.layers.skinny_gemm import absorb_v
from helix.layers.rope import RotaryEmbedding
from helix.layers.weights import sliced_loader
from helix.parallel.comm import Comm
from helix.tracing import phase


class MLAAttention(NormedInput, nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, rope: RotaryEmbedding, dtype=torch.float32):
        super().__init__()
        lay, mesh = comm.mesh.layout, comm.mesh
        H, D = cfg.num_heads, cfg.hidden_size
        self.nope, self.rdim, self.vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.lora = cfg.kv_lora_rank
        qk = self.nope + self.rdim
        self.hq = H // lay.tpa
        q0 = mesh.tpa_rank * self.hq
        # the two projections of x, one GEMM: q_a (replicated, q_lora models) or this rank's q
        # heads, then kv_a (replicated: the latent row and rope key)
        kv_a = ("kv_a_proj_with_mqa", self.lora + self.rdim, 0, self.lora + self.rdim)
        if cfg.q_lora_rank:
            q_part = ("q_a_proj", cfg.q_lora_rank, 0, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps, dtype)
            self.q_b_proj = ColumnShardLinear(cfg.q_lora_rank, H * qk, q0 * qk, (q0 + self.hq) * qk,
                                              False, dtype)
        else:
            q_part = ("q_proj", H * qk, q0 * qk, (q0 + self.hq) * qk)
        self.q_lora = bool(cfg.q_lora_rank)
        self.x_proj = MergedColumnLinear(D, [q_part, kv_a],
                                         [cfg.attention_bias and self.q_lora, cfg.attention_bias],
                                         dtype)
        self.kv_a_layernorm = RMSNorm(self.lora, cfg.rms_eps, dtype)
        # kv_b_proj rows of the local query heads: per head [W_UK (nope rows) | W_UV (v rows)]
        per = self.nope + self.vdim
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(torch.zeros((self.hq * per, self.lora), dtype=dtype),
                                             requires_grad=False)
        self.kv_b_proj.weight.weight_loader = sliced_loader((H * per, self.lora), 0, q0 * per,
                                                            (q0 + self.hq) * per)
        n = lay.world_size
        self.merged_heads = H // n                           # heads this rank holds after the merge
        self.merged_first = mesh.kvp_rank * self.merged_heads  # ... their offset in its local heads
        merged0 = q0 + self.merged_first                      # ... and in the model's heads
        self.o_proj = RowShardLinear(H * self.vdim, D, merged0 * self.vdim,
                                     (merged0 + self.merged_heads) * self.vdim,
                                     comm, "world", cfg.attention_bias, dtype)
        self.exchange = KVPExchange(comm)
        self.cp = ContextParallel(comm)
        self.rope = rope
        self.scale = cfg.softmax_scale
        self.dims = MLADims(self.lora, self.rdim, self.nope, self.vdim)

    def kv_cache_shape(self, num_pages: int, page_size: int) -> list[tuple[int, ...]]:
        return [(num_pages, page_size, self.lora + self.rdim)]

    def _w_kv(self):
        """kv_b_proj of the local heads: [h, nope + v, Dl] (W_UK rows, then W_UV rows)."""
        return self.kv_b_proj.weight.view(self.hq, self.nope + self.vdim, self.lora)

    def _w_uk_uv(self):
        w = self._w_kv()
        return w[:, :self.nope], w[:, self.nope:]             # [h, nope, Dl], [h, v, Dl]

    def exchange_rows(self) -> tuple[int, int]:
        """(one token's latent KV row elements, one token's partial latent O + LSE elements):
        the message sizes of context-parallel prefill's pass-KV / pass-Q rule."""
        return self.lora + self.rdim, self.hq * (self.lora + 1)

    @property
    def in_proj(self):
        return self.x_proj

    def attend_projected(self, y, pos, T, meta, cache, backend, ctx=None):
        """y [R, q (or q_lora) + Dl + Dr] the projection of x for the rows this rank projects
        (NormedInput), pos [R] their positions -> [T, D] replicated."""
        cp = meta.cp
        R = y.shape[0]
        D = meta.num_decode
        plan = None       # the chunks' local key counts when they run the decompressed form
        if cp is None and not meta.is_decode:
            plan = decompress_plan(meta.split()[1] if D else meta, self.hq, self.dims)
        w_uk, w_uv = self._w_uk_uv()
        with phase("qkv"):
            q, ckv = y.split(self.x_proj.sizes, dim=-1)   # [R, q_lora or hq * qk], [R, Dl + Dr]
            if self.q_lora:
                q = self.q_b_proj(self.q_a_layernorm(q))
            q = q.view(R, self.hq, self.nope + self.rdim)
            q_nope, q_rope = q.split([self.nope, self.rdim], dim=-1)
            A = R if plan is None else D          # rows in the absorbed form
            norm, rope = self.kv_a_layernorm, self.rope
            (kv_cache,) = cache
            slots = meta.slots
            # q_nope absorbed through W_UK [A, h, Dl], [normed latent | roped key] [R, Dl + Dr]
            # and the roped queries: one launch when every row is absorbed; on the absorbed
            # path without context parallelism it also appends the row
            fused_append = plan is None and cp is None
            q_latent, row, q_rope = mla_absorb_kv_row(
                q_nope[:A], w_uk, ckv, norm.weight, norm.eps, rope.cos, rope.sin, pos,
                rope.adjacent_pairs, q_rope, *((kv_cache, slots) if fused_append else ()))

        def attend_rows(a, b, m):
            return backend.attend_mla(q_latent[a:b], q_rope[a:b], kv_cache, self.lora, m,
                                      self.scale)

        w_uv = w_uv[self.merged_first:self.merged_first + self.merged_heads]
        if plan is not None:
            return self._decompressed(q_nope, q_rope, row, slots, kv_cache, meta, plan,
                                      attend_rows, backend, w_uv, ctx)
        if cp is None and meta.micro_batches > 1:                   # HOP-B (decode steps)
            o = overlapped(lambda a, b: attend_rows(a, b, meta.rows(a, b)),
                           lambda o, lse: self.exchange(o, lse, backend), R,
                           meta.micro_batches, q.device)
        elif cp is None:                                   # the row is in the pool already
            with phase("attn"):
                o, lse = region(ctx, "attention", lambda: attend_rows(0, R, meta))
            o = self.exchange(o, lse, backend)                                # [T, H/N, Dl]
        else:
            o = region(ctx, "attention", lambda: self._attend_cp(q_latent, q_rope, row, meta,
                                                                 kv_cache, backend, T))
        with phase("oproj"):
            return self.o_proj(absorb_v(o, w_uv))                             # [T, H/N * v]

    def _attend_cp(self, q_latent, q_rope, row, meta, kv_cache, backend, T):
        """Pass-KV (meta.cp): append this rank's rows, attend its decode rows the Helix way and
        its own chunk queries over the whole causal prefix -> o [T, H/N, Dl] in step order.
        Under a captured prefill step this is the eager break "attention", run on the step's
        plan: the inputs [R', ...] may hold padding rows past the plan's R, and o is padded
        with zero rows to T."""
        cp = meta.cp
        R, D = cp.host_rows.numel(), cp.num_decode
        with phase("attn"):                                   # decode rows + own positions
            backend.append_kv(kv_cache, row[:R], meta.slots[cp.rows[:R]])
        o_decode = None
        if D:                                                 # decode rows: pass-Q
            with phase("attn"):
                o, lse = backend.attend_mla(q_latent[:D], q_rope[:D], kv_cache, self.lora,
                                            meta.split(D)[0], self.scale)
            o_decode = self.exchange(o, lse, backend)                         # [D, H/N, Dl]
        with phase("attn.cp"):
            own = self.cp.attend(lambda kv, m: backend.prefill_mla(
                q_latent[D:R], q_rope[D:R], kv[0], self.lora, m, self.scale), [kv_cache], cp)
        with phase("a2a.cp"):
            return self.cp.to_heads(own, cp, o_decode, T)                     # [T, H/N, Dl]

    def _decompressed(self, q_nope, q_rope, row, slots, kv_cache, meta, kv_lens, attend_rows,
                      backend, w_uv, ctx):
        """A pass-Q step whose chunks run the decompressed form: decode rows [:D] absorbed
        (latent partials), chunk rows [D:] over expanded K/V (value-space partials); one
        exchange each."""
        D = meta.num_decode
        dec, pre = meta.split() if D else (None, meta)
        w_kv = self._w_kv()

        def attend():
            backend.append_kv(kv_cache, row, slots)
            latent = attend_rows(0, D, dec) if D else None
            return latent, decompressed_attention(q_nope[D:], q_rope[D:], kv_cache, w_kv, pre,
                                                  kv_lens, backend, self.scale)

        with phase("attn"):
            latent, values = region(ctx, "attention", attend)
        parts = []
        if D:
            o = self.exchange(*latent, backend)                               # [D, H/N, Dl]
            with phase("oproj"):
                parts.append(absorb_v(o, w_uv))                               # [D, H/N * v]
        o = self.exchange(*values, backend)                                   # [Tc, H/N, v]
        parts.append(o.reshape(o.shape[0], -1))
        with phase("oproj"):
            return self.o_proj(torch.cat(parts) if D else parts[0])           # [T, D]
