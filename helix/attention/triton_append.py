"""KV append: write rows [T, ...] into a paged cache [P, page, ...] at flat slots [T] int64
(slot = page * page_size + offset), skipping slot -1 (not the owner rank, or a padding row).
One kernel for GQA caches [P, page, Hkv, d] and MLA caches [P, page, Dl + Dr]: a row is the
R = prod(shape[2:]) contiguous elements of one position."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from helix.attention.triton_splits import run_kernel


@triton.jit
def _append_kernel(rows_ptr, slots_ptr, cache_ptr, stride_row, stride_slot, R,
                   BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t).to(tl.int64)           # int64: slot * R can pass 2^31
    mask = (col < R) & (tl.full([BLOCK], 0, tl.int64) + slot >= 0)   # slot -1: skip the row
    vals = tl.load(rows_ptr + t * stride_row + col, mask=mask, other=0.0)
    tl.store(cache_ptr + slot * stride_slot + col, vals.to(cache_ptr.dtype.element_ty), mask=mask)


def append_kv(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [P, page, ...] (positions contiguous within a page), rows [T, ...], slots [T]."""
    T = rows.shape[0]
    R = math.prod(cache.shape[2:])
    assert math.prod(rows.shape[1:]) == R and slots.shape[0] == T
    assert cache.is_contiguous(), "KV pool must be contiguous"
    if T == 0:
        return
    rows = rows.reshape(T, R)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(1024, triton.next_power_of_2(R))
    run_kernel(_append_kernel, (T, triton.cdiv(R, block)), rows, slots, cache, rows.stride(0), R,
               R, BLOCK=block, num_warps=4)
