"""The absorbed MLA layer's output at decode in ONE launch: the merge of the attention kernel's
split partials, W_UV's absorption and o_proj.

    project(o_ws [T, H, S, Dl], lse_ws [T, H, S], kv_lens [T], live, w_uv [H, v, Dl],
            w_o [N, H * v]) -> [T, N]
      = linear(absorb_v(merge(o_ws, lse_ws), w_uv), w_o)

(o_proj's product before its all-reduce and bias: RowShardLinear.reduce_partial adds those.)
`live` = (block_n, min_chunk) of triton_splits.live_splits: the splits a short sequence leaves
empty hold nothing and are skipped, as reduce_splits skips them; (0, 0): every split is read.

Why. At one row the three launches this replaces (reduce_splits, the W_UV GEMV, the o_proj
GEMV) are each a few us of launch, ramp and dependency for well under a us of bytes; in a
DeepSeek-V2-Lite step at batch 1 they were ~10 us of a layer's critical path. Here:

- grid: P <= SM-count programs, every one resident at once (a grid barrier follows). Before
  the PDL wait each program loads its first W_UV tile and its first block of o_proj rows (its
  whole [BLOCK_NO, H * v] tile, in registers): weights are no kernel's output, so they stream
  while the attention kernel runs.
- phase 1, items (row, head, latent chunk of CHUNK): the exact log-sum-exp merge of the
  chunk's splits (triton_splits.lse_merge, the rule reduce_splits uses), rounded to the
  weights' dtype as reduce_splits' output is; its product with W_UV[head, :, chunk]: an fp32
  partial of that head's v outputs, stored per chunk.
- a grid barrier: one GPU-scope counter (helix.triton_util.arrival_counters), every program
  counted in after its stores (acq_rel), spinning on acquire reads until all are in, and
  counted out again; the last out resets it to 0 (CUDA-graph safe).
- phase 2, items (o_proj row blocks): the chunks' partials summed in chunk order (one fixed
  order: deterministic) and rounded (absorb_v's output), then the product with the block's
  rows, rounded once.

The barrier needs every program resident: P <= the SM count and a program's footprint is
small, so once the kernel before it drains they all are; under PDL the kernel after this one
launches only when every program of this one has passed its wait (all resident), so it cannot
take their place. In Triton's interpreter programs run one after another and a barrier would
never open: there the two phases are two launches of the same kernel (PHASE 1, then 2).

Rounding: the merge and o_proj round as the three launches do; W_UV's K sum runs in chunks
(fp32, summed in order) where the GEMV summed it at once, so y may differ from absorb_v's in
its last bf16 bit (tests bound it).
"""

from __future__ import annotations

import torch

from helix.layers.fused_ops import use_triton
from helix.triton_util import (HAS_TRITON, _INTERPRETED, arrival_counters, pdl_sync, pow2,
                               prefetch_l2, run_kernel, tl, triton)

ENABLED = True          # module flag (benches switch it); read per call
MAX_ROWS = 2            # decode rows a launch takes (the one-tile GEMV's regime)
TILE = 16384            # o_proj weight elements of a phase-2 item (registers)
PART_ELEMENTS = 8192    # elements of a phase-1 tile: partials [splits, CHUNK], W_UV [v, CHUNK]
NUM_WARPS = 8
PREFETCH = True         # o_proj's rows into L2 before the PDL wait (benches switch it)


def takes(rows: int, kvp: int) -> bool:
    """The shape part of the rule: a decode step of `rows` rows whose KVP group is one rank
    (the split partials are the whole attention; past one rank the exchange merges them)
    runs the one launch. helix.perf.cost counts the step's kernels with it."""
    return ENABLED and kvp == 1 and 0 < rows <= MAX_ROWS


def fits(x: torch.Tensor, rows: int, kvp: int, w_uv: torch.Tensor, w_o: torch.Tensor) -> bool:
    """Whether MLAAttention takes project() for a decode step of `rows` rows (x: a tensor of
    the step, for its device): takes(), a Triton device, one float dtype for both weights,
    unit strides along their K axes."""
    return (takes(rows, kvp) and use_triton(x) and w_uv.dtype == w_o.dtype
            and w_uv.dtype.is_floating_point and w_uv.stride(2) == 1 and w_o.stride(1) == 1
            and w_o.shape[1] == w_uv.shape[0] * w_uv.shape[1])


