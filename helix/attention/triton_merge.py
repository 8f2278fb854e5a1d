"""The Helix exchange in one kernel each side of the all-to-all.

pack_partials: o [T, H, d], lse [T, H] fp32 -> send [n, T, H/n, d + c] in o's dtype, the LSE's
fp32 bits in the last c = 4 / elem_size columns; bit-identical to helix.attention.merge.
The kernels move raw integer words (int16 for 2-byte dtypes, int32 for fp32), so every bit,
NaN payloads included, survives.

merge_received: recv [n, T, h, d + c] (partial i from KVP rank i) -> o [T, h, d]:
L = logsumexp_i LSE_i, O = sum_i exp(LSE_i - L) O_i (triton_splits.lse_weights, the rule every
split merge uses). NaN / +inf LSE count as -inf; a -inf partial contributes exactly nothing and
all-empty rows give O = 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helix.attention.merge import lse_cols
from helix.attention.triton_splits import lse_weights
from helix.triton_util import pdl_sync, run_kernel

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@triton.jit(do_not_specialize=["T"])
def _pack_kernel(o_ptr, lse_ptr, out_ptr, stride_ot, stride_oh, stride_lt, stride_lh,
                 T, H, HN, D,
                 C: tl.constexpr, WORD_BITS: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_sync(PDL)
    # o, out as integer words [T, H, D] / [n, T, HN, D + C]; lse [T, H] fp32
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    j = h // HN                                   # destination rank of head h
    row = ((j * T + t) * HN + h % HN) * (D + C)   # int64: output row start
    word_ty = out_ptr.dtype.element_ty
    for d0 in range(0, D, BLOCK_D):
        dcol = d0 + tl.arange(0, BLOCK_D)
        m = hmask[:, None] & (dcol < D)[None, :]
        w = tl.load(o_ptr + t * stride_ot + h[:, None] * stride_oh + dcol[None, :], mask=m)
        tl.store(out_ptr + row[:, None] + dcol[None, :], w, mask=m)
    bits = tl.load(lse_ptr + t * stride_lt + h * stride_lh, mask=hmask).to(tl.int32, bitcast=True)
    for i in tl.static_range(C):                  # little-endian words of the fp32 bits
        word = (bits >> (i * WORD_BITS)).to(word_ty)
        tl.store(out_ptr + row + D + i, word, mask=hmask)


def pack_partials(o: torch.Tensor, lse: torch.Tensor, n: int) -> torch.Tensor:
    """o [T, H, d], lse [T, H] fp32 -> send [n, T, H/n, d + c]: head chunk j goes to rank j."""
    T, H, d = o.shape
    assert H % n == 0, "heads must divide by the KVP degree"
    c = lse_cols(o.dtype)
    word = _WORDS[o.element_size()]
    out = torch.empty((n, T, H // n, d + c), dtype=o.dtype, device=o.device)
    if T == 0 or H == 0:
        return out
    if o.stride(-1) != 1:
        o = o.contiguous()
    lse = lse.float()
    block_h = min(16, triton.next_power_of_2(H))
    run_kernel(
        _pack_kernel, (T, triton.cdiv(H, block_h)), o.view(word), lse, out.view(word),
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), T, H, H // n, d,
        C=c, WORD_BITS=32 // c, BLOCK_H=block_h, BLOCK_D=min(256, triton.next_power_of_2(d)),
        num_warps=4)
    return out


@triton.jit
def _lse_of(words_ptr, row, hmask, D: tl.constexpr, C: tl.constexpr, WORD_BITS: tl.constexpr):
    """The fp32 LSE stored in words [row + D, row + D + C), NaN / +inf mapped to -inf."""
    bits = tl.zeros(row.shape, dtype=tl.int32)
    for i in tl.static_range(C):
        w = tl.load(words_ptr + row + D + i, mask=hmask, other=0).to(tl.int32)
        if C > 1:
            w = w & ((1 << WORD_BITS) - 1)         # drop the sign extension of the word
        bits = bits | (w << (i * WORD_BITS))
    lse = bits.to(tl.float32, bitcast=True)
    bad = (lse != lse) | (lse == float("inf"))
    return tl.where(bad | ~hmask, float("-inf"), lse)


@triton.jit(do_not_specialize=["T"])
def _merge_kernel(recv_ptr, words_ptr, o_ptr, T, HN, stride_ot, stride_oh,
                  N: tl.constexpr, D: tl.constexpr, C: tl.constexpr, WORD_BITS: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_sync(PDL)
    # recv [N, T, HN, D + C] (as floats and as words) -> o [T, HN, D]
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < HN
    ranks = tl.arange(0, BLOCK_N)
    # every rank's LSE of these heads at once [BLOCK_H, BLOCK_N] -> the split-merge weights
    rows = ((ranks[None, :] * T + t) * HN + h[:, None]) * (D + C)
    lse = _lse_of(words_ptr, rows, hmask[:, None] & (ranks < N)[None, :], D, C, WORD_BITS)
    w, _ = lse_weights(lse)                       # -inf (empty, NaN, +inf) partials: weight 0
    for d0 in range(0, D, BLOCK_D):
        dcol = d0 + tl.arange(0, BLOCK_D)
        msk = hmask[:, None] & (dcol < D)[None, :]
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(N):              # stream the partials one rank at a time
            row = ((i * T + t) * HN + h) * (D + C)
            w_i = tl.sum(tl.where(ranks[None, :] == i, w, 0.0), axis=1)
            part = tl.load(recv_ptr + row[:, None] + dcol[None, :], mask=msk, other=0.0)
            acc += w_i[:, None] * part.to(tl.float32)
        tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + dcol[None, :], acc, mask=msk)


def merge_received(recv: torch.Tensor, d: int) -> torch.Tensor:
    """recv [n, T, h, d + c] -> exact merged o [T, h, d] in recv's dtype."""
    n, T, h, w = recv.shape
    c = w - d
    assert c == lse_cols(recv.dtype), "recv's last dim must be d + LSE columns"
    recv = recv.contiguous()
    o = torch.empty((T, h, d), dtype=recv.dtype, device=recv.device)
    if T == 0 or h == 0:
        return o
    block_h = min(16, triton.next_power_of_2(h))
    run_kernel(
        _merge_kernel, (T, triton.cdiv(h, block_h)), recv, recv.view(_WORDS[recv.element_size()]),
        o, T, h, o.stride(0), o.stride(1), N=n, D=d, C=c, WORD_BITS=32 // c, BLOCK_H=block_h,
        BLOCK_N=triton.next_power_of_2(n), BLOCK_D=min(256, triton.next_power_of_2(d)),
        num_warps=4)
    return o
