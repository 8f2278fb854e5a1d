"""Split-KV plumbing shared by the Triton decode kernels (GQA and MLA).

- `choose_num_splits` / `fill_num_splits`: how many KV splits one launch uses, from static sizes
  only (the batch bucket, the block table's width), never from live lengths: a CUDA graph
  captured for a bucket replays with the same splits, and eager steps compile a handful of
  variants at most (splits are powers of two).
- `token_rows`: the paged-KV row offsets (int64) of a block of tokens.
- `split_range`: the token range [start, end) of one split.
- `lse_weights` / `lse_merge`: the exact LSE merge of per-split partials, written once: every
  merge (the second launch below, the GQA kernel's own) uses it; `live_splits`: which splits of
  a sequence hold tokens.
- `reduce_splits`: stage 2, the merge as a second launch, one program per (batch, head).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from helix.triton_util import pdl_sync, run_kernel

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)   # used inside kernels: must be a constexpr global


def choose_num_splits(batch: int, kv_heads: int, max_context: int, sm_count: int,
                      min_tokens: int = 256, max_splits: int = 64, waves: float = 2.0,
                      round_up: bool = True) -> int:
    """Splits per (batch, kv_head) so the launch fills about `waves` waves of `sm_count`
    programs (splits rounded up to a power of two, or down with round_up=False: then the
    programs stay <= waves * sm_count, one exact wave for power-of-two batches when a program
    fills an SM), while each split keeps >= `min_tokens` tokens of `max_context`. A power of
    two in [1, max_splits]. `kv_heads` counts the independent programs per sequence (GQA:
    local KV heads; MLA: head blocks)."""
    programs = max(1, batch * kv_heads)
    target = max(1, int(waves * sm_count))
    if round_up:
        want = triton.next_power_of_2(-(-target // programs))     # ceil(waves), rounded up
    else:
        want = max(1, target // programs)
        want = 1 << (want.bit_length() - 1)                        # rounded down
    cap = max(1, max_context // max(1, min_tokens))               # splits long enough ...
    cap = 1 << (cap.bit_length() - 1)                              # ... rounded down
    return max(1, min(want, cap, max_splits))


def fill_num_splits(batch: int, kv_heads: int, max_context: int, sm_count: int,
                    min_tokens: int = 256, max_splits: int = 64, min_fill: float = 0.9) -> int:
    """For kernels that hold one program per SM: the fewest splits (a power of two) whose
    programs fill their last wave to >= min_fill (programs / (waves * sm_count)), else the
    best-filled; each split keeps >= min_tokens tokens of max_context. Fewer programs: fewer
    split partials to write and merge, fewer per-program prologues (B = 8, 2 head blocks,
    132 SMs: 8 splits, one wave of 128 programs; B = 3: 64 splits, 384 programs in 3 waves)."""
    programs = max(1, batch * kv_heads)
    cap = max(1, min(max_splits, max_context // max(1, min_tokens)))
    cap = 1 << (cap.bit_length() - 1)
    best, best_fill, n = 1, 0.0, 1
    while n <= cap:
        total = programs * n
        fill = total / (-(-total // sm_count) * sm_count)
        if fill >= min_fill:
            return n
        if fill > best_fill + 1e-9:
            best, best_fill = n, fill
        n *= 2
    return best


@functools.lru_cache(maxsize=None)
def sm_count_of(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small number elsewhere (interpreter: small grids)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


@triton.jit
def split_range(kv_len, split, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr = 0):
    """Tokens [start, end) of split `split` of a sequence of kv_len local tokens. Chunks are
    BLOCK_N-aligned so a block never straddles a page when PAGE_SIZE % BLOCK_N == 0, and hold
    at least MIN_CHUNK tokens (the Gluon MLA kernel's pair of tiles: its _split_tiles is this
    rule in Gluon). num_splits: a constexpr (GQA) or a runtime int (MLA: one binary for every
    split count); `split` may be a block of split indices."""
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    if MIN_CHUNK > 0:
        chunk = tl.maximum(chunk, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    return start, end


@triton.jit
def token_rows(bt_row_ptr, t0, end, stride_page, stride_tok,
               BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Offsets (int64, elements) of the rows of tokens t0 .. t0+BLOCK_N-1 in a paged pool
    [P, PAGE_SIZE, ...], and their mask (t < end). Page ids are cast to int64 BEFORE the
    page * stride product: a pool can hold more than 2^31 elements."""
    t = t0 + tl.arange(0, BLOCK_N)
    mask = t < end
    if PAGE_SIZE % BLOCK_N == 0:
        # t0 is BLOCK_N-aligned: the whole block lies in one page -> one page id load.
        page = tl.load(bt_row_ptr + t0 // PAGE_SIZE).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + t // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    rows = page * stride_page + (t % PAGE_SIZE).to(tl.int64) * stride_tok
    return rows, mask


@triton.jit
def next_page_id(bt_row_ptr, t, end, PAGE_SIZE: tl.constexpr):
    """The page id (int64) of token t, 0 when t >= end. Loaded one tile AHEAD of its use and
    carried through the loop (a scalar), so a tile's KV copies do not depend on a load of their
    own iteration: Triton's pipeliner would spend a pipeline stage on that indirection (2 k + 1
    stages for k + 1 KV buffers; with 2 stages the id load sits right before the copies)."""
    return tl.load(bt_row_ptr + t // PAGE_SIZE, mask=t < end, other=0).to(tl.int64)


@triton.jit
def page_rows(page, t0, end, stride_page, stride_tok,
              BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """token_rows for a block that lies in ONE page whose id (int64) is already loaded."""
    t = t0 + tl.arange(0, BLOCK_N)
    rows = page * stride_page + (t % PAGE_SIZE).to(tl.int64) * stride_tok
    return rows, t < end


@triton.jit
def lse_weights(lse):
    """The exact merge of split partials, the one rule every split kernel's merge uses:
    lse [R, S] fp32 (-inf: a split with no token) -> (w [R, S], the merged lse [R], natural
    log); the merged output is sum_s w[r, s] * O_s (lse_merge). A row whose splits are all
    empty gets w = 0 (output 0) and lse = -inf."""
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe[:, None])                             # empty splits: 0
    total = tl.sum(w, axis=1)
    w = w / tl.where(total > 0, total, 1.0)[:, None]              # all empty: O = 0
    out_lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)),
                       float("-inf"))
    return w, out_lse


