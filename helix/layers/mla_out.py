"""Absorbed MLA's split merge and W_UV's absorption in ONE launch at decode.

    absorb_splits(o_ws [T, H, S, Dl], lse_ws [T, H, S], kv_lens [T], live, w_uv [H, v, Dl])
        -> [T, H * v] = absorb_v(merge(o_ws, lse_ws), w_uv)       (o_proj's input)

`live` = (block_n, min_chunk) of triton_splits.live_splits: the splits a short sequence leaves
empty hold nothing and are skipped, as reduce_splits skips them; (0, 0): every split is read.

Why. At one row the layer's attention output was three launches after the attention kernel:
reduce_splits, the W_UV GEMV (skinny_gemm.absorb_v), the o_proj GEMV; each is a few us of
launch, ramp and dependency for well under a us of bytes. Here the first two are one:

- grid: one program an item (row b, head h, latent chunk c of CHUNK columns). Before the PDL
  wait it loads its W_UV[h, :, chunk] tile (weights are no kernel's output: the tile streams
  while the attention kernel runs).
- the exact log-sum-exp merge of the chunk's splits (triton_splits.lse_weights, the rule
  reduce_splits uses), rounded to the weights' dtype as reduce_splits' output is; its
  product with the tile: an fp32 partial of head h's v outputs.
- the head's last chunk to arrive (helix.triton_util.last_to_arrive, a counter per row and
  head) sums the C partials in chunk order (deterministic) and stores the head's outputs,
  rounded as absorb_v rounds them.
o_proj stays its own GEMV launch, which loads its weight tiles before its PDL wait, so they
stream while this launch runs.

Measured and not kept (profiling/results/mla_out.md): o_proj in this launch too, after a grid
barrier. Correct, but slower on the H200 (DeepSeek-V2-Lite 1 x 1K 1.80 -> 1.86-1.89 ms): the
barrier costs about what a launch boundary does, and o_proj's rows no longer stream under an
earlier kernel (asked of L2 there, they slowed the attention kernel beside them).

Rounding: the merge and the output round where the two launches do; W_UV's K sum runs in
chunks (fp32, summed in order) where the GEMV summed it at once, so an output may differ from
absorb_v's in its last bf16 bit (tests bound it).
"""

from __future__ import annotations

import torch

from helix.layers.fused_ops import use_triton
from helix.triton_util import (HAS_TRITON, arrival_counters, last_to_arrive, pdl_sync, pow2,
                               run_kernel, tl, triton)

ENABLED = True          # module flag (benches switch it); read per call
MAX_ROWS = 2            # decode rows a launch takes (the one-tile GEMV's regime)
PART_ELEMENTS = 8192    # elements of an item's tiles: partials [splits, CHUNK], W_UV [v, CHUNK]
NUM_WARPS = 4


def takes(rows: int, kvp: int) -> bool:
    """The shape part of the rule: a decode step of `rows` rows whose KVP group is one rank
    (the split partials are the whole attention; past one rank the exchange merges them)
    runs the one launch. helix.perf.cost counts the step's kernels with it."""
    return ENABLED and kvp == 1 and 0 < rows <= MAX_ROWS


