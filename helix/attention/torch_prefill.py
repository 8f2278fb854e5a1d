"""GQA prefill through torch's own flash attention (the FA2 varlen kernel torch ships for CUDA,
`aten._flash_attention_forward`, which returns the log-sum-exp), over K/V gathered from the pages:
the alternative to helix.attention.triton_prefill where it measures faster.

When it applies (`usable`): torch's kernel masks causally in LOCAL index space, aligned to the
bottom right (query i of a sequence with q queries and n keys sees keys j <= n - q + i). That is
Helix's mask by global position only when local index = global position and every sequence's
queries are its last positions: kvp == 1 (a prefill chunk always ends its sequence's KV). With
kvp > 1 a rank's keys interleave with the other ranks' positions, and the Triton kernel runs.
Also: 16-bit CUDA tensors, dk == dv, head dim a multiple of 8 up to 256, not under CUDA graph
capture (the gather needs the key count on the host: one sync a call).

Layout conversions: keys of sequence s are gathered to rows [cu_k[s], cu_k[s + 1]) of
[N, Hkv, d] (the kernel reads GQA groups natively); torch's LSE (natural log) is [Hq, T] in
current releases, [S, Hq, max_q] (padded per sequence) in older ones: both become [T, Hq]. Rows
that see no key (none here, with kvp == 1) get O = 0, LSE = -inf.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helix.kv.manager import LocalKVMeta


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: LocalKVMeta) -> bool:
    d = q.shape[-1]
    return (q.is_cuda and meta.kvp == 1 and q.dtype in (torch.float16, torch.bfloat16)
            and k_cache.dtype == q.dtype and v_cache.shape[-1] == d and d % 8 == 0
            and d <= 256 and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(q.device) >= (8, 0)
            and not torch.cuda.is_current_stream_capturing())


def gather_keys(cache: torch.Tensor, meta: LocalKVMeta, total: int) -> torch.Tensor:
    """cache [P, page, ...] -> the local keys of every sequence, sequence after sequence:
    [total, ...] (total = sum of meta.kv_lens, known on the host)."""
    S = meta.kv_lens.shape[0]
    lens = meta.kv_lens.long()
    seq = torch.repeat_interleave(torch.arange(S, device=cache.device), lens, output_size=total)
    j = torch.arange(total, device=cache.device) - (torch.cumsum(lens, 0) - lens)[seq]
    page = meta.block_tables[seq, j // meta.page_size].long()
    return cache.flatten(0, 1)[page * meta.page_size + j % meta.page_size]


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """torch's FA2 varlen forward, causal (bottom-right): q [T, Hq, d], k, v [N, Hkv, d] ->
    (o [T, Hq, d], lse [Hq, T] or [S, Hq, max_q], natural log)."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True,
                                                  False, scale=scale)
    return out[0], out[1]


def _lse_rows(lse: torch.Tensor, meta: LocalKVMeta, T: int) -> torch.Tensor:
    """torch's LSE -> [T, Hq] fp32."""
    if lse.dim() == 2:                                   # [Hq, T]
        return lse.t().float()
    S = meta.cu_q.shape[0] - 1                           # [S, Hq, max_q], padded per sequence
    q_lens = (meta.cu_q[1:] - meta.cu_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(S, device=lse.device), q_lens, output_size=T)
    qi = torch.arange(T, device=lse.device) - meta.cu_q[:-1].long()[seq]
    return lse[seq, :, qi].float()


def prefill_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: LocalKVMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k_cache / v_cache [P, page, Hkv, d], meta of prefill rows with kvp == 1
    (see `usable`) -> o [T, Hq, d] in q.dtype, lse [T, Hq] fp32."""
    T = q.shape[0]
    lens = meta.kv_lens.tolist()                         # host: gathered size, max_k (a sync)
    total = sum(lens)
    k = gather_keys(k_cache, meta, total)
    v = gather_keys(v_cache, meta, total)
    cu_k = F.pad(torch.cumsum(meta.kv_lens, 0, dtype=torch.int32), (1, 0))
    if q.stride(-1) != 1:
        q = q.contiguous()
    o, lse = flash_varlen(q, k, v, meta.cu_q, cu_k, meta.max_q, max(lens + [1]), scale)
    lse = _lse_rows(lse, meta, T)
    empty = ~torch.isfinite(lse)                         # +inf / NaN where a row saw no key
    lse = lse.masked_fill(empty, float("-inf"))
    return o.masked_fill(empty.unsqueeze(-1), 0), lse
