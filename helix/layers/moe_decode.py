"""Routed experts for decode-sized batches: weight-streaming kernels, no sort, two launches.

    moe_decode(x, gate, up, down, weights, ids, first, config, shared, scales,
               shared_scales) -> [T, D]
        fused_moe's contract; with shared = (gate_s [Is, D], up_s [Is, D], down_s [D, Is]),
        this rank's shard of the shared experts (weight 1 for every token) is added in the
        same launches (fp8 experts: fp8 shared weights with their shared_scales). One row on
        sm_90 takes helix.layers.gluon_moe's single launch instead (`row_launch`; `config`
        then does not apply), never with fp8 experts.

At decode each hit expert gets one to a few rows, so the work is a GEMV per expert that must
stream the expert's weights at the copy rate. Programs are laid out per (token, expert) PAIR:
program p (p = t*k + j) leads expert e = ids[p] - first iff p is the first pair routed to e
(the k*T ids are loaded by every program, T*k <= MAX_PAIRS); it then gathers ALL rows of e
(the pairs with the same id, in pair order, by a prefix count in registers) and streams a
[BLOCK_N, D] slice of e's weights once for them. Programs of non-local or non-leading pairs
exit before reading a weight, so only experts with tokens are read, and no routing metadata
(sort, bounds) is built: the grid is (T*k + S, feature blocks), fixed by shapes.

  1. _gate_up_kernel grid (N + S, cdiv(I, BLOCK_N)): h[p] = silu(x_t Wg_e^T) * (x_t Wu_e^T)
     for the rows p of e -> h [N + S*T, I] in x.dtype (indexed by pair).
  2. _down_kernel grid (N + S, cdiv(D, BLOCK_N), K_SPLITS):
     y[s, p] = w_p * h[p] Wd_e[:, K-range s]^T (fp32, per pair and K split). Then
     out[t] = sum_j sum_s y[s, t*k + j] over t's LOCAL pairs and its shared pairs, in that
     fixed order (deterministic, no atomics on data): either by the last
     program of each feature block to arrive (FUSED_COMBINE: an arrival counter per block,
     the memory-ordering pattern of triton_decode's fused merge), or by a third launch.

Shared experts: their shard is cut into S = cdiv(Is, I) "virtual experts" of the routed width I
(virtual expert s = gate/up rows and down columns [s*I, min((s+1)*I, Is)); silu is elementwise
along I, so the pieces' down outputs sum to the MLP's). Programs N .. N + S - 1 of each launch
lead them, with every token t as a row (pair N + s*T + t), so one MoE layer is two launches
instead of six (shared gate/up GEMM, silu-mul, down GEMM, add) and the shared weights stream
beside the routed experts' at the decode kernels' tiles.

Inner products (MODE): 0 = FMA: elementwise products of BLOCK_M rows (1, 2, 4) with a
[BLOCK_N, BLOCK_K] weight tile accumulated in registers, reduced once after the K loop (an
expert with more rows streams its slice again per BLOCK_M rows, mostly from L2); 2 = tensor
cores (tl.dot over BLOCK_M >= 16 padded rows: all of an expert's rows in one pass).
Weights are read along their contiguous K axis (16-byte vectors); offsets are 64-bit.

fp8 experts (scales = (gate_s, up_s, down_s), fused_moe's block-fp8 format: float8_e4m3fn
stacks, float32 scales s[e, n // 128, k // 128]): both launches compile with SCALED. Each K step
converts the fp8 weight tile and scales it per output feature by its block's scale
s[e, n // 128, k0 // 128] (BLOCK_K divides 128: one scale a tile): FMA, the tile converted to fp32
and scaled before the products; tensor cores, the tile converted to x.dtype and its tl.dot
product scaled (acc + dot(rows, w^T) * s). 16-bit launches compile as before (SCALED off).

fp8 shared experts (scales, `shared` in float8_e4m3fn and shared_scales = (gate_ss, up_ss
[cdiv(Is, 128), cdiv(D, 128)], down_ss [cdiv(D, 128), cdiv(Is, 128)]), the shard's block scales,
e.g. views of a merged gate_up grid's rows): both launches also compile with SHARED = S (the
shared branch; fp8 launches without shared experts keep SHARED = 0 and compile as before). The
shared programs scale their tiles the same way: gate / up shard row fr = s*I + n and K tile k0 by
gate_ss[fr // 128, k0 // 128]; down feature n and shard column s*I + kk by
down_ss[n // 128, (s*I + kk) // 128], which one tile keeps only if every piece starts on a scale
block: I % 128 == 0 (`shared_scales_fit`; else ValueError, and the caller runs the shared experts
as their own MLP). K ranges of the split down launch start on multiples of BLOCK_K (k_chunk), a
divisor of 128, so no tile straddles two scale blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helix.attention.triton_splits import sm_count_of
from helix.layers import fp8, gluon_moe
from helix.triton_util import (arrival_counters, last_to_arrive, pdl_sync, pow2, prefetch_l2,
                               prefetching, run_kernel)

MAX_PAIRS = 128              # T * k up to this runs here (decode buckets); more: fused_moe's v1
# Programs of the down launch an SM holds on tensor cores with 16-bit weights: it takes 243
# registers a thread at 4 warps, 128-wide blocks (the sm_90 compile check in
# tests/test_fused_moe.py holds it between 2 and 3 programs' worth of the register file); with
# fp8 weights (bf16 rows, 128-wide blocks, 128-element K tiles) 255, also 2, with fp8 shared
# experts folded too (tests/test_fp8_moe.py)
DOWN_CTAS_PER_SM = 2
MODES = {"fma": 0, "dot": 2}


@triton.jit
def _pair_group(ids_ptr, p, N, first, E, BLOCK_P: tl.constexpr):
    """-> (lead, e, same [BP], rank [BP], count): whether pair p is the first pair of its local
    expert e, which pairs share e, each one's rank among them, how many."""
    q = tl.arange(0, BLOCK_P)
    qmask = q < N
    key = tl.load(ids_ptr + q, mask=qmask, other=-1) - first
    e = tl.load(ids_ptr + p) - first
    same = qmask & (key >= 0) & (key < E) & (key == e)
    lead = tl.min(tl.where(same, q, BLOCK_P), axis=0) == p       # non-local p: same is empty
    ones = same.to(tl.int32)
    return lead, e, same, tl.cumsum(ones, axis=0) - ones, tl.sum(ones, axis=0)