def fits(x: torch.Tensor, rows: int, kvp: int, w_uv: torch.Tensor) -> bool:
    """Whether MLAAttention takes absorb_splits() for a decode step of `rows` rows (x: a
    tensor of the step, for its device): takes(), a Triton device, a float W_UV with unit
    stride along the latent dims."""
    return (takes(rows, kvp) and use_triton(x) and w_uv.dtype.is_floating_point
            and w_uv.stride(2) == 1)


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
    def _merge_absorb(i, w, ows_ptr, lws_ptr, lens_ptr, part_ptr, y_ptr, cnt_ptr, H, C, V, DL,
                      s_ob, s_oh, s_os, s_lb, s_lh,
                      NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_V: tl.constexpr, ROWS: tl.constexpr, LIVE_BLOCK_N: tl.constexpr,
                      LIVE_MIN_CHUNK: tl.constexpr):
        """Phase-1 item i = (row b, head h, chunk c) with its W_UV tile w: the chunk's merged
        latent output, rounded, times w -> fp32 partials [c, b, h * V : (h + 1) * V]; the
        head's last chunk to arrive (a counter per (b, h)) sums its C partials in chunk order
        and stores the head's W_UV output, rounded, at y [b, h * V : (h + 1) * V]."""
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
        vmask = v < V
        tl.store(part_ptr + (c * ROWS + b) * (H * V) + h * V + v, y, mask=vmask)
        cnt = cnt_ptr + b * H + h
        if last_to_arrive(cnt, C):          # the head's last chunk: its W_UV output, summed
            y = tl.zeros([BLOCK_V], dtype=tl.float32)                  # in chunk order
            for cc in range(C):
                y += tl.load(part_ptr + (cc * ROWS + b) * (H * V) + h * V + v, mask=vmask,
                             other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + b * (H * V) + h * V + v, y.to(y_ptr.dtype.element_ty), mask=vmask)
            tl.store(cnt, 0)

    @triton.jit
    def _absorb_splits_kernel(ows_ptr, lws_ptr, lens_ptr, wuv_ptr, part_ptr, y_ptr, cnt_ptr,
                              H, DL, V,
                              s_ob, s_oh, s_os,     # o_ws [T, H, S, DL] (unit stride along DL)
                              s_lb, s_lh,           # lse_ws [T, H, S] (unit stride along S)
                              s_wh, s_wv,           # w_uv [H, V, DL] (unit stride along DL)
                              NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                              CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
                              LIVE_BLOCK_N: tl.constexpr, LIVE_MIN_CHUNK: tl.constexpr,
                              PDL: tl.constexpr = False):
        """Module doc; program i = item (b, h, c). Partials part_ptr [C, ROWS, H * V] fp32,
        y [T, H * V], counters cnt_ptr [b * H + h]."""
        i = tl.program_id(0)
        C = tl.cdiv(DL, CHUNK)
        w = _wuv_tile(wuv_ptr, i, H, C, V, DL, s_wh, s_wv, CHUNK, BLOCK_V)
        pdl_sync(PDL)
        _merge_absorb(i, w, ows_ptr, lws_ptr, lens_ptr, part_ptr, y_ptr, cnt_ptr, H, C, V, DL,
                      s_ob, s_oh, s_os, s_lb, s_lh, NUM_SPLITS, BLOCK_S, CHUNK, BLOCK_V, ROWS,
                      LIVE_BLOCK_N, LIVE_MIN_CHUNK)


def plan(T: int, H: int, V: int, DL: int, splits: int) -> dict:
    """Tiles from shapes only (graph-safe): CHUNK latent columns an item, its [splits, CHUNK]
    partials and [v, CHUNK] of W_UV tiles of at most PART_ELEMENTS. DeepSeek-V2-Lite at one
    row, 128 splits: 16 heads x 8 chunks of 64, 128 programs."""
    block_s = pow2(splits)
    chunk = min(pow2(DL), max(16, PART_ELEMENTS // block_s), max(16, PART_ELEMENTS // pow2(V)))
    return dict(programs=T * H * -(-DL // chunk), BLOCK_S=block_s, CHUNK=chunk,
                BLOCK_V=pow2(V), ROWS=pow2(T))


def absorb_splits(o_ws: torch.Tensor, lse_ws: torch.Tensor, kv_lens: torch.Tensor,
                  live: tuple[int, int], w_uv: torch.Tensor) -> torch.Tensor:
    """Module doc, on the kernel (the caller checks fits())."""
    T, H, S, DL = o_ws.shape
    V = w_uv.shape[1]
    assert T <= MAX_ROWS and w_uv.shape == (H, V, DL) and w_uv.stride(2) == 1
    assert lse_ws.shape == (T, H, S) and lse_ws.stride(2) == 1 and o_ws.stride(3) == 1
    y = torch.empty((T, H * V), dtype=w_uv.dtype, device=w_uv.device)
    if T == 0:
        return y
    p = plan(T, H, V, DL, S)
    programs = p.pop("programs")
    part = torch.empty((-(-DL // p["CHUNK"]), p["ROWS"], H * V), dtype=torch.float32,
                       device=o_ws.device)
    cnt = arrival_counters(o_ws.device, T * H)
    block_n, min_chunk = live
    run_kernel(_absorb_splits_kernel, (programs,), o_ws, lse_ws, kv_lens, w_uv, part, y, cnt,
               H, DL, V, o_ws.stride(0), o_ws.stride(1), o_ws.stride(2), lse_ws.stride(0),
               lse_ws.stride(1), w_uv.stride(0), w_uv.stride(1), NUM_SPLITS=S,
               LIVE_BLOCK_N=block_n, LIVE_MIN_CHUNK=min_chunk, num_warps=NUM_WARPS,
               num_stages=1, **p)
    return y