@triton.jit
def lse_merge(lse, part):
    """lse [R, S], part [R, S, D] fp32 (each split's normalized output; 0 where empty) ->
    (out [R, D] fp32, lse [R] fp32): lse_weights' merge."""
    w, out_lse = lse_weights(lse)
    return tl.sum(w[:, :, None] * part, axis=1), out_lse


@triton.jit
def live_splits(kv_len, sidx, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr = 0):
    """Which of the split indices `sidx` hold tokens of a sequence of kv_len (split_range's
    chunks): the splits a merge reads (past them a split kernel wrote nothing, or -inf)."""
    start, _ = split_range(kv_len, sidx, num_splits, BLOCK_N, MIN_CHUNK)
    return (sidx < num_splits) & (start < kv_len)


@triton.jit
def _reduce_splits_kernel(
    ows_ptr, lws_ptr,          # o_ws [R, S, D] fp32, lse_ws [R, S] fp32 (R = B * H rows)
    o_ptr, lse_ptr,            # o [B, H, D] (any float dtype), lse [B, H] fp32
    lens_ptr,                  # kv_lens [B] int32 (read only with LIVE_BLOCK_N > 0)
    stride_ob, stride_oh,      # o strides (last dim contiguous)
    HEADS, D,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    LIVE_BLOCK_N: tl.constexpr = 0, LIVE_MIN_CHUNK: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    pdl_sync(PDL)
    # one program: one (b, h) row, BLOCK_D columns, all splits loaded at once (no serial loop)
    row = tl.program_id(0).to(tl.int64)        # b * HEADS + h
    b = row // HEADS
    h = row % HEADS
    sidx = tl.arange(0, BLOCK_S)
    smask = sidx < NUM_SPLITS
    if LIVE_BLOCK_N > 0:
        # splits past the sequence's tokens (split_range's chunks with BLOCK_N = LIVE_BLOCK_N,
        # of at least LIVE_MIN_CHUNK tokens) hold no partials (their programs wrote nothing):
        # neither read nor counted
        smask = live_splits(tl.load(lens_ptr + b), sidx, NUM_SPLITS, LIVE_BLOCK_N,
                            LIVE_MIN_CHUNK)
    lse = tl.load(lws_ptr + row * NUM_SPLITS + sidx[None, :], mask=smask[None, :],
                  other=float("-inf"))                            # [1, S]
    dcol = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dcol < D
    part = tl.load(ows_ptr + (row * NUM_SPLITS + sidx[None, :, None]) * D + dcol[None, None, :],
                   mask=smask[None, :, None] & dmask[None, None, :], other=0.0)  # [1, S, BD]
    out, out_lse = lse_merge(lse, part)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + dcol[None, :], out, mask=dmask[None, :])
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + row + tl.arange(0, 1), out_lse)


def split_workspace(o: torch.Tensor, lse: torch.Tensor, num_splits: int,
                    partial_dtype: torch.dtype = torch.float32):
    """Where a split kernel writes: o [B, H, d] and lse [B, H] themselves with one split, else
    fp32-LSE partials o_ws [B, H, S, d] (partial_dtype), lse_ws [B, H, S] for reduce_splits.
    -> (o_ws, lse_ws, o strides (b, h, split), lse strides (b, h))."""
    if num_splits == 1:
        return o, lse, (o.stride(0), o.stride(1), 0), (lse.stride(0), lse.stride(1))
    B, H, d = o.shape
    o_ws = torch.empty((B, H, num_splits, d), dtype=partial_dtype, device=o.device)
    lse_ws = torch.empty((B, H, num_splits), dtype=torch.float32, device=o.device)
    return (o_ws, lse_ws, (o_ws.stride(0), o_ws.stride(1), o_ws.stride(2)),
            (lse_ws.stride(0), lse_ws.stride(1)))


def reduce_splits(o_ws: torch.Tensor, lse_ws: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, kv_lens: torch.Tensor | None = None,
                  block_n: int = 0, min_chunk: int = 0) -> None:
    """o_ws [B, H, S, D] fp32, lse_ws [B, H, S] fp32 -> o [B, H, D] (its dtype), lse [B, H].
    With kv_lens [B] and block_n, the splits that split_range's chunks (of at least min_chunk
    tokens) leave empty for a sequence (its kernel wrote nothing there) are skipped; without,
    every split's partials are read."""
    B, H, S, D = o_ws.shape
    if B * H == 0:
        return
    block_s = triton.next_power_of_2(S)
    block_d = min(triton.next_power_of_2(D), max(16, 4096 // block_s))   # <= 4K fp32 a tile
    live = kv_lens is not None and block_n > 0
    run_kernel(_reduce_splits_kernel, (B * H, triton.cdiv(D, block_d)), o_ws, lse_ws, o, lse,
               kv_lens if live else lse_ws, o.stride(0), o.stride(1), H, D, NUM_SPLITS=S,
               BLOCK_S=block_s, BLOCK_D=block_d, LIVE_BLOCK_N=block_n if live else 0,
               LIVE_MIN_CHUNK=min_chunk if live else 0, num_warps=4)
