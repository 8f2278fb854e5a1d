"""Paged split-KV decode attention for GQA / MHA (one query token per sequence).

Stage 1: one program per (kv_head, split, batch) loads each K/V tile of its split ONCE for all
GROUP = Hq / Hkv query heads of that KV head: Q [BLOCK_G >= 16, d] x K^T [d, BLOCK_N] on tensor
cores, online softmax in the exp2 domain, P [BLOCK_G, BLOCK_N] x V [BLOCK_N, d]. It writes a
normalized partial O and its LSE per split (or, with one split, the final O and LSE directly).

With several splits the partials are merged exactly (LSE weights), in one of two ways:
- two launches (the default): stage 2 (triton_splits.reduce_splits) merges them in a second
  kernel, one program per (batch, query head).
- fused (fused_merge=True): in the same launch. Each split program, after writing its partial,
  counts itself on an arrival counter of its (batch, kv_head); the program that arrives last
  merges the splits of its GROUP query heads and writes the final O and LSE (see the memory
  ordering note in the kernel). Measured no faster on an H200, and slower at many splits (one
  program's serial read of GROUP x splits partial rows): see use_fused_merge.

All metadata (block tables, local lengths) is read on the device; splits and block sizes are
constexpr picked from static sizes, so a launch is CUDA-graph capturable and never syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helix.attention.triton_splits import (LN2, LOG2E, arrival_counters, choose_num_splits,
                                           reduce_splits, run_kernel, sm_count_of, split_range,
                                           token_rows)

__all__ = ["choose_num_splits", "gqa_decode", "gqa_num_splits", "use_fused_merge"]


@triton.jit
def _gqa_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
    fo_ptr, flse_ptr, cnt_ptr,             # fused merge: final o [B, Hq, d], lse [B, Hq] (heads
    stride_fob, stride_foh, stride_flb,    # contiguous), arrival counters [B * Hkv]; else unused
    stride_qb, stride_qh,                  # q [B, Hq, d]
    stride_kp, stride_kt, stride_kh,       # k_cache [P, page, Hkv, d]
    stride_vp, stride_vt, stride_vh,       # v_cache [P, page, Hkv, d]
    stride_btb,                            # block_tables [B, max_pages] int32
    stride_ob, stride_oh, stride_os,       # o: [B, Hq, S, d] partials, or [B, Hq, d] (S = 1)
    stride_lb, stride_lh,                  # lse: [B, Hq, S] partials, or [B, Hq] (S = 1)
    HEAD_DIM,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SAME_LAYOUT: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_G: tl.constexpr,
    MERGE_D: tl.constexpr,
):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    g = tl.arange(0, BLOCK_G)                        # query heads of this group (padded)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    dcol = tl.arange(0, BLOCK_D)
    dmask = dcol < HEAD_DIM

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dcol[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)           # [BLOCK_G, BLOCK_D]
    q = q.to(k_ptr.dtype.element_ty)

    kv_len = tl.load(lens_ptr + b)
    start, end = split_range(kv_len, split, NUM_SPLITS, BLOCK_N)
    bt_row = bt_ptr + b * stride_btb
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        k_rows, tmask = token_rows(bt_row, t0, end, stride_kp, stride_kt, BLOCK_N, PAGE_SIZE)
        ld_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_base + k_rows[:, None] + dcol[None, :], mask=ld_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2   # [G, N]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))        # finite: every block has a token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SAME_LAYOUT:
            v_rows = k_rows                                # K and V pools share strides
        else:
            v_rows, _ = token_rows(bt_row, t0, end, stride_vp, stride_vt, BLOCK_N, PAGE_SIZE)
        v = tl.load(v_base + v_rows[:, None] + dcol[None, :], mask=ld_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0                                          # empty split / empty shard: False
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    o_off = b * stride_ob + heads.to(tl.int64)[:, None] * stride_oh + split * stride_os
    tl.store(o_ptr + o_off + dcol[None, :], out, mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)

    if FUSED_MERGE:
        # Memory ordering. The interpreter runs programs one after another, so none of this
        # can be tested on CPU (tests/test_triton_kernels.py checks it in the sm_90 PTX). It is
        # the pattern of CUDA cooperative groups' grid sync and CUTLASS's split-K semaphore
        # (CTA barrier, then one thread's GPU-scope release / acquire), minus their spin-wait:
        # nobody waits, so no co-residency is needed and nothing can hang.
        # 1. debug_barrier (bar.sync): every thread's partial stores above come before the
        #    atomic below (which ONE thread executes) in causality order: bar.sync orders the
        #    CTA's threads, and PTX release semantics are cumulative over what is ordered
        #    before them. (Triton also puts a bar.sync before a scalar atomic, for the shared
        #    memory that hands its result to the other threads; this one does not rely on it.)
        # 2. The atomic's RELEASE (sem acq_rel, scope gpu: membar.gpu + atom) makes this
        #    program's partial O / LSE visible GPU-wide (L2) before its arrival is counted.
        # 3. The last arriver reads old == NUM_SPLITS - 1: it observed the increments of all
        #    other splits, each a release after their partial stores, so its ACQUIRE orders
        #    all those stores before its own later loads. Triton hands the atomic's result to
        #    the other threads through shared memory behind a bar.sync, which extends that
        #    ordering to every thread of the program (causality order is transitive).
        # 4. The merge loads the partials with cache_modifier=".cg" (ld.global.cg: from L2,
        #    never a stale L1 line: L1 is not coherent across SMs), so it does not depend on
        #    the acquire's L1 invalidation (CCTL.IVALL in the SASS) alone.
        # 5. The merger resets its counter to 0 with a plain store: every split of this
        #    (batch, kv_head) has already counted itself, so nothing else touches it during
        #    this launch, and the next launch on the stream sees it after the kernel boundary.
        #    The buffer is all zero after every launch (triton_splits.arrival_counters).
        # The merged result does not depend on which program merges (splits are merged in
        # split order), so it is deterministic run to run.
        tl.debug_barrier()
        cnt = cnt_ptr + b * tl.num_programs(0) + kvh
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            _merge_group(o_ptr, lse_ptr, fo_ptr, flse_ptr, b, kvh,
                         stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         stride_fob, stride_foh, stride_flb, HEAD_DIM,
                         GROUP, NUM_SPLITS, MERGE_G, MERGE_D, BLOCK_D)
            tl.store(cnt, 0)


@triton.jit
def _merge_group(ows_ptr, lws_ptr, o_ptr, lse_ptr, b, kvh,
                 stride_wb, stride_wh, stride_ws, stride_lb, stride_lh,
                 stride_ob, stride_oh, stride_flb, HEAD_DIM,
                 GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, MERGE_G: tl.constexpr,
                 MERGE_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The exact LSE merge of the NUM_SPLITS partials of the GROUP query heads of kv head kvh
    into the final O (o's dtype) and LSE (fp32, natural log): O = sum_s w_s O_s with
    w_s = exp(LSE_s - logsumexp_s LSE_s), as triton_splits._reduce_splits_kernel computes it,
    here accumulated online over the splits (running max, rescaled sum): every split is a
    [MERGE_G, MERGE_D] tile whose rows are its heads, so nothing is reduced across threads and
    the unrolled loop's loads are independent of the accumulation (ptxas issues several
    splits' loads at once). Empty splits (LSE -inf) weigh exactly 0; all empty: O = 0,
    LSE = -inf. Loads are .cg: other SMs wrote the partials (see the kernel's ordering note)."""
    g = tl.arange(0, MERGE_G)
    gmask = g < GROUP
    heads = (kvh * GROUP + g).to(tl.int64)
    lse_row = lws_ptr + b * stride_lb + heads * stride_lh
    o_row = ows_ptr + b * stride_wb + heads[:, None] * stride_wh
    for d0 in tl.static_range(0, BLOCK_D, MERGE_D):
        dcol = d0 + tl.arange(0, MERGE_D)
        omask = gmask[:, None] & (dcol < HEAD_DIM)[None, :]
        m = tl.full([MERGE_G], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([MERGE_G], dtype=tl.float32)
        acc = tl.zeros([MERGE_G, MERGE_D], dtype=tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            lse_s = tl.load(lse_row + s, mask=gmask, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(o_row + s * stride_ws + dcol[None, :], mask=omask, other=0.0,
                           cache_modifier=".cg")                       # [MERGE_G, MERGE_D]
            m_new = tl.maximum(m, lse_s)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)      # no -inf - -inf
            alpha = tl.exp(m - m_ref)                                  # 0 while m is -inf
            w = tl.exp(lse_s - m_ref)                                  # 0 for an empty split
            l_sum = l_sum * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * part
            m = m_new
        has = l_sum > 0
        out = acc / tl.where(has, l_sum, 1.0)[:, None]                 # all empty: 0
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + dcol[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=omask)
        if d0 == 0:
            out_lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + b * stride_flb + heads, out_lse, mask=gmask)


def gqa_launch_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tiles and warps: BLOCK_N tokens per K/V tile (64 x 128 bf16 = 16 KB), the group padded to
    >= 16 rows for tl.dot. Memory-bound: 4 warps (several programs per SM), a 3-stage cp.async
    pipeline. Llama-70B rank on sm_90 (profiling/kernel_resources.py), triton 3.6 / 3.9: 114 /
    96 registers with the two-launch merge, 114 (128 at 64 splits) / 124 with the fused merge,
    no spills, 39 KB shared memory: 4 programs fit an SM, so every split launch that
    choose_num_splits makes (< 4 x SM count programs) runs in one wave."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    if dtype == torch.float32:          # fp32 dots run on FMA units: small tiles, no spills
        block_n = 16
    return dict(BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
                num_warps=4, num_stages=3)


# Shortest split of the default split count: 128 tokens (2 tiles). Measured on an H200
# (gqa_fused_merge_h200.json): batch 1 x 4K runs 15.7 us with 32 splits of 128 against 16.9 us
# with 16 of 256 (torch SDPA 14.9 us); other batches and contexts get the same split count as
# with 256 or run within noise of it.
GQA_MIN_TOKENS = 128
MERGE_TILE_ELEMS = 2048         # fp32 accumulator of the fused merge (16 registers a thread)


def merge_config(head_dim: int, group: int) -> dict:
    """Tiles of the fused merge: all GROUP heads x MERGE_D columns a split, MERGE_D as wide as
    keeps the accumulator <= MERGE_TILE_ELEMS fp32 (Llama-70B rank: [8, 128], one pass)."""
    mg = triton.next_power_of_2(group)
    md = max(16, min(triton.next_power_of_2(head_dim), MERGE_TILE_ELEMS // mg))
    return dict(MERGE_G=mg, MERGE_D=md)


def use_fused_merge(head_dim: int, group: int, num_splits: int) -> bool:
    """The default merge: in a second launch. Measured on an H200 (Llama-70B rank, batch 1-8 x
    4K-64K, profiling/results/gqa_fused_merge_h200.json) the fused merge was never faster than
    the second launch by more than noise and up to 15 % slower at 64 splits (one program reads
    every split's partials serially), so it is opt-in (fused_merge=True)."""
    return False


def gqa_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device,
                   min_tokens: int | None = None) -> int:
    """The default split count of a launch (static sizes only: fixed per graph bucket)."""
    return choose_num_splits(batch, kv_heads, max_context, sm_count_of(device),
                             min_tokens=GQA_MIN_TOKENS if min_tokens is None else min_tokens)


def gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
               num_splits: int | None = None, block_n: int | None = None,
               fused_merge: bool | None = None, min_tokens: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, d]; k_cache, v_cache [P, page, Hkv, d]; block_tables [B, max_pages] int32;
    kv_lens [B] int32 (0 allowed) -> o [B, Hq, d] in q.dtype, lse [B, Hq] fp32 (natural log,
    -inf where kv_len == 0).

    num_splits: KV splits per (batch, kv head), default choose_num_splits (min_tokens: its
    shortest split, default GQA_MIN_TOKENS). fused_merge: with num_splits > 1, merge the splits in the
    same launch (True) or in a second one (False); default use_fused_merge. The fused merge
    uses the device's persistent arrival counters (triton_splits.arrival_counters): launches
    must not run concurrently on several streams, and the first launch of a shape must be
    eager (not under CUDA graph capture) if it needs more counters than any before it."""
    B, Hq, d = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = Hq // Hkv
    o = torch.empty((B, Hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    if B == 0:
        return o, lse
    if num_splits is None:
        num_splits = gqa_num_splits(B, Hkv, block_tables.shape[1] * page_size, q.device,
                                    min_tokens)
    config = gqa_launch_config(d, group, k_cache.dtype)
    if block_n is not None:
        config["BLOCK_N"] = block_n
    if fused_merge is None:
        fused_merge = use_fused_merge(d, group, num_splits)
    fused_merge = bool(fused_merge) and num_splits > 1
    if num_splits == 1:                  # write the final O / LSE directly, no stage 2
        o_ws, lse_ws = o, lse
        so = (o.stride(0), o.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1))
    else:
        o_ws = torch.empty((B, Hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse_ws = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
        so = (o_ws.stride(0), o_ws.stride(1), o_ws.stride(2))
        sl = (lse_ws.stride(0), lse_ws.stride(1))
    if fused_merge:
        counters = arrival_counters(q.device, B * Hkv)
        fused = (o, lse, counters, o.stride(0), o.stride(1), lse.stride(0))
        config.update(FUSED_MERGE=True, **merge_config(d, group))
    else:                                # unused pointers / strides
        fused = (o, lse, kv_lens, o.stride(0), o.stride(1), lse.stride(0))
        config.update(FUSED_MERGE=False, MERGE_G=1, MERGE_D=1)
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    run_kernel(
        _gqa_split_kernel, (Hkv, num_splits, B),
        q, k_cache, v_cache, block_tables, kv_lens, o_ws, lse_ws, scale * LOG2E, *fused,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *so, *sl, d,
        GROUP=group, PAGE_SIZE=page_size, NUM_SPLITS=num_splits, DOT_PRECISION=precision,
        SAME_LAYOUT=k_cache.stride()[:2] == v_cache.stride()[:2], **config)
    if num_splits > 1 and not fused_merge:
        reduce_splits(o_ws, lse_ws, o, lse)
    return o, lse
