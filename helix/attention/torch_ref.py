"""Reference attention in plain torch: paged, causal over global positions, fp32 math.
The oracle for every other backend; written for clarity, not speed (queries in blocks, so a long
prompt's score matrix is never whole in memory)."""

from __future__ import annotations

import torch

from helix.attention.backend import AttentionBackend
from helix.kv.manager import LocalKVMeta
from helix.kv.ownership import local_to_global
from helix.kv.quant import to_cache


SCORE_BYTES = 1 << 28      # fp32 scores of one query block: 256 MB (prompts of any length fit)


def _gather(cache: torch.Tensor, meta: LocalKVMeta, s: int, n: int) -> torch.Tensor:
    """The first n local KV rows of sequence s: [n, ...]."""
    idx = torch.arange(n, device=cache.device)
    pages = meta.block_tables[s].long()[idx // meta.page_size]
    return cache[pages, idx % meta.page_size]


def _softmax_attend(scores: torch.Tensor, values: torch.Tensor):
    """scores [h, q, k] fp32 (masked = -inf), values [h, k, dv] -> o [q, h, dv], lse [q, h]."""
    lse = torch.logsumexp(scores, dim=-1)                      # [h, q]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe.unsqueeze(-1))                 # masked -> 0
    o = torch.matmul(p, values)                                # [h, q, dv]
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("-inf")))
    return o.transpose(0, 1), lse.transpose(0, 1)


def append_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """The KV append contract in torch: rows [T, ...] into cache [P, page, ...] at flat slots
    [T], slot -1 skipped."""
    keep = slots >= 0
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots[keep]] = to_cache(rows[keep], cache.dtype)


class TorchAttention(AttentionBackend):
    name = "torch"

    def append_kv(self, cache, rows, slots):
        append_rows(cache, rows, slots)

    def _loop(self, meta: LocalKVMeta, n_tokens: int, heads: int, dv: int, device, attend_one):
        o = torch.zeros((n_tokens, heads, dv), dtype=torch.float32, device=device)
        lse = torch.full((n_tokens, heads), float("-inf"), dtype=torch.float32, device=device)
        cu = meta.cu_q.tolist()
        lens = meta.kv_lens.tolist()
        for s in range(len(lens)):
            a, b, n = cu[s], cu[s + 1], lens[s]
            if n == 0 or a == b:
                continue
            gpos = local_to_global(torch.arange(n, device=device), meta.kvp_rank, meta.kvp,
                                   meta.interleave)
            # queries in blocks: the fp32 score block [heads, block, n] stays under SCORE_BYTES
            block = max(1, SCORE_BYTES // (4 * heads * n))
            for a0 in range(a, b, block):
                b0 = min(b, a0 + block)
                visible = gpos[None, :] <= meta.q_pos[a0:b0, None]     # [q, k] causal by position
                o[a0:b0], lse[a0:b0] = attend_one(s, a0, b0, n, visible)
        return o, lse

    def decode_gqa(self, q, k_cache, v_cache, meta, scale):
        return self.prefill_gqa(q, k_cache, v_cache, meta, scale)

    def prefill_gqa(self, q, k_cache, v_cache, meta, scale):
        T, hq, d = q.shape
        hkv = k_cache.shape[2]
        group = hq // hkv

        def one(s, a, b, n, visible):
            k = _gather(k_cache, meta, s, n).float().repeat_interleave(group, dim=1)   # [n, hq, d]
            v = _gather(v_cache, meta, s, n).float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            return _softmax_attend(scores, v.transpose(0, 1))

        o, lse = self._loop(meta, T, hq, v_cache.shape[-1], q.device, one)
        return o.to(q.dtype), lse

    def decode_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale):
        return self.prefill_mla(q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale)

    def prefill_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale):
        T, h, dl = q_latent.shape

        def one(s, a, b, n, visible):
            kv = _gather(kv_cache, meta, s, n).float()                 # [n, Dl + Dr]
            c, k_rope = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]
            scores = (torch.einsum("qhc,kc->hqk", q_latent[a:b].float(), c)
                      + torch.einsum("qhr,kr->hqk", q_rope[a:b].float(), k_rope)) * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            return _softmax_attend(scores, c.unsqueeze(0).expand(h, -1, -1))

        o, lse = self._loop(meta, T, h, dl, q_latent.device, one)
        return o.to(q_latent.dtype), lse
