"""Paged split-KV decode attention for GQA / MHA (one query token per sequence).

Stage 1: one program per (kv_head, split, batch) loads each K/V tile of its split ONCE for all
GROUP = Hq / Hkv query heads of that KV head: Q [BLOCK_G >= 16, d] x K^T [d, BLOCK_N] on tensor
cores, online softmax in the exp2 domain, P [BLOCK_G, BLOCK_N] x V [BLOCK_N, d]. It writes a
normalized partial O and its LSE per split (or, with one split, the final O and LSE directly).

With several splits the partials are merged exactly (LSE weights, triton_splits.lse_weights):
- in the same launch (FUSED_MERGE) when the group's partials are one small tile: the last
  program of a (batch, KV head) to arrive (an arrival counter) merges all GROUP heads over the
  splits that hold tokens, in a few column chunks. Inside a decode step that saves the merge
  launch, a dependent launch of its own (Llama-3.1-8B at 8 x 1K: profiling/results/
  step_small.md);
- else in a second kernel (triton_splits.reduce_splits), one program per (batch, query head):
  a single program would read many partials one head after another (measured up to 15 % slower
  alone at 64 splits: profiling/results/gqa_fused_merge_h200.json).
Splits past a short sequence's tokens (the split count is static: from the block table's width)
write an empty partial (LSE -inf); the one-launch merge does not read them.

All metadata (block tables, local lengths) is read on the device; splits and block sizes are
constexpr picked from static sizes, so a launch is CUDA-graph capturable and never syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helix.attention.triton_splits import (LN2, LOG2E, choose_num_splits, live_splits,
                                           lse_weights, reduce_splits, sm_count_of, split_range,
                                           split_workspace, token_rows)
from helix.triton_util import arrival_counters, last_to_arrive, pdl_sync, pow2, run_kernel

__all__ = ["choose_num_splits", "gqa_decode", "gqa_launches", "gqa_num_splits"]


@triton.jit(do_not_specialize=["stride_btb"])   # block-table width: varies per step
def _gqa_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
    stride_qb, stride_qh,                  # q [B, Hq, d]
    stride_kp, stride_kt, stride_kh,       # k_cache [P, page, Hkv, d]
    stride_vp, stride_vt, stride_vh,       # v_cache [P, page, Hkv, d]
    stride_btb,                            # block_tables [B, max_pages] int32
    stride_ob, stride_oh, stride_os,       # o: [B, Hq, S, d] partials, or [B, Hq, d] (S = 1)
    stride_lb, stride_lh,                  # lse: [B, Hq, S] partials, or [B, Hq] (S = 1)
    fo_ptr, flse_ptr, cnt_ptr,             # FUSED: o [B, Hq, d], lse [B, Hq], counters [B*Hkv]
    stride_fob, stride_foh, stride_flb,
    HEAD_DIM,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SAME_LAYOUT: tl.constexpr, FUSED: tl.constexpr = False,
    BLOCK_GM: tl.constexpr = 1, BLOCK_S: tl.constexpr = 1, BLOCK_DC: tl.constexpr = 16,
    PDL: tl.constexpr = False,
):
    pdl_sync(PDL)
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
    # cached values are converted to q's dtype before the products; fp8 ones under a bf16 q to
    # fp16, q too (e4m3 -> fp16 is one cvt per pair on sm_90, -> bf16 a chain of them)
    if k_ptr.dtype.element_ty == tl.float8e4nv and q_ptr.dtype.element_ty == tl.bfloat16:
        q = q.to(tl.float16)

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
        k = tl.load(k_base + k_rows[:, None] + dcol[None, :], mask=ld_mask,
                    other=0.0).to(q.dtype)
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
        v = tl.load(v_base + v_rows[:, None] + dcol[None, :], mask=ld_mask,
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0                                          # empty split / empty shard: False
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    o_off = b * stride_ob + heads.to(tl.int64)[:, None] * stride_oh + split * stride_os
    tl.store(o_ptr + o_off + dcol[None, :], out, mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)
    if FUSED:
        # the last of the NUM_SPLITS programs of (b, kv head) to arrive merges the group: its
        # live splits' partials (written by this launch: read through L2) in one tile
        cnt = cnt_ptr + b * tl.num_programs(0) + kvh
        if last_to_arrive(cnt, NUM_SPLITS):
            gm = tl.arange(0, BLOCK_GM)
            hm = (kvh * GROUP + gm).to(tl.int64)
            hmask = gm < GROUP
            sidx = tl.arange(0, BLOCK_S)
            rmask = hmask[:, None] & live_splits(kv_len, sidx, NUM_SPLITS,
                                                 BLOCK_N)[None, :]               # [GM, S]
            part_lse = tl.load(lse_ptr + b * stride_lb + hm[:, None] * stride_lh + sidx[None, :],
                               mask=rmask, other=float("-inf"), cache_modifier=".cg")
            w, merged_lse = lse_weights(part_lse)
            rows = (o_ptr + b * stride_ob + hm[:, None, None] * stride_oh
                    + sidx[None, :, None] * stride_os)                          # [GM, S, 1]
            for d0 in tl.static_range(0, BLOCK_D, BLOCK_DC):    # column chunks: few registers
                dc = d0 + tl.arange(0, BLOCK_DC)
                dcm = dc < HEAD_DIM
                part = tl.load(rows + dc[None, None, :],
                               mask=rmask[:, :, None] & dcm[None, None, :], other=0.0,
                               cache_modifier=".cg")                           # [GM, S, DC]
                tl.store(fo_ptr + b * stride_fob + hm[:, None] * stride_foh + dc[None, :],
                         tl.sum(w[:, :, None] * part, axis=1), mask=hmask[:, None] & dcm[None, :])
            tl.store(flse_ptr + b * stride_flb + hm, merged_lse, mask=hmask)
            tl.store(cnt, 0)



def gqa_launch_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tiles and warps: BLOCK_N tokens per K/V tile (64 x 128 bf16 = 16 KB), the group padded to
    >= 16 rows for tl.dot. Memory-bound: 4 warps (several programs per SM), a 3-stage cp.async
    pipeline. Llama-70B rank on sm_90 (profiling/kernel_resources.py), triton 3.6: 112
    registers with the merge in the launch, no spills, 39 KB shared memory: 4 programs fit an SM,
    so every split launch that choose_num_splits makes (< 4 x SM count programs) runs in one
    wave (the sm_90 compile test holds the registers at <= 128)."""
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
# Waves of programs the default split count aims at (choose_num_splits' `waves`; 4 programs fit
# an SM). Module flag, read per call (benches switch it). Llama-3.1-8B on the H200 against 1 and
# 0.5: 8 x 1K 0.8 % slower, 8 x 32K 14 % / 35 % faster (profiling/results/step_small.md).
GQA_WAVES = 2.0
# The merge in the split launch (module doc) while the group's partials, pow2(GROUP) x splits x
# pow2(d) fp32, are at most this many elements (one tile of the merging program): Llama-3.1-8B
# (group 4, d 128) up to 8 splits, a Llama-70B rank (group 8) up to 4, Qwen3-235B's shape (group
# 16) up to 2. Module flag FUSED_MERGE, read per call (benches switch it). On the H200,
# Llama-3.1-8B at 8 x 1K (8 splits, 4096 elements): 4.934 -> 4.874-4.895 ms a step
# (profiling/results/step_small.md). At 8192 elements (8 chunks merged one after another by one
# program) the second launch is faster: the Llama-70B rank at 8 splits, 1 x 1K 15.4 -> 10.6 us,
# 8 x 1K 31.2 -> 24.3, 8 x 32K 264.4 -> 258.9 (step_small/gqa_fused_elems*_1efc800_h200.*).
FUSED_MERGE = True
FUSED_MERGE_ELEMENTS = 4096
FUSED_MERGE_CHUNK = 1024     # ... merged in column chunks of this many elements (registers)


