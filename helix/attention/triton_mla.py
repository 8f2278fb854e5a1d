"""Absorbed MLA decode (DeepSeek-V2/V3), paged, split along KV.

One latent KV "head" [T, Dl + Dr] is shared by all H query heads, so absorbed MLA is
compute-bound (~240 FLOP/byte at H = 128): the kernel must reuse each KV tile across many heads.
A program owns (head block, split, batch) with BLOCK_H = 64 query heads as the M dimension of
both tensor-core products, and loads each KV tile ONCE for all of them:
    S [BLOCK_H, BLOCK_N] = Q_latent [BLOCK_H, Dl] x C^T [Dl, BLOCK_N]
                         + Q_rope   [BLOCK_H, Dr] x Kr^T [Dr, BLOCK_N]
    O [BLOCK_H, Dl]     += P [BLOCK_H, BLOCK_N] x C [BLOCK_N, Dl]     (the same tile as V)
Q stays resident (shared memory) for the whole split. The head-block index is the fastest grid
axis, so the H / BLOCK_H programs of one (split, batch) run side by side and share each tile
through L2. (64 heads x 512 latent fp32 accumulators = 128 KB of registers over 8 warps: 128
heads would not fit one program.) Small test dims are padded to powers of two >= 16 with masks.

Hopper (sm_90, wgmma) design, checked on the compiled kernel with
profiling/kernel_resources.py (its --mla-candidates lists every variant below); the GPU run of
profiling/tune_mla.py times the variants, all switchable through `mla_decode(config=...)`:
- Two warpgroups (8 warps), M = 64: the PV product gives each warpgroup a [64, 256] half of O
  (m64n256k16, P from registers, 128 fp32 accumulator registers per thread).
- SPLIT_QK: Triton lays out a dot whose result reaches another dot ("chained", flash
  attention) with ALL warps along M. With 64 rows and 8 warps that is both warpgroups computing
  the SAME S with half-width wgmma: twice the QK^T work (~53 % of the FLOPs) and twice its
  shared-memory reads. S is therefore passed through an `if` that is always taken (a value that
  leaves an scf.if through its yield is outside the forward slice that layout pass inspects),
  so QK^T gets warps [4, 2]: each warpgroup computes half of the tile's tokens (m64n32k16 at
  BLOCK_N = 64). The latent and rope products are summed after scaling, not chained through
  the accumulator (which would chain the latent dot again).
- BLOCK_N = 64: QK^T reads Q (2 KB) + K (1 KB) of shared memory per 16 cycles of wgmma math,
  against 2.5 KB per 8 cycles at BLOCK_N = 32. Shared memory: Q 72 KB + 2 stages x 72 KB +
  8 KB for P = 224 KB (one program per SM; 227 KB is the limit, so no third stage).
- The page id of the next tile is loaded one tile ahead and carried through the loop: the
  pipeliner otherwise spends a stage on the page-table indirection (2 * k + 1 stages for
  k + 1 KV buffers), and the deeper pipelines (BLOCK_N = 32, num_stages 3 or 4) get their
  buffers.
- RESCALE_LOG2 > 0: lazy running-max rescale (only when some row's max grows by more than
  2^RESCALE_LOG2; exact, since l and O share the stale max) spares the [64, 512] accumulator
  multiply on most tiles, but its branch costs ~30 registers (spills at BLOCK_N = 64);
  RESCALE_LOG2 = 0 rescales every tile, branch-free.
- DEFER_L: the softmax denominator kept as [BLOCK_H, BLOCK_N] partial sums (no per-tile
  cross-warpgroup row reduction), reduced once at the end.
- USE_TMA: full tiles through in-kernel tensor descriptors (TMA + mbarrier instead of
  per-thread cp.async address math), the partial last tile of a split through masked loads in
  a second loop (TMA cannot mask rows, and stale slots may hold non-finite values). Needs
  unpadded widths and a page-contiguous pool (`tma_ok`), else the launcher turns it off.
- PIPE_QK: software-pipelined S: iteration t issues the QK^T of tile t + 1, then the softmax
  and PV of tile t on the S it carries (the latent QK^T stays in flight through the softmax;
  the rope QK^T's wait(0) retires the previous one). Triton cannot keep one load's buffer for
  the next iteration, so each tile is loaded twice (as K, as V): at BLOCK_N = 32 that fits
  (2 x (36 + 32) KB), at 64 it does not. On triton 3.6 ptxas serializes all its wgmma (C7514:
  the carried S is copied at the loop back edge while its wgmma is in flight), which an
  unrolled-by-two loop would avoid.
- The compiled default (triton 3.6): the next tile's cp.async are issued at the END of the
  loop body (after the PV wgmma) and waited with num = 0 at the top of the next iteration, so
  a load is hidden only behind one PV, not behind the softmax.
- Triton's automatic warp specialisation (`tl.range(..., warp_specialize=True)` on the TMA
  loop) compiles to the same sm_90 binary under triton 3.6 and 3.9 (255 / 254 registers, the
  same 80 wgmma, no setmaxnreg): it does not apply to this loop on Hopper, so a producer /
  consumer split (FlashMLA's design) is out of reach from Triton here.
- exp2 with log2(e) folded into the scale; P converted to the KV dtype for the PV product.
- num_splits is a runtime argument: one binary for every split count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helix.attention import triton_mla_few
from helix.attention.triton_splits import (LN2, LOG2E, choose_num_splits, fill_num_splits,
                                           next_page_id, page_rows, reduce_splits, sm_count_of,
                                           split_range, split_workspace, token_rows)
from helix.triton_util import pdl_sync, run_kernel


@triton.jit
def _scores(ql, qr, c, kr, tmask, t0, end, scale_log2,
            SPLIT_QK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """S [BH, N] = (Q_latent C^T + Q_rope Kr^T) * scale_log2, -inf where ~tmask."""
    if SPLIT_QK:
        s_lat = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        s_rope = tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION)
        s = s_lat * scale_log2 + s_rope * scale_log2      # (a plain + would fuse the dots)
        if t0 < end:      # always true: hides S from the PV dot's layout choice (see top)
            s = tl.where(tmask[None, :], s, float("-inf"))
    else:
        s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(qr, tl.trans(kr), acc=s, input_precision=DOT_PRECISION)
        s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))         # [BH, N]
    return s


@triton.jit
def _softmax_pv(s, c, m_i, l_i, acc, RESCALE_LOG2: tl.constexpr, DEFER_L: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax (base 2): the running max / denominator updated with
    S [BH, N], the accumulator rescaled and += P C."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if RESCALE_LOG2 > 0:
        # Lazy: keep a stale running max until some row's grows by > 2^RESCALE_LOG2 (the
        # first block always rescales: m_i = -inf); p stays <= 2^RESCALE_LOG2.
        grow = tl.max(m_new - m_i, axis=0) > RESCALE_LOG2
        m_use = tl.where(grow, m_new, m_i)
        alpha = tl.exp2(m_i - m_use)
        if grow:
            acc = acc * alpha[:, None]
        m_i = m_use
    else:
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    if DEFER_L:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(c.dtype), c, acc=acc, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_btb"])   # block-table width: varies per step
def _mla_split_kernel(
    ql_ptr, qr_ptr, kv_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
    stride_qlb, stride_qlh,                # q_latent [B, H, Dl]
    stride_qrb, stride_qrh,                # q_rope [B, H, Dr]
    stride_kvp, stride_kvt,                # kv_cache [P, page, Dl + Dr]
    stride_btb,                            # block_tables [B, max_pages] int32
    stride_ob, stride_oh, stride_os,       # o: [B, H, S, Dl] partials, or [B, H, Dl] (S = 1)
    stride_lb, stride_lh,                  # lse: [B, H, S] partials, or [B, H]
    HEADS, num_splits, kv_rows,            # kv_rows = P * page (USE_TMA's descriptors)
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT_QK: tl.constexpr, RESCALE_LOG2: tl.constexpr, DEFER_L: tl.constexpr,
    PIPE_QK: tl.constexpr, USE_TMA: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_sync(PDL)
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < HEADS
    cl = tl.arange(0, BLOCK_DL)
    lmask = cl < D_LATENT
    cr = tl.arange(0, BLOCK_DR)
    rmask = cr < D_ROPE
    # cached values become the query's dtype (fp8 ones too: in fp16, as the other kernels take
    # them under a bf16 query, this kernel spills 160 B on sm_90, in bf16 nothing)
    kv_dtype = ql_ptr.dtype.element_ty

    ql = tl.load(ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + cl[None, :],
                 mask=hmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)   # [BH, DL]
    qr = tl.load(qr_ptr + b * stride_qrb + heads[:, None] * stride_qrh + cr[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0).to(kv_dtype)   # [BH, DR]

    kv_len = tl.load(lens_ptr + b)
    start, end = split_range(kv_len, split, num_splits, BLOCK_N)
    bt_row = bt_ptr + b * stride_btb

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    if DEFER_L:
        l_i = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)
    if PIPE_QK:
        # Software-pipelined S (PAGE_SIZE % BLOCK_N == 0): iteration t0 issues the QK^T of
        # tile t0 + BLOCK_N, then runs the softmax and PV of tile t0 on the S carried from the
        # previous iteration. The rope product is waited on at once (that wait(0) also retires
        # the previous latent QK^T and PV: Triton then keeps the latent QK^T in flight through
        # the softmax). The tile is loaded twice, as K (576 wide) for the next S and as V
        # (latent) for this PV: Triton cannot keep one load's buffer for a later iteration.
        # The loop starts one (empty) tile early instead of peeling a prologue QK^T, whose
        # buffers would stay allocated through the loop; m starts at -FLT_MAX, not -inf, so
        # that empty tile leaves m, l and O as they are (alpha = 1, p = 0).
        m_i = tl.full([BLOCK_H], -3.4028234663852886e38, dtype=tl.float32)
        s_lat = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        s_rope = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        page = next_page_id(bt_row, start, end, PAGE_SIZE)        # K of the first tile
        page_v = page                                             # (V of the empty tile)
        for t0 in range(start - BLOCK_N, end, BLOCK_N):
            rows, tmask = page_rows(page, t0 + BLOCK_N, end, stride_kvp, stride_kvt,
                                    BLOCK_N, PAGE_SIZE)
            kr = tl.load(kv_ptr + rows[:, None] + D_LATENT + cr[None, :],
                         mask=tmask[:, None] & rmask[None, :], other=0.0).to(kv_dtype)
            c = tl.load(kv_ptr + rows[:, None] + cl[None, :],
                        mask=tmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)
            s_rope_next = tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION) * scale_log2
            s_lat_next = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
            # page ids one tile ahead, one load each (a chain of carried ids through two
            # iterations would stop Triton's pipeliner)
            page_v_next = next_page_id(bt_row, t0 + BLOCK_N, end, PAGE_SIZE)
            page_next = next_page_id(bt_row, t0 + 2 * BLOCK_N, end, PAGE_SIZE)
            rows, tmask = page_rows(page_v, t0, end, stride_kvp, stride_kvt, BLOCK_N,
                                    PAGE_SIZE)
            tmask = tmask & (t0 + tl.arange(0, BLOCK_N) >= start)
            s = tl.where(tmask[None, :], s_lat * scale_log2 + s_rope, float("-inf"))
            v = tl.load(kv_ptr + rows[:, None] + cl[None, :],
                        mask=tmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)
            m_i, l_i, acc = _softmax_pv(s, v, m_i, l_i, acc, RESCALE_LOG2, DEFER_L,
                                        DOT_PRECISION)
            s_lat, s_rope = s_lat_next, s_rope_next
            page, page_v = page_next, page_v_next
    elif USE_TMA:
        # Full tiles through tensor descriptors (TMA: a page-aligned tile is BLOCK_N
        # contiguous rows of the pool viewed as [P * page, Dl + Dr]; needs BLOCK_DL == Dl,
        # BLOCK_DR == Dr, PAGE_SIZE % BLOCK_N == 0, the launcher checks), the partial last tile
        # (TMA cannot mask rows: stale slots may hold non-finite values) through masked loads.
        desc_c = tl.make_tensor_descriptor(kv_ptr, shape=[kv_rows, D_LATENT + D_ROPE],
                                           strides=[stride_kvt, 1],
                                           block_shape=[BLOCK_N, BLOCK_DL])
        desc_r = tl.make_tensor_descriptor(kv_ptr + D_LATENT, shape=[kv_rows, D_ROPE],
                                           strides=[stride_kvt, 1],
                                           block_shape=[BLOCK_N, BLOCK_DR])
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
        page = next_page_id(bt_row, start, full_end, PAGE_SIZE)
        for t0 in range(start, full_end, BLOCK_N):
            row0 = (page * PAGE_SIZE + t0 % PAGE_SIZE).to(tl.int32)
            page = next_page_id(bt_row, t0 + BLOCK_N, full_end, PAGE_SIZE)
            c = desc_c.load([row0, 0]).to(kv_dtype)
            kr = desc_r.load([row0, 0]).to(kv_dtype)
            tmask = (t0 + tl.arange(0, BLOCK_N)) < end
            s = _scores(ql, qr, c, kr, tmask, t0, end, scale_log2, SPLIT_QK, DOT_PRECISION)
            m_i, l_i, acc = _softmax_pv(s, c, m_i, l_i, acc, RESCALE_LOG2, DEFER_L,
                                        DOT_PRECISION)
        for t0 in range(full_end, end, BLOCK_N):     # at most one (partial) tile
            rows, tmask = token_rows(bt_row, t0, end, stride_kvp, stride_kvt, BLOCK_N,
                                     PAGE_SIZE)
            c = tl.load(kv_ptr + rows[:, None] + cl[None, :],
                        mask=tmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)
            kr = tl.load(kv_ptr + rows[:, None] + D_LATENT + cr[None, :],
                         mask=tmask[:, None] & rmask[None, :], other=0.0).to(kv_dtype)
            s = _scores(ql, qr, c, kr, tmask, t0, end, scale_log2, SPLIT_QK, DOT_PRECISION)
            m_i, l_i, acc = _softmax_pv(s, c, m_i, l_i, acc, RESCALE_LOG2, DEFER_L,
                                        DOT_PRECISION)
    else:
        if PAGE_SIZE % BLOCK_N == 0:  # a block lies in one page: its id is fetched a tile ahead
            page = next_page_id(bt_row, start, end, PAGE_SIZE)
        for t0 in range(start, end, BLOCK_N):
            if PAGE_SIZE % BLOCK_N == 0:
                rows, tmask = page_rows(page, t0, end, stride_kvp, stride_kvt, BLOCK_N,
                                        PAGE_SIZE)
                page = next_page_id(bt_row, t0 + BLOCK_N, end, PAGE_SIZE)
            else:
                rows, tmask = token_rows(bt_row, t0, end, stride_kvp, stride_kvt, BLOCK_N,
                                         PAGE_SIZE)
            c = tl.load(kv_ptr + rows[:, None] + cl[None, :],
                        mask=tmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)   # [N, DL]
            kr = tl.load(kv_ptr + rows[:, None] + D_LATENT + cr[None, :],
                         mask=tmask[:, None] & rmask[None, :], other=0.0).to(kv_dtype)   # [N, DR]
            s = _scores(ql, qr, c, kr, tmask, t0, end, scale_log2, SPLIT_QK, DOT_PRECISION)
            m_i, l_i, acc = _softmax_pv(s, c, m_i, l_i, acc, RESCALE_LOG2, DEFER_L,
                                        DOT_PRECISION)
    if DEFER_L:
        l_i = tl.sum(l_i, axis=1)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    o_off = b * stride_ob + heads.to(tl.int64)[:, None] * stride_oh + split * stride_os
    tl.store(o_ptr + o_off + cl[None, :], out, mask=hmask[:, None] & lmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


MLA_MIN_TOKENS = 64          # shortest split of the "fill" policy (one 64-token tile)

# The tunables of one MLA launch: kernel meta-parameters (upper case, num_warps, num_stages)
# and launcher choices (lower case). mla_launch_config gives defaults; mla_decode(config=...)
# overrides any of them (profiling/tune_mla.py compares candidates on the GPU).
MLA_TUNABLES = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "SPLIT_QK", "RESCALE_LOG2",
                "DEFER_L", "PIPE_QK", "USE_TMA", "split_policy", "partial_dtype")
SPLIT_POLICIES = ("2waves", "1wave", "fill")


def mla_launch_config(heads: int, d_latent: int, d_rope: int, dtype: torch.dtype) -> dict:
    """Defaults (the best guess before measuring: profiling/tune_mla.py compares them with
    the alternatives on the GPU). DeepSeek (128 heads, Dl 512, Dr 64, bf16) on sm_90 with
    triton 3.6 (profiling/kernel_resources.py): BLOCK_H 64 (two head blocks), BLOCK_N 64, 8
    warps (two warpgroups), 2 stages, SPLIT_QK, eager rescale, deferred denominator: 229
    registers, no spills, 224 KB of shared memory, 40 wgmma per 64-token tile (32 + 4
    m64n32k16 QK^T, 4 m64n256k16 PV) where the previous layout issued 144 (2 x 72 m64n16k16
    QK^T, both warpgroups computing the same S, + 4 m64n256k16) per 64 tokens.
    `dtype` is the KV cache's. Launcher choices: split_policy, how many KV splits when the
    caller gives none: "2waves"
    (choose_num_splits: ~2 waves of programs, splits rounded up to a power of two), "1wave"
    (rounded down: B * head blocks * splits <= #SMs) or "fill" (fill_num_splits: the fewest
    splits whose last wave is >= 90 % full; the kernel holds one program per SM);
    partial_dtype, the dtype of the split partials (None: fp32)."""
    block_dl = max(16, triton.next_power_of_2(d_latent))
    block_dr = max(16, triton.next_power_of_2(d_rope))
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    block_n = 64
    if dtype == torch.float32:          # 4-byte tiles: half the heads and tokens per program
        block_h, block_n = min(block_h, 32), 16 if block_dl >= 256 else 32
    big = block_h * block_dl >= 64 * 256
    return dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=8 if big else 4, num_stages=2,
                # DEFER_L off: the best of 12 configs measured on an H200 (tune_mla_h200.json)
                SPLIT_QK=True, RESCALE_LOG2=0.0, DEFER_L=False, PIPE_QK=False,
                # TMA + "fill": the best of 9 configs on an H200 (tune_mla_h200_v2.json, geomean
                # 38.0 % of the floor against 33.7 % for cp.async + "2waves"); the launcher
                # falls back to cp.async where the pool or dims do not suit TMA (tma_ok)
                # (16-bit KV only: with fp32 tiles the TMA kernel spills, 4.4 KB of stack; with
                # fp8 tiles converted to bf16 in registers, 464 B, where cp.async spills none:
                # sm_90 compiles with triton 3.6, not yet timed)
                USE_TMA=dtype in (torch.bfloat16, torch.float16), split_policy="fill",
                partial_dtype=None,
                BLOCK_DL=block_dl, BLOCK_DR=block_dr)


def mla_plan(batch: int, heads: int, d_latent: int, d_rope: int, dtype: torch.dtype,
             max_context: int, device: torch.device, config: dict | None = None,
             num_splits: int | None = None) -> tuple[dict, int, torch.dtype]:
    """(kernel meta-parameters, num_splits, partial dtype) of one launch: the defaults of
    mla_launch_config overridden by `config` (keys in MLA_TUNABLES)."""
    cfg = mla_launch_config(heads, d_latent, d_rope, dtype)
    unknown = set(config or {}) - set(MLA_TUNABLES)
    if unknown:
        raise ValueError(f"unknown MLA tunables {sorted(unknown)}; known: {MLA_TUNABLES}")
    cfg.update(config or {})
    policy = cfg.pop("split_policy")
    partial_dtype = cfg.pop("partial_dtype") or torch.float32
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"split_policy {policy!r} not in {SPLIT_POLICIES}")
    if num_splits is None:   # fill the GPU: compute-bound, and one program per SM (smem)
        args = (batch, triton.cdiv(heads, cfg["BLOCK_H"]), max_context, sm_count_of(device))
        if policy == "fill":
            # a split may be as short as one tile: a tile is ~3 us of tensor-core work for 64
            # heads, so short contexts gain from spreading it (mla_splits_h200.json: batch 1 x
            # 1K 26.1 -> 18.7 us, 4K 28.5 -> 24.8 us; >= 16K chooses as before)
            num_splits = fill_num_splits(*args, min_tokens=MLA_MIN_TOKENS)
        else:
            num_splits = choose_num_splits(*args, waves=2.0 if policy == "2waves" else 1.0,
                                           round_up=policy == "2waves")
    return cfg, num_splits, partial_dtype


def tma_ok(kv_cache: torch.Tensor, block_n: int, block_dl: int, block_dr: int, d_latent: int,
           d_rope: int) -> bool:
    """Whether USE_TMA's descriptors can address this pool: pages contiguous (the pool is a
    [P * page, Dl + Dr] matrix), 16-byte aligned base, row stride and rope offset, unpadded
    latent / rope widths (a box cannot mask columns) and tiles inside one page."""
    P, page, width = kv_cache.shape
    elt = kv_cache.element_size()
    return (block_dl == d_latent and block_dr == d_rope and page % block_n == 0
            and kv_cache.stride(0) == page * kv_cache.stride(1) and kv_cache.stride(2) == 1
            and kv_cache.data_ptr() % 16 == 0 and (kv_cache.stride(1) * elt) % 16 == 0
            and (d_latent * elt) % 16 == 0 and P * page < 2**31)


def ensure_tma_allocator() -> None:
    """In-kernel tensor descriptors need a global scratch allocator (128 B per descriptor and
    program); installed once, unless the process already set one."""
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, align, stream: torch.empty(
            size, dtype=torch.int8, device=torch.cuda.current_device()))


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
               block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
               num_splits: int | None = None, block_n: int | None = None,
               block_h: int | None = None,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [B, H, Dl], q_rope [B, H, Dr], kv_cache [P, page, Dl + Dr] (latent, rope key),
    block_tables [B, max_pages] int32, kv_lens [B] int32 -> o [B, H, Dl] in q_latent.dtype,
    lse [B, H] fp32 (natural log, -inf where kv_len == 0). `config` overrides any of
    MLA_TUNABLES (block_n / block_h: shorthands for BLOCK_N / BLOCK_H). Few heads go to
    triton_mla_few's kernel (triton_mla_few.routes) when no tunable of this kernel is given."""
    B, H, Dl = q_latent.shape
    if triton_mla_few.routes(H) and config is None and block_n is None and block_h is None:
        return triton_mla_few.mla_decode_few(q_latent, q_rope, kv_cache, block_tables, kv_lens,
                                             scale, num_splits)
    Dr = q_rope.shape[-1]
    _, page_size, width = kv_cache.shape
    assert width == Dl + Dr and kv_cache.stride(-1) == 1
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    o = torch.empty((B, H, Dl), dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.empty((B, H), dtype=torch.float32, device=q_latent.device)
    if B == 0:
        return o, lse
    config = dict(config or {})
    if block_n is not None:
        config["BLOCK_N"] = block_n
    if block_h is not None:
        config["BLOCK_H"] = block_h
    cfg, num_splits, partial_dtype = mla_plan(B, H, Dl, Dr, kv_cache.dtype,
                                              block_tables.shape[1] * page_size,
                                              q_latent.device, config, num_splits)
    head_blocks = triton.cdiv(H, cfg["BLOCK_H"])
    o_ws, lse_ws, so, sl = split_workspace(o, lse, num_splits, partial_dtype)
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"   # products in q's dtype
    if cfg["PIPE_QK"] and page_size % cfg["BLOCK_N"]:
        cfg["PIPE_QK"] = False                  # the pipelined loop needs a page id per tile
    if cfg["PIPE_QK"]:
        cfg["USE_TMA"] = False                  # the kernel's loops are exclusive: PIPE_QK wins
    if cfg["USE_TMA"] and not tma_ok(kv_cache, cfg["BLOCK_N"], cfg["BLOCK_DL"], cfg["BLOCK_DR"],
                                     Dl, Dr):
        cfg["USE_TMA"] = False
    if cfg["USE_TMA"] and kv_cache.is_cuda:
        ensure_tma_allocator()
    run_kernel(
        _mla_split_kernel, (head_blocks, num_splits, B),
        q_latent, q_rope, kv_cache, block_tables, kv_lens, o_ws, lse_ws, scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), *so, *sl,
        H, num_splits, kv_cache.shape[0] * page_size, Dl, Dr, PAGE_SIZE=page_size,
        DOT_PRECISION=precision, **cfg)
    if num_splits > 1:
        reduce_splits(o_ws, lse_ws, o, lse)
    return o, lse
