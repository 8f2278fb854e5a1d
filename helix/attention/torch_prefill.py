"""GQA prefill through torch's own attention kernels, which return the log-sum-exp, over K/V
gathered from the pages: the alternative to helix.attention.triton_prefill where it measures
faster. Two kernels (KERNELS):

- "flash": torch's FA2 varlen forward (`aten._flash_attention_forward`), one call for the
  step's sequences. Its causal mask is aligned to the bottom right (query i of a sequence with q
  queries and n keys sees keys j <= n - q + i), which is the mask Helix needs.
- "cudnn": cuDNN's attention (`aten._scaled_dot_product_cudnn_attention`), per sequence in two
  exact parts merged by their LSE: the chunk's queries against the cached prefix (no mask), and
  against the chunk's own keys (causal, square, where top-left and bottom-right agree).

When they apply (`usable`): torch masks in LOCAL index space, which is Helix's mask by global
position only when local index = global position and every sequence's queries are its last
positions: kvp == 1 (a prefill chunk always ends its sequence's KV). With kvp > 1 a rank's keys
interleave with the other ranks' positions, and the Triton kernel runs. Also: 16-bit CUDA
tensors, dk == dv, head dim a multiple of 8 up to 256, not under CUDA graph capture (the gather
needs the key counts on the host: meta.host_lens, which the engine's steps carry, else one
sync a call), and a gathered copy that stays under
GATHER_BYTES for every key the block tables can hold.

Layouts: keys of sequence s are gathered to rows [cu_k[s], cu_k[s + 1]) of [N, Hkv, d]; FA2
and cuDNN read the GQA groups natively (no K/V repeated to the query heads). torch's LSE
(natural log) is [Hq, T] from current FA2 builds, [S, Hq, max_q] (padded) from older ones,
[1, Hq, t] from cuDNN: all become [T, Hq]. With kvp == 1 no row is without keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helix.kv.manager import LocalKVMeta

KERNELS = ("flash", "cudnn")
GATHER_BYTES = 4 << 30      # largest K + V copy a call may make (bounded from static sizes)


def usable(kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: LocalKVMeta) -> bool:
    d = q.shape[-1]
    if not (q.is_cuda and meta.kvp == 1 and q.dtype in (torch.float16, torch.bfloat16)
            and k_cache.dtype == q.dtype and v_cache.shape[-1] == d and d % 8 == 0
            and d <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0)
            and not torch.cuda.is_current_stream_capturing()):
        return False
    keys = meta.block_tables.numel() * meta.page_size
    if 2 * keys * k_cache.shape[2] * d * q.element_size() > GATHER_BYTES:
        return False
    if kernel == "flash":
        return torch.backends.cuda.is_flash_attention_available()
    return torch.backends.cudnn.is_available()


def gather_slots(meta: LocalKVMeta, total: int, device, kv_lens: list[int] | None = None
                 ) -> torch.Tensor:
    """The flat cache slot of every sequence's local keys, sequence after sequence: [total]
    (total = sum of the key counts). With the counts on the host (kv_lens: the engine's
    meta.host_lens), a few launches per sequence from its block-table row; else one index
    computation over the whole step from the device counts (~10 small launches: 0.18 ms at 16K
    keys on the H200, most of what a cuDNN call spent around its kernel; the call went from
    3.86 to 3.57 ms, profiling/results/prefill_parts_*.json)."""
    page = meta.page_size
    if kv_lens is not None:
        within = torch.arange(page, device=device)
        parts = [(meta.block_tables[s, :-(-n // page), None].long() * page + within).view(-1)[:n]
                 for s, n in enumerate(kv_lens) if n]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
    S = meta.kv_lens.shape[0]
    lens = meta.kv_lens.long()
    seq = torch.repeat_interleave(torch.arange(S, device=device), lens, output_size=total)
    j = torch.arange(total, device=device) - (torch.cumsum(lens, 0) - lens)[seq]
    pages = meta.block_tables[seq, j // page].long()
    return pages * page + j % page


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """torch's FA2 varlen forward, causal (bottom-right): q [T, Hq, d], k, v [N, Hkv, d] ->
    (o [T, Hq, d], lse [Hq, T] or [S, Hq, max_q], natural log)."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True,
                                                  False, scale=scale)
    return out[0], out[1]


class NoLSE(RuntimeError):
    """torch's kernel returned no log-sum-exp for this shape: the caller runs the Triton kernel."""