@triton.jit
def _chunk_pairs(same, rank, c0, count, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Pairs of ranks c0 .. c0 + BLOCK_M - 1 among `same` -> (pair [BM], valid [BM])."""
    r = c0 + tl.arange(0, BLOCK_M)
    q = tl.arange(0, BLOCK_P)
    sel = same[None, :] & (rank[None, :] == r[:, None])                      # [BM, BP]
    return tl.sum(tl.where(sel, q[None, :], 0), axis=1), r < count


@triton.jit
def _w_tile(w_rows, kk, nmask, kmask, MODE: tl.constexpr):
    """A weight tile of a K step from its rows' pointers w_rows [BN, 1] (unit stride along K):
    [1, BN, BK] (FMA, the rank the accumulator has) or [BN, BK] (tensor cores)."""
    if MODE == 0:
        return tl.load(w_rows[None, :, :] + kk[None, None, :],
                       mask=nmask[None, :, None] & kmask[None, None, :], other=0.0)
    else:
        return tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)


@triton.jit
def _row_tile(rows_ptr, kk, rvalid, kmask, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """The activation rows of a K step from their pointers rows_ptr [BM, 1]. FMA: loaded as
    [BM, BN, BK], each row repeated BN times (a zero stride; the repeats are L1 hits), so the
    product takes the weight tile's own register layout: a [BM, 1, BK] operand makes the
    compiler move every weight tile through shared memory into the rows' layout instead.
    Tensor cores: [BM, BK]."""
    if MODE == 0:
        zero = tl.zeros([1, BLOCK_N, 1], dtype=tl.int32)
        return tl.load(rows_ptr[:, :, None] + zero + kk[None, None, :],
                       mask=(rvalid[:, None, None] & kmask[None, None, :]) | (zero != 0),
                       other=0.0)
    else:
        return tl.load(rows_ptr + kk[None, :], mask=rvalid[:, None] & kmask[None, :],
                       other=0.0)


@triton.jit
def _acc_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              MODE: tl.constexpr):
    if MODE == 0:
        return tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _acc_step(acc, a, w, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += rows a x weights w^T (elementwise products for FMA, reduced in _acc_done)."""
    if MODE == 0:
        acc += a.to(tl.float32) * w.to(tl.float32)          # [BM, BN, BK] * [1, BN, BK]
    else:
        acc = tl.dot(a.to(w.dtype), tl.trans(w), acc=acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _acc_step_scaled(acc, a, w, s, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """_acc_step for an fp8 weight tile w and its features' block scales s [BN] fp32: FMA: the
    tile converted to fp32 and scaled before the products; tensor cores: the tile converted to
    the rows' dtype, its product scaled per feature (BLOCK_K divides 128: one scale a tile)."""
    if MODE == 0:
        acc += a.to(tl.float32) * (w.to(tl.float32) * s[None, :, None])
    else:
        acc = acc + tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=DOT_PRECISION) * s[None, :]
    return acc


@triton.jit
def _acc_done(acc, MODE: tl.constexpr):
    """-> [BM, BN] fp32."""
    if MODE == 0:
        return tl.sum(acc, axis=2)
    else:
        return acc


@triton.jit
def _rows_of(same, rank, c0, count, p_shared, N, T, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_P: tl.constexpr):
    """Rows c0 .. c0 + BLOCK_M - 1 of a program's expert -> (pair [BM], token [BM], valid [BM]):
    routed (p_shared false): its pairs among `same`; shared virtual expert s (this program's
    id - N): token r at pair N + s*T + r."""
    pair, valid = _chunk_pairs(same, rank, c0, count, BLOCK_M, BLOCK_P)
    r = c0 + tl.arange(0, BLOCK_M)
    s = tl.program_id(0) - N
    pair = tl.where(p_shared, N + s * T + r, pair)
    token = tl.where(p_shared, r, pair // TOPK)
    return pair, token, tl.where(p_shared, r < T, valid)


@triton.jit(do_not_specialize=["N", "T", "first"])
def _gate_up_kernel(
    x_ptr, g_ptr, u_ptr, ids_ptr, h_ptr, gs_ptr, us_ptr, gsc_ptr, usc_ptr, gssc_ptr, ussc_ptr,
    N, T, first, E, D, I, IS,
    stride_xt,                             # x [T, D], unit stride along D
    stride_ge, stride_gi,                  # gate [E, I, D], unit stride along D
    stride_ue, stride_ui,                  # up [E, I, D], unit stride along D
    stride_gsi, stride_usi,                # shared gate / up [IS, D], unit stride along D
    stride_hp,                             # h [N + S*T, I], unit stride along I
    stride_gsc_e, stride_gsc_n, stride_gsc_k,   # SCALED: gate_s [E, cdiv(I, 128), cdiv(D, 128)]
    stride_usc_e, stride_usc_n, stride_usc_k,   # SCALED: up_s, the same shape
    stride_gssc_n, stride_gssc_k,          # SCALED, SHARED: shared gate_s [cdiv(IS, 128), ..]
    stride_ussc_n, stride_ussc_k,          # SCALED, SHARED: shared up_s, the same shape
    TOPK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCALED: tl.constexpr = False, SHARED: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    p = tl.program_id(0)
    if SCALED and SHARED == 0:             # fp8 experts alone: routed pairs only
        shared: tl.constexpr = False
    else:                                  # (SHARED: read only with SCALED; 16-bit: unsaid)
        shared = p >= N                    # a shared virtual expert (programs N .. N + S - 1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    fr = ((p - N) * I + n).to(tl.int64)                                 # its shard rows
    s_mask = (n < I) & (fr < IS)
    gs_rows = gs_ptr + fr * stride_gsi                                  # [BN]
    us_rows = us_ptr + fr * stride_usi
    if prefetching(PDL):                   # weights: L2 may fetch them before the wait
        if shared:
            row_bytes = D * (gs_ptr.dtype.element_ty.primitive_bitwidth // 8)
            prefetch_l2(gs_rows, row_bytes, s_mask)
            prefetch_l2(us_rows, row_bytes, s_mask)
    pdl_sync(PDL)
    lead, e, same, rank, count = _pair_group(ids_ptr, tl.minimum(p, N - 1), N, first, E,
                                             BLOCK_P)
    if not (lead | shared):                # not this expert's first pair, or not local
        return
    if shared:
        nmask = s_mask
        g_rows = gs_rows[:, None]                                                # [BN, 1]
        u_rows = us_rows[:, None]
        count = T
        if SCALED:                         # [BN] scale rows of the shard rows' 128-blocks
            gsc_rows = gssc_ptr + (fr // 128) * stride_gssc_n
            usc_rows = ussc_ptr + (fr // 128) * stride_ussc_n
    else:
        nmask = n < I
        e64 = e.to(tl.int64)
        g_rows = g_ptr + e64 * stride_ge + n.to(tl.int64)[:, None] * stride_gi
        u_rows = u_ptr + e64 * stride_ue + n.to(tl.int64)[:, None] * stride_ui
        if SCALED:                         # [BN] scale rows of the features' 128-blocks
            gsc_rows = gsc_ptr + e64 * stride_gsc_e + (n // 128) * stride_gsc_n
            usc_rows = usc_ptr + e64 * stride_usc_e + (n // 128) * stride_usc_n
    if SCALED:                             # the scale grids' strides along K
        if SHARED:
            gsc_k = tl.where(shared, stride_gssc_k, stride_gsc_k)
            usc_k = tl.where(shared, stride_ussc_k, stride_usc_k)
        else:
            gsc_k = stride_gsc_k
            usc_k = stride_usc_k
    for c0 in range(0, count, BLOCK_M):
        pair, tok, rvalid = _rows_of(same, rank, c0, count, shared, N, T, TOPK, BLOCK_M,
                                     BLOCK_P)
        x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt                   # [BM, 1]
        acc_g = _acc_init(BLOCK_M, BLOCK_N, BLOCK_K, MODE)
        acc_u = _acc_init(BLOCK_M, BLOCK_N, BLOCK_K, MODE)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < D
            wg = _w_tile(g_rows, kk, nmask, kmask, MODE)
            wu = _w_tile(u_rows, kk, nmask, kmask, MODE)
            xt = _row_tile(x_rows, kk, rvalid, kmask, BLOCK_N, MODE)
            if SCALED:                     # this K tile's scales (one 128-block along K)
                sg = tl.load(gsc_rows + (k0 // 128) * gsc_k, mask=nmask, other=0.0)
                su = tl.load(usc_rows + (k0 // 128) * usc_k, mask=nmask, other=0.0)
                acc_g = _acc_step_scaled(acc_g, xt, wg, sg, MODE, DOT_PRECISION)
                acc_u = _acc_step_scaled(acc_u, xt, wu, su, MODE, DOT_PRECISION)
            else:
                acc_g = _acc_step(acc_g, xt, wg, MODE, DOT_PRECISION)
                acc_u = _acc_step(acc_u, xt, wu, MODE, DOT_PRECISION)
        g = _acc_done(acc_g, MODE)
        h = g * tl.sigmoid(g) * _acc_done(acc_u, MODE)                    # silu(g) * u, fp32
        tl.store(h_ptr + pair.to(tl.int64)[:, None] * stride_hp + n[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=rvalid[:, None] & nmask[None, :])


@triton.jit
def _combine(y_ptr, ids_ptr, out_ptr, N, T, first, E, n, nmask,
             stride_ys, stride_yp, stride_ot,
             TOPK: tl.constexpr, K_SPLITS: tl.constexpr, SHARED: tl.constexpr,
             FROM_L2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t, n] = sum over t's local pairs, then its shared pairs N + s*T + t, of
    sum_s y[s, pair, n] (fixed order), all t."""
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < T
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK + SHARED):
            if j < TOPK:
                pr = t.to(tl.int64) * TOPK + j
                e = tl.load(ids_ptr + pr, mask=tmask, other=-1) - first
                ok = (tmask & (e >= 0) & (e < E))[:, None] & nmask[None, :]
            else:
                pr = N + (j - TOPK) * T + t.to(tl.int64)
                ok = tmask[:, None] & nmask[None, :]
            for s in tl.static_range(K_SPLITS):
                ptrs = y_ptr + s * stride_ys + pr[:, None] * stride_yp + n[None, :]
                if FROM_L2:
                    acc += tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
                else:
                    acc += tl.load(ptrs, mask=ok, other=0.0)
        tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_ot + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["N", "T", "first"])
def _down_kernel(
    h_ptr, d_ptr, w_ptr, ids_ptr, y_ptr, out_ptr, cnt_ptr, ds_ptr, dsc_ptr, dssc_ptr,
    N, T, first, E, D, I, IS, k_chunk,
    stride_hp,                             # h [N + S*T, I], unit stride along I
    stride_de, stride_dd,                  # down [E, D, I], unit stride along I
    stride_dsd,                            # shared down [D, IS], unit stride along IS
    stride_ys, stride_yp,                  # y [K_SPLITS, N + S*T, D] fp32, unit stride along D
    stride_ot,                             # out [T, D]
    stride_dsc_e, stride_dsc_n, stride_dsc_k,   # SCALED: down_s [E, cdiv(D, 128), cdiv(I, 128)]
    stride_dssc_n, stride_dssc_k,          # SCALED, SHARED: shared down_s [cdiv(D, 128), ..]
    TOPK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, K_SPLITS: tl.constexpr, SHARED: tl.constexpr, MODE: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCALED: tl.constexpr = False, PDL: tl.constexpr = False,
):
    p = tl.program_id(0)
    if SCALED and SHARED == 0:             # fp8 experts alone: routed pairs only
        shared: tl.constexpr = False
    else:
        shared = p >= N
    nb = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    ks = tl.program_id(2)
    k_lo = ks * k_chunk
    c_lo = (p - N) * I                     # shared virtual expert s: shard columns [s*I, +I)
    s_hi = tl.minimum(tl.minimum(k_lo + k_chunk, I), IS - c_lo)
    ds_rows = ds_ptr + n.to(tl.int64) * stride_dsd + c_lo                       # [BN]
    if prefetching(PDL):                   # weights: L2 may fetch them before the wait
        if shared:
            prefetch_l2(ds_rows + k_lo,
                        (s_hi - k_lo) * (ds_ptr.dtype.element_ty.primitive_bitwidth // 8), nmask)
    pdl_sync(PDL)
    lead, e, same, rank, count = _pair_group(ids_ptr, tl.minimum(p, N - 1), N, first, E,
                                             BLOCK_P)
    if lead | shared:
        if shared:
            k_hi = s_hi
            d_rows = ds_rows[:, None]                                                 # [BN, 1]
            count = T
            if SCALED:                     # [BN] scale rows, from the piece's first K block:
                dsc_rows = (dssc_ptr + (n // 128) * stride_dssc_n      # c_lo = s * I, I % 128
                            + (c_lo // 128) * stride_dssc_k)           # == 0 (host check)
        else:
            k_hi = tl.minimum(k_lo + k_chunk, I)
            d_rows = d_ptr + e.to(tl.int64) * stride_de + n.to(tl.int64)[:, None] * stride_dd
            if SCALED:                     # [BN] scale rows of the features' 128-blocks
                dsc_rows = dsc_ptr + e.to(tl.int64) * stride_dsc_e + (n // 128) * stride_dsc_n
        if SCALED:                         # the scale grid's stride along K
            if SHARED:
                dsc_k = tl.where(shared, stride_dssc_k, stride_dsc_k)
            else:
                dsc_k = stride_dsc_k
        for c0 in range(0, count, BLOCK_M):
            pair, tok, rvalid = _rows_of(same, rank, c0, count, shared, N, T, TOPK, BLOCK_M,
                                         BLOCK_P)
            h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_hp                 # [BM, 1]
            acc = _acc_init(BLOCK_M, BLOCK_N, BLOCK_K, MODE)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < k_hi
                wd = _w_tile(d_rows, kk, nmask, kmask, MODE)
                ht = _row_tile(h_rows, kk, rvalid, kmask, BLOCK_N, MODE)
                if SCALED:                 # k0: a multiple of BLOCK_K (k_chunk is one)
                    sd = tl.load(dsc_rows + (k0 // 128) * dsc_k, mask=nmask, other=0.0)
                    acc = _acc_step_scaled(acc, ht, wd, sd, MODE, DOT_PRECISION)
                else:
                    acc = _acc_step(acc, ht, wd, MODE, DOT_PRECISION)
            wgt = tl.load(w_ptr + pair, mask=rvalid & (pair < N), other=1.0).to(tl.float32)
            y = _acc_done(acc, MODE) * wgt[:, None]                   # shared pairs: weight 1
            tl.store(y_ptr + ks * stride_ys + pair.to(tl.int64)[:, None] * stride_yp
                     + n[None, :], y, mask=rvalid[:, None] & nmask[None, :])
    if FUSED_COMBINE:
        # Every program of this feature block counts itself (leaders after their stores); the
        # last to arrive sums the block for every token (partials read through L2, .cg).
        # Which program sums does not change the result: the order of the sum is fixed.
        cnt = cnt_ptr + nb
        if last_to_arrive(cnt, tl.num_programs(0) * tl.num_programs(2)):
            _combine(y_ptr, ids_ptr, out_ptr, N, T, first, E, n, nmask, stride_ys, stride_yp,
                     stride_ot, TOPK, K_SPLITS, SHARED, True, BLOCK_T, BLOCK_N)
            tl.store(cnt, 0)


@triton.jit(do_not_specialize=["N", "T", "first"])
def _combine_kernel(y_ptr, ids_ptr, out_ptr, N, T, first, E, D, stride_ys, stride_yp,
                    stride_ot, TOPK: tl.constexpr, K_SPLITS: tl.constexpr,
                    SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_sync(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _combine(y_ptr, ids_ptr, out_ptr, N, T, first, E, n, n < D, stride_ys, stride_yp, stride_ot,
             TOPK, K_SPLITS, SHARED, False, BLOCK_T, BLOCK_N)


# -- launch configuration -------------------------------------------------------------------------

MOE_TUNABLES = ("mode", "BLOCK_M", "up_BLOCK_N", "up_BLOCK_K", "down_BLOCK_N", "down_BLOCK_K",
                "K_SPLITS", "FUSED_COMBINE", "num_warps", "num_stages")


def _feature_block(width: int, experts: int, lo: int, target: int) -> int:
    """Features per program: 64, halved (down to lo) while the programs of the experts that
    can be hit, experts * cdiv(width, BLOCK_N), fall short of target."""
    bn = max(lo, min(64, pow2(width)))
    while bn > lo and experts * -(-width // bn) < target:
        bn //= 2
    return bn


def moe_decode_config(T: int, k: int, n_local: int, inter: int, dim: int, dtype: torch.dtype,
                      sm_count: int = 132, config: dict | None = None,
                      shared: int = 0) -> dict:
    """Static launch parameters (shapes only). Defaults before measuring (profiling/
    bench_step_kernels.py compares the alternatives on the GPU): tensor cores for any row
    count (an FMA GEMV spends ~2.5 instructions per weight element: bf16 -> fp32 conversions
    of both operands and the FMA; tl.dot streams the same bytes in ~6x fewer), feature blocks
    narrowed until ~4 programs per SM can stream, split-K of the down projection while its
    programs fall short of that, the k-sum fused into the down launch. shared: the shared
    experts' virtual experts (shared_pieces), counted with the experts that can be hit."""
    cfg = dict(config or {})
    unknown = set(cfg) - set(MOE_TUNABLES)
    if unknown:
        raise ValueError(f"unknown MoE decode tunables {sorted(unknown)}; known: {MOE_TUNABLES}")
    mode = cfg.pop("mode", "dot")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} not in {tuple(MODES)}")
    hit = max(1, min(T * k, n_local)) + shared   # experts that can have rows
    target = 4 * sm_count
    block_m = cfg.pop("BLOCK_M", 1 if mode == "fma" else 16)
    # K tile: 512 B of a weight row per step (FMA), 128 B (tensor cores: operands via smem);
    # block-fp8 weights (dtype float8_e4m3fn, 1 byte): within one 128-element scale block
    bk = (256 if mode == "fma" else 64) * 2 // dtype.itemsize
    if dtype.itemsize == 1:
        bk = min(bk, fp8.BLOCK)
    # FMA accumulators live in registers: BM x BN x BK fp32 products <= 32 per thread
    cap = max(1, 4096 // (block_m * bk)) if mode == "fma" else 64
    lo = min(cap, 16 if mode == "dot" else 4)
    # Tensor cores on 16-bit weights, measured on the H200 (profiling/results/step_kernels.md,
    # part b: DeepSeek-V2-Lite and Qwen3-235B layers, gate/up + down): one row streams fastest
    # with 32-wide feature blocks (52.5 against 72.3 us with the 16-wide ones this rule gives,
    # DeepSeek-V2-Lite), two or more rows with 128-element K tiles over 4 stages (175.7 against
    # 184.9 us at batch 8; 106-476 us, the best or within 1 % of it, at every batch 1-8 of both).
    # Inside whole DeepSeek-V2-Lite steps (shared experts riding along; step_kernels.md,
    # --step-moe-configs): the down projection of one or two rows is fastest in 128-wide feature
    # blocks over 2 K splits (batch 1 x 1K 3.109 -> 2.812 ms, 1 x 32K 3.455 -> 3.175; batch
    # 2 x 1K 3.701 -> 3.581); from 4 rows the rule below is as fast (4 x 1K) or faster (8 x 32K).
    # Only while those blocks still give every SM a program (not: one expert of a narrow D).
    # The 2 K splits only while their programs fit one wave of the down launch (DOWN_CTAS_PER_SM
    # an SM); past it 1 (step_small.md, the session of 2026-12-03, fifth: Qwen3-235B's shape at
    # one row, 8 experts x 32 blocks, down 260 -> 228 us a step, the step 1.668 -> 1.618 ms at
    # 1 x 32K; DeepSeek-V2-Lite at two rows 733 -> 672 us, 2.876 -> 2.778 ms at 2 x 1K; its one
    # row, 256 programs, stays at 2 splits: 454 against 517 us).
    # Block-fp8 weights (1 byte) take the same rules: at their 128-element K tiles (the scale
    # block) a tile holds the bytes of the 16-bit one measured above (not measured in fp8)
    tuned = mode == "dot" and dtype.itemsize <= 2
    wide = 32 if tuned and T == 1 else None
    deep = tuned and T > 1
    few = tuned and T <= 2 and hit * -(-dim // 128) * 2 >= sm_count
    up_bn = cfg.pop("up_BLOCK_N", wide or min(cap, _feature_block(inter, hit, lo, target)))
    down_bn = cfg.pop("down_BLOCK_N", 128 if few else
                      min(cap, _feature_block(dim, hit, lo, target)))
    programs = hit * -(-dim // down_bn)
    one_wave = programs * 2 <= DOWN_CTAS_PER_SM * sm_count
    splits = cfg.pop("K_SPLITS", (2 if one_wave else 1) if few else
                     max(1, min(8, pow2(-(-target // programs)))))
    bk = 128 if deep else bk
    return dict(MODE=MODES[mode], BLOCK_M=block_m,
                up=dict(BLOCK_N=up_bn, BLOCK_K=cfg.pop("up_BLOCK_K", bk)),
                down=dict(BLOCK_N=down_bn, BLOCK_K=cfg.pop("down_BLOCK_K", bk)),
                K_SPLITS=splits, FUSED_COMBINE=cfg.pop("FUSED_COMBINE", True),
                num_warps=cfg.pop("num_warps", 4),
                num_stages=cfg.pop("num_stages", 4 if deep else
                                   2 if dtype == torch.float32 else 3))


def row_launch(x, gate, up, down, shared, topk: int, scales=None, shared_scales=None) -> bool:
    """Whether one row routed to `topk` experts takes gluon_moe's single persistent launch
    (sm_90, its shapes and shared memory; module
    flag gluon_moe.ENABLED) instead of the two launches here; fp8 experts with their block
    scales too (gluon_moe.FP8; its self-check of the fp8 launch passed)."""
    scaled = scales is not None or fp8.is_fp8(gate)
    if scaled and not gluon_moe.FP8:
        return False
    return (gluon_moe.ENABLED and x.is_cuda
            and gluon_moe.unsupported(x, gate, up, down, shared, scales, shared_scales,
                                      topk=topk) is None
            and gluon_moe.available(x.device, scaled))


def shared_scales_fit(inter: int) -> bool:
    """Whether block-fp8 shared experts fold into the decode launches of routed experts of width
    `inter` (I): their shard is cut into pieces of I columns of down_s, and a K tile of the down
    launch must lie in one 128-block of the shard (I % 128 == 0)."""
    return inter > 0 and inter % fp8.BLOCK == 0


def _shared_scales(shared, shared_scales, inter: int):
    """shared_scales = (gate_ss, up_ss, down_ss) of float8 shared weights (gate_s, up_s [Is, D],
    down_s [D, Is]): [cdiv(Is, 128), cdiv(D, 128)] twice, [cdiv(D, 128), cdiv(Is, 128)], fp32,
    unit stride along K not required -> the tuple; ValueError naming what is off."""
    if len(shared_scales) != 3:
        raise ValueError("shared_scales: (gate_ss, up_ss, down_ss)")
    if not shared_scales_fit(inter):
        raise ValueError(f"moe_decode: fp8 shared experts fold only into routed experts of a "
                         f"width I that is a multiple of {fp8.BLOCK} (I = {inter}): their pieces "
                         f"of I columns must start on a scale block; run them as their own MLP "
                         f"(shared_scales_fit)")
    for name, w, sc in zip(("gate", "up", "down"), shared, shared_scales):
        if w.dim() != 2 or not fp8.is_fp8(w):
            raise ValueError(f"shared {name}: block scales go with [n, k] float8_e4m3fn "
                             f"weights, not {w.dtype} {tuple(w.shape)}")
        want = tuple(fp8.blocks(d) for d in w.shape)
        if sc.dim() != 2 or tuple(sc.shape) != want or sc.dtype != torch.float32:
            raise ValueError(f"shared {name} scales {sc.dtype} {tuple(sc.shape)}: want float32 "
                             f"{want} for {tuple(w.shape)}")
    return tuple(shared_scales)


def shared_pieces(shared, inter: int) -> int:
    """The virtual experts a shared-expert shard (gate_s [Is, D], ...) is cut into: cdiv(Is, I)."""
    return 0 if shared is None else -(-shared[0].shape[0] // inter)


def moe_decode(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               weights: torch.Tensor, ids: torch.Tensor, first: int,
               config: dict | None = None, shared=None, scales=None,
               shared_scales=None) -> torch.Tensor:
    """fused_moe's contract for T * k <= MAX_PAIRS: x [T, D]; gate, up [E, I, D]; down
    [E, D, I]; weights [T, k]; ids [T, k] global ids -> [T, D] in x.dtype. `config` overrides
    any of MOE_TUNABLES. shared: None or (gate_s [Is, D], up_s [Is, D], down_s [D, Is]), this
    rank's shard of the shared experts, added for every token (weight 1). scales: None or the
    float32 block scales (gate_s, up_s, down_s) of float8_e4m3fn stacks (module doc).
    shared_scales: with scales and `shared` (float8 too), the shard's block scales (gate_ss,
    up_ss [cdiv(Is, 128), cdiv(D, 128)], down_ss [cdiv(D, 128), cdiv(Is, 128)], any strides);
    needs I % 128 == 0 (shared_scales_fit). Every weight has a unit stride along its reduction
    axis (D for gate / up, I or Is for down)."""
    T, D = x.shape
    if shared_scales is not None and (scales is None or shared is None):
        raise ValueError("moe_decode: shared_scales go with fp8 routed experts (scales=) and "
                         "their fp8 shared experts (shared=)")
    if scales is not None:
        scales = fp8.expert_scales(gate, up, down, scales)
        if shared is not None:
            if shared_scales is None:
                raise ValueError("moe_decode: fp8 experts with shared experts need the shared "
                                 "weights' block scales (shared_scales=)")
            shared_scales = _shared_scales(shared, shared_scales, gate.shape[1])
    elif fp8.is_fp8(gate):
        raise ValueError("moe_decode: float8 expert stacks need their block scales (scales=)")
    if T == 1 and row_launch(x, gate, up, down, shared, ids.shape[-1], scales, shared_scales):
        return gluon_moe.moe_row(x, gate, up, down, weights, ids, first, shared, scales,
                                 shared_scales)
    E, I, _ = gate.shape
    k = ids.shape[1]
    N = T * k
    assert N <= MAX_PAIRS, (T, k)
    out = torch.empty_like(x)
    if T == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    S = shared_pieces(shared, I)
    gs, us, ds = shared if shared is not None else (gate[0], up[0], down[0])
    IS = gs.shape[0] if shared is not None else 0
    for w in (gate, up, down, gs, us, ds):
        assert w.stride(-1) == 1 and w.dtype == gate.dtype, "unit stride along the reduction"
    assert shared is None or (us.shape == gs.shape == (IS, D) and ds.shape == (D, IS))
    ids_flat = ids.reshape(-1)                                        # [N], pair p = t*k + j
    w_flat = weights.reshape(-1)
    scaled = scales is not None
    # The launch parameters follow the weights' dtype (bytes a weight element), but fp8 weights
    # under fp32 rows (a checking dtype) take fp32's: their tiles are converted to fp32
    tiles = torch.float32 if scaled and x.dtype == torch.float32 else gate.dtype
    cfg = moe_decode_config(T, k, E, I, D, tiles, sm_count_of(x.device), config, S)
    mode, bm = cfg["MODE"], cfg["BLOCK_M"]
    wdtype = x.dtype if scaled else gate.dtype            # the dtype the products run in
    precision = "ieee" if wdtype == torch.float32 else "tf32"
    # BLOCK_P: one binary for every N <= 64
    common = dict(TOPK=k, BLOCK_P=max(64, pow2(N)), BLOCK_M=bm, MODE=mode,
                  DOT_PRECISION=precision, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    if scaled:                   # a K tile within one scale block: a power of two <= 128
        gsc, usc, dsc = scales
        common["SCALED"] = True
        for c in (cfg["up"], cfg["down"]):
            c["BLOCK_K"] = min(c["BLOCK_K"], fp8.BLOCK)
            assert fp8.BLOCK % c["BLOCK_K"] == 0, c
    else:                        # unused (SCALED off, the default): any tensor, zero strides
        gsc = usc = dsc = gate
    s_strides = lambda s: s.stride() if scaled else (0, 0, 0)  # noqa: E731
    # the shared weights' scales (SCALED with S > 0); else unused: any tensor, zero strides
    gssc, ussc, dssc = shared_scales if shared_scales is not None else (gate,) * 3
    ss_strides = lambda s: s.stride() if shared_scales is not None else (0, 0)  # noqa: E731
    up_meta = dict(SHARED=S) if scaled else {}      # 16-bit: the default, unsaid
    rows = N + S * T                                      # pairs, then shared (s, t) pairs
    h = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    c1 = cfg["up"]
    run_kernel(_gate_up_kernel, (N + S, triton.cdiv(I, c1["BLOCK_N"])),
               x, gate, up, ids_flat, h, gs, us, gsc, usc, gssc, ussc, N, T, first, E, D, I, IS,
               x.stride(0), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
               gs.stride(0), us.stride(0), h.stride(0), *s_strides(gsc), *s_strides(usc),
               *ss_strides(gssc), *ss_strides(ussc), **common, **up_meta, **c1)
    splits, c2 = cfg["K_SPLITS"], cfg["down"]
    y = torch.empty((splits, rows, D), dtype=torch.float32, device=x.device)
    # every K range starts on a multiple of BLOCK_K (a divisor of 128 with scales): no tile
    # straddles two scale blocks (shared pieces start on one: I % 128 == 0)
    k_chunk = triton.cdiv(triton.cdiv(I, splits), c2["BLOCK_K"]) * c2["BLOCK_K"]
    blocks = triton.cdiv(D, c2["BLOCK_N"])
    fused = cfg["FUSED_COMBINE"]
    counters = arrival_counters(x.device, blocks) if fused else y
    block_t = min(16, pow2(T))
    run_kernel(_down_kernel, (N + S, blocks, splits),
               h, down, w_flat, ids_flat, y, out, counters, ds, dsc, dssc, N, T, first, E, D, I,
               IS, k_chunk, h.stride(0), down.stride(0), down.stride(1), ds.stride(0),
               y.stride(0), y.stride(1), out.stride(0), *s_strides(dsc), *ss_strides(dssc),
               K_SPLITS=splits, SHARED=S, FUSED_COMBINE=fused, BLOCK_T=block_t, **common, **c2)
    if not fused:
        bn = min(256, pow2(D))
        run_kernel(_combine_kernel, (triton.cdiv(D, bn),), y, ids_flat, out, N, T, first, E, D,
                   y.stride(0), y.stride(1), out.stride(0), TOPK=k, K_SPLITS=splits, SHARED=S,
                   BLOCK_T=block_t, BLOCK_N=bn, num_warps=4)
    return out