def gqa_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device | int,
                   min_tokens: int | None = None) -> int:
    """The default split count of a launch (static sizes only: fixed per graph bucket) on
    `device` (or a GPU of that many SMs)."""
    sm_count = device if isinstance(device, int) else sm_count_of(device)
    return choose_num_splits(batch, kv_heads, max_context, sm_count,
                             min_tokens=GQA_MIN_TOKENS if min_tokens is None else min_tokens,
                             waves=GQA_WAVES)


def merge_in_launch(group: int, num_splits: int, block_d: int) -> bool:
    """Whether a launch of num_splits splits merges them itself (FUSED_MERGE's bound)."""
    return (FUSED_MERGE and num_splits > 1
            and pow2(group) * pow2(num_splits) * block_d <= FUSED_MERGE_ELEMENTS)


def gqa_launches(batch: int, heads: int, kv_heads: int, head_dim: int, max_context: int,
                 sm_count: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Kernels one gqa_decode call launches (default splits for a block table of max_context
    positions): the split launch, and the merge's where the splits are several and not merged
    in it. helix.perf.cost counts a decode step's kernels with it."""
    splits = gqa_num_splits(batch, kv_heads, max_context, sm_count)
    block_d = gqa_launch_config(head_dim, heads // kv_heads, dtype)["BLOCK_D"]
    return 1 if splits == 1 or merge_in_launch(heads // kv_heads, splits, block_d) else 2


def gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
               num_splits: int | None = None, block_n: int | None = None,
               min_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, d]; k_cache, v_cache [P, page, Hkv, d]; block_tables [B, max_pages] int32;
    kv_lens [B] int32 (0 allowed) -> o [B, Hq, d] in q.dtype, lse [B, Hq] fp32 (natural log,
    -inf where kv_len == 0).

    num_splits: KV splits per (batch, kv head), default choose_num_splits (min_tokens: its
    shortest split, default GQA_MIN_TOKENS)."""
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
    fused = merge_in_launch(group, num_splits, config["BLOCK_D"])
    o_ws, lse_ws, so, sl = split_workspace(o, lse, num_splits)   # 1 split: final O / LSE
    counters = arrival_counters(q.device, B * Hkv) if fused else lse
    precision = "ieee" if q.dtype == torch.float32 else "tf32"   # products in q's dtype
    run_kernel(
        _gqa_split_kernel, (Hkv, num_splits, B),
        q, k_cache, v_cache, block_tables, kv_lens, o_ws, lse_ws, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *so, *sl, o, lse, counters, o.stride(0), o.stride(1),
        lse.stride(0), d,
        GROUP=group, PAGE_SIZE=page_size, NUM_SPLITS=num_splits, DOT_PRECISION=precision,
        SAME_LAYOUT=k_cache.stride()[:2] == v_cache.stride()[:2], FUSED=fused,
        BLOCK_GM=pow2(group) if fused else 1, BLOCK_S=pow2(num_splits) if fused else 1,
        BLOCK_DC=(min(config["BLOCK_D"], max(16, FUSED_MERGE_CHUNK // (pow2(group)
                                                                    * pow2(num_splits))))
                  if fused else 16), **config)
    if num_splits > 1 and not fused:
        reduce_splits(o_ws, lse_ws, o, lse)
    return o, lse
