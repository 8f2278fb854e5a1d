"""KV append: write rows [T, ...] into a paged cache [P, page, ...] at flat slots [T] int64
(slot = page * page_size + offset), skipping slot -1 (not the owner rank, or a padding row).
One kernel for GQA caches [P, page, Hkv, d] and MLA caches [P, page, Dl + Dr]: a row is the
R = prod(shape[2:]) contiguous elements of one position, stored in the cache's dtype
(triton_util.cache_cast: fp8 caches round and saturate)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from helix.triton_util import cache_cast, pdl_sync, run_kernel


@triton.jit(do_not_specialize=["R"])
def _append_kernel(rows_ptr, slots_ptr, cache_ptr, stride_row, stride_slot, R,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t).to(tl.int64)           # int64: slot * R can pass 2^31
    mask = (col < R) & (tl.full([BLOCK], 0, tl.int64) + slot >= 0)   # slot -1: skip the row
    vals = tl.load(rows_ptr + t * stride_row + col, mask=mask, other=0.0)
    tl.store(cache_ptr + slot * stride_slot + col, cache_cast(vals, cache_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["R"])
def _append_pair_kernel(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, stride_k, stride_v,
                        stride_slot, R, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """K and V rows of one position in one launch (GQA: the two caches share slots)."""
    pdl_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    mask = (col < R) & (tl.full([BLOCK], 0, tl.int64) + slot >= 0)
    k = tl.load(k_ptr + t * stride_k + col, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_v + col, mask=mask, other=0.0)
    tl.store(k_cache_ptr + slot * stride_slot + col, cache_cast(k, k_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(v_cache_ptr + slot * stride_slot + col, cache_cast(v, v_cache_ptr.dtype.element_ty),
             mask=mask)


def _rows(rows: torch.Tensor, T: int, R: int) -> torch.Tensor:
    rows = rows.reshape(T, R)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def append_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """append_kv of K and V (same shapes, same slots) in one launch."""
    T = k.shape[0]
    R = math.prod(k_cache.shape[2:])
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert math.prod(k.shape[1:]) == R == math.prod(v.shape[1:]) and slots.shape[0] == T
    if T == 0:
        return
    k, v = _rows(k, T, R), _rows(v, T, R)
    block = min(1024, triton.next_power_of_2(R))
    run_kernel(_append_pair_kernel, (T, triton.cdiv(R, block)), k, v, slots, k_cache, v_cache,
               k.stride(0), v.stride(0), R, R, BLOCK=block, num_warps=4)


def append_kv(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [P, page, ...] (positions contiguous within a page), rows [T, ...], slots [T]."""
    T = rows.shape[0]
    R = math.prod(cache.shape[2:])
    assert math.prod(rows.shape[1:]) == R and slots.shape[0] == T
    assert cache.is_contiguous(), "KV pool must be contiguous"
    if T == 0:
        return
    rows = _rows(rows, T, R)
    block = min(1024, triton.next_power_of_2(R))
    run_kernel(_append_kernel, (T, triton.cdiv(R, block)), rows, slots, cache, rows.stride(0), R,
               R, BLOCK=block, num_warps=4)