if HAS_TRITON:
    from helix.attention.triton_splits import live_splits, lse_weights

    @triton.jit
    def _wuv_tile(wuv_ptr, i, H, C, V, DL, s_wh, s_wv, CHUNK: tl.constexpr,
                  BLOCK_V: tl.constexpr):
        """W_UV[head, :, chunk] of phase-1 item i: [BLOCK_V, CHUNK]."""
        v = tl.arange(0, BLOCK_V)
        d = (i % C) * CHUNK + tl.arange(0, CHUNK)
        h = ((i // C) % H).to(tl.int64)
        return tl.load(wuv_ptr + h * s_wh + v[:, None] * s_wv + d[None, :],
                       mask=(v < V)[:, None] & (d < DL)[None, :], other=0.0)

    @triton.jit
    def _merge_absorb(i, w, ows_ptr, lws_ptr, lens_ptr, part_ptr, H, C, V, DL,
                      s_ob, s_oh, s_os, s_lb, s_lh,
                      NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_V: tl.constexpr, ROWS: tl.constexpr, LIVE_BLOCK_N: tl.constexpr,
                      LIVE_MIN_CHUNK: tl.constexpr):
        """Phase-1 item i = (row b, head h, chunk c) with its W_UV tile w: the chunk's merged
        latent output, rounded, times w -> fp32 partials [c, b, h * V : (h + 1) * V]."""
        b = i // (H * C)
        h = (i // C) % H
        c = i % C
        d = c * CHUNK + tl.arange(0, CHUNK)
        sidx = tl.arange(0, BLOCK_S)
        smask = sidx < NUM_SPLITS
        if LIVE_BLOCK_N > 0:
            smask = live_splits(tl.load(lens_ptr + b), sidx, NUM_SPLITS, LIVE_BLOCK_N,
                                LIVE_MIN_CHUNK)
        lse = tl.load(lws_ptr + b * s_lb + h * s_lh + sidx[None, :], mask=smask[None, :],
                      other=float("-inf"))                                      # [1, S]
        ws, _ = lse_weights(lse)
        part = tl.load(ows_ptr + b * s_ob + h * s_oh + sidx[:, None] * s_os + d[None, :],
                       mask=smask[:, None] & (d < DL)[None, :], other=0.0)     # [S, CHUNK]
        o = tl.sum(tl.reshape(ws, [BLOCK_S])[:, None] * part.to(tl.float32), axis=0)
        o = o.to(w.dtype).to(tl.float32)                                         # [CHUNK]
        y = tl.sum(w.to(tl.float32) * o[None, :], axis=1)                        # [BLOCK_V]
        v = tl.arange(0, BLOCK_V)
        tl.store(part_ptr + (c * ROWS + b) * (H * V) + h * V + v, y, mask=v < V)

    @triton.jit
    def _w_uv_out(part_ptr, T, C, HV, ROWS: tl.constexpr, BLOCK_HV: tl.constexpr):
        """Every row's W_UV output [ROWS, BLOCK_HV]: phase 1's chunk partials summed in chunk
        order (read through L2: other programs wrote them), rounded as absorb_v rounds."""
        r = tl.arange(0, ROWS)
        j = tl.arange(0, BLOCK_HV)
        mask = (r < T)[:, None] & (j < HV)[None, :]
        y = tl.zeros([ROWS, BLOCK_HV], dtype=tl.float32)
        for c in range(C):
            y += tl.load(part_ptr + (c * ROWS + r)[:, None] * HV + j[None, :], mask=mask,
                         other=0.0, cache_modifier=".cg")
        return y

    @triton.jit
    def _wo_tile(wo_ptr, nb, N, HV, s_wo, BLOCK_NO: tl.constexpr, BLOCK_HV: tl.constexpr):
        """o_proj's rows of phase-2 block nb: [BLOCK_NO, BLOCK_HV]."""
        n = nb * BLOCK_NO + tl.arange(0, BLOCK_NO)
        j = tl.arange(0, BLOCK_HV)
        return tl.load(wo_ptr + n.to(tl.int64)[:, None] * s_wo + j[None, :],
                       mask=(n < N)[:, None] & (j < HV)[None, :], other=0.0)

    @triton.jit
    def _project_block(nb, w, y, out_ptr, T, N, s_out, BLOCK_NO: tl.constexpr,
                       ROWS: tl.constexpr):
        """Phase-2 block nb with its o_proj rows w: every row of y times w, rounded once."""
        n = nb * BLOCK_NO + tl.arange(0, BLOCK_NO)
        y = y.to(w.dtype).to(tl.float32)
        rid = tl.arange(0, ROWS)[:, None]
        for r in tl.static_range(ROWS):
            if r < T:
                yr = tl.sum(tl.where(rid == r, y, 0.0), axis=0)                  # row r
                acc = tl.sum(w.to(tl.float32) * yr[None, :], axis=1)
                tl.store(out_ptr + r * s_out + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)

    @triton.jit(do_not_specialize=["T"])
    def _mla_out_kernel(ows_ptr, lws_ptr, lens_ptr, wuv_ptr, wo_ptr, part_ptr, out_ptr, bar_ptr,
                        T, H, DL, V, N,
                        s_ob, s_oh, s_os,          # o_ws [T, H, S, DL] (unit stride along DL)
                        s_lb, s_lh,                # lse_ws [T, H, S] (unit stride along S)
                        s_wh, s_wv,                # w_uv [H, V, DL] (unit stride along DL)
                        s_wo,                      # w_o [N, H * V] (unit stride along H * V)
                        s_out,                     # out [T, N] (unit stride along N)
                        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_NO: tl.constexpr, BLOCK_HV: tl.constexpr,
                        ROWS: tl.constexpr, LIVE_BLOCK_N: tl.constexpr,
                        LIVE_MIN_CHUNK: tl.constexpr, PHASE: tl.constexpr,
                        PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
        """Module doc. PHASE 0: both phases and the barrier (one launch); 1 or 2: that phase
        alone (the interpreter's two launches). Partials part_ptr: [C, ROWS, H * V] fp32.
        Program p's first phase-1 item (p itself) runs on the W_UV tile loaded before the
        wait, later ones (p + P, ...) load theirs; its o_proj rows are asked of L2 before the
        wait (PREFETCH), its first block read from there into registers under the barrier,
        later blocks in phase 2."""
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        HV = H * V
        C = tl.cdiv(DL, CHUNK)
        items = T * H * C                          # phase 1: (row, head, latent chunk)
        blocks = tl.cdiv(N, BLOCK_NO)              # phase 2: blocks of o_proj's rows
        wuv0 = _wuv_tile(wuv_ptr, pid, H, C, V, DL, s_wh, s_wv, CHUNK, BLOCK_V)
        if PDL and PREFETCH:    # o_proj's rows of this program into L2 (no registers held)
            for nb in range(pid, blocks, P):
                n = nb * BLOCK_NO + tl.arange(0, BLOCK_NO)
                prefetch_l2(wo_ptr + n.to(tl.int64) * s_wo,
                            HV * (wo_ptr.dtype.element_ty.primitive_bitwidth // 8), n < N)
        pdl_sync(PDL)
        if PHASE != 2:
            if pid < items:
                _merge_absorb(pid, wuv0, ows_ptr, lws_ptr, lens_ptr, part_ptr, H, C, V, DL,
                              s_ob, s_oh, s_os, s_lb, s_lh, NUM_SPLITS, BLOCK_S, CHUNK, BLOCK_V,
                              ROWS, LIVE_BLOCK_N, LIVE_MIN_CHUNK)
            for i in range(pid + P, items, P):
                _merge_absorb(i, _wuv_tile(wuv_ptr, i, H, C, V, DL, s_wh, s_wv, CHUNK, BLOCK_V),
                              ows_ptr, lws_ptr, lens_ptr, part_ptr, H, C, V, DL,
                              s_ob, s_oh, s_os, s_lb, s_lh, NUM_SPLITS, BLOCK_S, CHUNK, BLOCK_V,
                              ROWS, LIVE_BLOCK_N, LIVE_MIN_CHUNK)
        wo0 = _wo_tile(wo_ptr, pid, N, HV, s_wo, BLOCK_NO, BLOCK_HV)   # (L2) under the barrier
        if PHASE == 0:
            # grid barrier: counted in after the stores, out after the wait; the last out
            # resets the counter
            tl.debug_barrier()
            tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            while seen < P:
                seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            if tl.atomic_add(bar_ptr, 1, sem="relaxed", scope="gpu") == 2 * P - 1:
                tl.store(bar_ptr, 0)
        if PHASE != 1:
            y = _w_uv_out(part_ptr, T, C, HV, ROWS, BLOCK_HV)
            if pid < blocks:
                _project_block(pid, wo0, y, out_ptr, T, N, s_out, BLOCK_NO, ROWS)
            for nb in range(pid + P, blocks, P):
                _project_block(nb, _wo_tile(wo_ptr, nb, N, HV, s_wo, BLOCK_NO, BLOCK_HV), y,
                               out_ptr, T, N, s_out, BLOCK_NO, ROWS)


def plan(T: int, H: int, V: int, DL: int, N: int, splits: int, sm_count: int) -> dict:
    """Tiles and grid from shapes only (graph-safe): CHUNK latent columns a phase-1 item (its
    [splits, CHUNK] partials and [v, CHUNK] of W_UV: tiles of at most PART_ELEMENTS),
    BLOCK_NO o_proj rows a phase-2 item (a [BLOCK_NO, H * v] tile of at most TILE elements,
    halved while the blocks would not occupy half the SMs), P programs: the larger item
    count, at most the SM count. DeepSeek-V2-Lite at one row, 132 SMs, 128 splits: 16 heads x
    8 chunks of 64, 128 blocks of 16 rows, 128 programs."""
    block_s = pow2(splits)
    block_hv = pow2(H * V)
    chunk = min(pow2(DL), max(16, PART_ELEMENTS // block_s), max(16, PART_ELEMENTS // pow2(V)))
    block_no = max(1, TILE // block_hv)
    while block_no > 1 and -(-N // block_no) < sm_count // 2:
        block_no //= 2
    items = T * H * -(-DL // chunk)
    programs = max(1, min(sm_count, max(items, -(-N // block_no))))
    return dict(programs=programs, BLOCK_S=block_s, CHUNK=chunk, BLOCK_V=pow2(V),
                BLOCK_NO=block_no, BLOCK_HV=block_hv, ROWS=pow2(T))


def project(o_ws: torch.Tensor, lse_ws: torch.Tensor, kv_lens: torch.Tensor,
                   live: tuple[int, int], w_uv: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Module doc, on the kernel: one launch (two in Triton's interpreter). The caller checks
    fits()."""
    from helix.attention.triton_splits import sm_count_of
    T, H, S, DL = o_ws.shape
    V = w_uv.shape[1]
    N = w_o.shape[0]
    assert T <= MAX_ROWS and w_uv.shape == (H, V, DL) and w_o.shape[1] == H * V
    assert lse_ws.shape == (T, H, S) and lse_ws.stride(2) == 1 and o_ws.stride(3) == 1
    assert w_uv.stride(2) == 1 and w_o.stride(1) == 1
    out = torch.empty((T, N), dtype=w_o.dtype, device=w_o.device)
    if T == 0:
        return out
    p = plan(T, H, V, DL, N, S, sm_count_of(o_ws.device))
    programs = p.pop("programs")
    part = torch.empty((-(-DL // p["CHUNK"]), p["ROWS"], H * V), dtype=torch.float32,
                       device=o_ws.device)
    bar = arrival_counters(o_ws.device, 1)
    block_n, min_chunk = live
    args = (o_ws, lse_ws, kv_lens, w_uv, w_o, part, out, bar, T, H, DL, V, N,
            o_ws.stride(0), o_ws.stride(1), o_ws.stride(2), lse_ws.stride(0), lse_ws.stride(1),
            w_uv.stride(0), w_uv.stride(1), w_o.stride(0), out.stride(0))
    meta = dict(NUM_SPLITS=S, LIVE_BLOCK_N=block_n, LIVE_MIN_CHUNK=min_chunk, PREFETCH=PREFETCH,
                num_warps=NUM_WARPS, num_stages=1, **p)
    for phase in ((1, 2) if _INTERPRETED else (0,)):
        run_kernel(_mla_out_kernel, (programs,), *args, PHASE=phase, **meta)
    return out