def _cudnn_op(q, k, v, causal: bool, scale: float):
    """torch's cuDNN attention op, with its log-sum-exp asked for: (o, lse, ...)."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal,
                                                              False, scale=scale)


def cudnn_attention(q, k, v, causal: bool, scale: float):
    """cuDNN attention with its LSE: q [1, H, t, d], k, v [1, Hkv, n, d] (H a multiple of Hkv)
    -> (o [1, H, t, d], lse [1, H, t] natural log); causal: top-left aligned (used with t == n
    only). Raises NoLSE where cuDNN gives none (seen on the H200 for a 32K-token chunk followed
    by a 5-token one)."""
    out = _cudnn_op(q, k, v, causal, scale)
    if out[1] is None or out[1].numel() != q.shape[0] * q.shape[1] * q.shape[2]:
        raise NoLSE("cuDNN attention returned no log-sum-exp")
    return out[0], out[1].reshape(q.shape[:3])


def _lse_rows(lse: torch.Tensor, meta: LocalKVMeta, T: int) -> torch.Tensor:
    """FA2's LSE -> [T, Hq] fp32."""
    if lse.dim() == 2:                                   # [Hq, T]
        return lse.t().float()
    S = meta.cu_q.shape[0] - 1                           # [S, Hq, max_q], padded per sequence
    q_lens = (meta.cu_q[1:] - meta.cu_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(S, device=lse.device), q_lens, output_size=T)
    qi = torch.arange(T, device=lse.device) - meta.cu_q[:-1].long()[seq]
    return lse[seq, :, qi].float()


def _flash(q, k, v, meta: LocalKVMeta, kv_lens: list[int], q_lens: list[int], scale: float):
    cu_k = F.pad(torch.cumsum(meta.kv_lens, 0, dtype=torch.int32), (1, 0))
    o, lse = flash_varlen(q, k, v, meta.cu_q, cu_k, meta.max_q, max(kv_lens + [1]), scale)
    lse = _lse_rows(lse, meta, q.shape[0])
    if 0 in kv_lens:                                 # rows that saw no key: O = 0, LSE = -inf
        empty = ~torch.isfinite(lse)
        o, lse = o.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))
    return o, lse


def _cudnn(q, k, v, meta: LocalKVMeta, kv_lens: list[int], q_lens: list[int], scale: float):
    """Per sequence: the chunk's queries against its own keys (causal, square) and, after a
    cached prefix, against the prefix (no mask), merged by LSE. cuDNN reads the GQA groups
    natively ([1, Hkv, n, d] keys) and writes o in q's layout, so one sequence needs no copy."""
    T, hq, d = q.shape
    parts = []
    a = c = 0
    for n, t in zip(kv_lens, q_lens):
        if n == 0:                                    # no keys (padding rows): O = 0, no LSE
            parts.append((q.new_zeros(t, hq, d), q.new_full((t, hq), float("-inf"),
                                                             dtype=torch.float32)))
            a += t
            continue
        qs = q[a:a + t].transpose(0, 1).unsqueeze(0)                       # [1, Hq, t, d]
        ks, vs = (x[c:c + n].transpose(0, 1).unsqueeze(0) for x in (k, v))  # [1, Hkv, n, d]
        p = n - t                                                           # cached keys
        oc, lc = cudnn_attention(qs, ks[:, :, p:], vs[:, :, p:], True, scale)
        if p:
            op, lp = cudnn_attention(qs, ks[:, :, :p], vs[:, :, :p], False, scale)
            share = torch.sigmoid(lc - lp).unsqueeze(-1)                    # oc's weight
            oc = torch.lerp(op.float(), oc.float(), share).to(q.dtype)
            lc = torch.logaddexp(lc, lp)
        parts.append((oc[0].transpose(0, 1), lc[0].t()))                  # [t, Hq, d], [t, Hq]
        a, c = a + t, c + n
    if len(parts) == 1:                  # contiguous already when cuDNN kept q's layout
        return parts[0][0].contiguous(), parts[0][1].float().contiguous()
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts]).float()


def prefill_gqa(kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: LocalKVMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k_cache / v_cache [P, page, Hkv, d], meta of prefill rows with kvp == 1
    (see `usable`) -> o [T, Hq, d] in q.dtype, lse [T, Hq] fp32, through `kernel`."""
    if meta.host_lens is not None:                       # the engine's steps: no sync
        kv_lens, q_lens = meta.host_lens
    else:
        counts = torch.stack((meta.kv_lens, meta.cu_q[1:] - meta.cu_q[:-1]))
        kv_lens, q_lens = counts.tolist()                # host: gathered size (one sync)
    total = sum(kv_lens)
    if any(0 < n < t for n, t in zip(kv_lens, q_lens)):
        raise NoLSE("a sequence with fewer keys than queries")   # never at kvp 1: Triton's
    slots = gather_slots(meta, total, q.device, kv_lens)  # one index for K and V
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    if q.stride(-1) != 1:
        q = q.contiguous()
    # kvp == 1 (usable): every query sees at least its own key; only a prefill graph's padding
    # rows (one sequence of KV length 0) see none, and get O = 0, LSE = -inf
    return (_flash if kernel == "flash" else _cudnn)(q, k, v, meta, kv_lens, q_lens, scale)
