"""Products of a few rows with a weight matrix (decode-sized GEMMs), one Triton launch each.

    linear(x [T, K], w [N, K], bias [N] | None) -> [T, N]          = F.linear(x, w, bias)
    absorb_q(q [T, h, K], w_uk [h, K, N]) -> [T, h, N]             = einsum("thk,hkn->thn")
    absorb_v(o [T, h, K], w_uv [h, N, K]) -> [T, h * N]            = einsum("thk,hnk->thn")
                                                                     .reshape(T, -1)
(absorbed MLA: the queries' nope dims into latent space through W_UK, the latent outputs to
value dims through W_UV, per head.)

At decode a projection's rows are 1-16 tokens, so the GEMM is a weight stream: its time is the
weight's bytes at the copy rate plus the launch. cuBLAS picks tiles for that well enough alone,
but its kernels are not launched with programmatic dependent launch (helix.triton_util), so the
kernel after each one waits for it to drain before it even launches; in a DeepSeek-V2-Lite
step at batch 1 four of a layer's ~14 launches are cuBLAS (q, kv_a and o projections, W_UK's
absorption). Here the projection is a PDL kernel like the rest of the step.

One kernel, `_skinny_kernel`, grid (feature blocks, K splits, groups): program (nb, s, g)
computes y[:, g, nb*BLOCK_N : +BLOCK_N] over K range s of group g's weight, as tl.dot of the
rows (padded to BLOCK_T >= 16) with a [BLOCK_N, BLOCK_K] weight tile read along its unit-stride
axis (K for a linear layer's [N, K] weight, N for W_UK's [h, K, N]). With SPLIT_K > 1 the
programs write fp32 partials, and the last program of a feature block to arrive (an arrival
counter: helix.triton_util.arrival_counters) sums them in split order, adds the bias and
rounds once: deterministic, no atomics on data. Accumulation is fp32 and the output rounded
once to x.dtype, as cuBLAS does; only the order of the K sum differs from it. The kernel's body
is `_skinny_program`, which fused_mla's W_UK + kv-row launch runs in its first programs
(skinny_launch gives the grid and arguments).

At one or two rows (GEMV_MAX_ROWS) with K <= GEMV_MAX_K and the weight's unit stride along K
(linear layers, W_UV), `_gemv_kernel` runs instead: grid (feature blocks, groups), each
program loads its whole [BLOCK_N, K] weight tile in one go, BEFORE the PDL wait (GEMV_EARLY:
weights are no kernel's output, so the tile streams while the previous kernel runs), and takes
the products in fp32 registers: one DRAM round trip a program, no split, no second pass. In a
chain of DeepSeek-V2-Lite's per-layer projections on the H200 it took 17.6 -> 11.9 us a layer
at one row (profiling/results/gemv.md); at four rows the skinny kernel was faster.

The public functions take a kernel on CUDA for T <= MAX_ROWS rows of 16-bit data (absorb_v:
ABSORB_MAX_ROWS rows, prefill chunks too, of any float dtype) whose weight is at most
MAX_WEIGHT_ELEMENTS (an LM head streams at the copy rate in cuBLAS already), with
HELIX_SKINNY_GEMM not "0" (module flag ENABLED, read per call: benches switch it); everywhere
else they run the torch formula.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from helix.layers.fused_ops import add_rms_norm, use_triton
from helix.triton_util import (HAS_TRITON, arrival_counters, last_to_arrive, pdl_sync, pow2,
                               prefetch_l2, prefetching, run_kernel, tl, triton)

ENABLED = os.environ.get("HELIX_SKINNY_GEMM", "1") != "0"
MAX_ROWS = 16
ABSORB_MAX_ROWS = 64
MAX_WEIGHT_ELEMENTS = 64 << 20
# Past the GEMV's rows (GEMV_MAX_ROWS), linear() takes the skinny kernel only for weights of at
# most this many elements; larger ones go to cuBLAS. H200, whole steps at 4 and 8 rows x 1K
# (profiling/results/step_small/skinny_*_ca5c464_h200): Llama-3.1-8B (projections of 16.8-58.7M
# elements) 4.957 / 5.371 ms on the skinny kernel against 4.720 / 4.955 on cuBLAS;
# DeepSeek-V2-Lite (<= 7.5M) 3.977 / 5.576 against 4.040 / 5.681. Module flag: benches switch it.
SKINNY_MAX_WEIGHT_ELEMENTS = 8 << 20
TUNABLES = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
# The one-tile GEMV (_gemv_kernel): module flags read per call (benches switch them)
GEMV = os.environ.get("HELIX_GEMV", "1") != "0"
GEMV_EARLY = True              # its weight tile loaded before the PDL wait
GEMV_MAX_ROWS = 2              # measured: slower than the skinny kernel at 4 rows
GEMV_MAX_K = 4096             # one tile's K; past it, K in equal ranges (GEMV_SPLIT)
GEMV_SPLIT = True              # module flag (benches switch it): split K past GEMV_MAX_K
GEMV_SPLIT_MAX_ELEMENTS = 32 << 20   # ... for weights up to this size (measured, step_small.md)
GEMV_TUNABLES = ("TILE", "BLOCK_N", "num_warps")
NORM_IN_GEMV = True            # add_norm_linear: the input norm in the GEMV's launch
NORM_MIN_ROWS = 4              # ... where a program's weight tile has at least this many rows

if HAS_TRITON:
    from helix.layers.fused_ops import _added, _normed, _rstd

    @triton.jit
    def _skinny_program(nb, ks, g, n_blocks, G,
                        x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
                        T, N, K, k_chunk, sxt, sxg, swg, swn, swk, syt, syg,
                        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
        """Program (nb, ks, g) of _skinny_kernel, whose grid is (n_blocks, SPLIT_K, G); also
        the GEMM part of a launch that does other work in further programs
        (fused_mla._absorb_kv_row_kernel)."""
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        k_lo = ks * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        # the weight tile is no kernel's output: L2 may fetch it while the previous one runs
        if prefetching(PDL):
            esize = w_ptr.dtype.element_ty.primitive_bitwidth // 8
            if swk == 1:                   # rows along N, each contiguous over the K range
                prefetch_l2(w_ptr + g * swg + n.to(tl.int64) * swn + k_lo,
                            (k_hi - k_lo) * esize, nmask)
            else:                          # rows along K, each BLOCK_N contiguous features
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    kk = k0 + tl.arange(0, BLOCK_K)
                    prefetch_l2(w_ptr + g * swg + kk.to(tl.int64) * swk + nb * BLOCK_N,
                                tl.minimum(BLOCK_N, N - nb * BLOCK_N) * esize, kk < k_hi)
        pdl_sync(PDL)
        t = tl.arange(0, BLOCK_T)
        tmask = t < T
        x_rows = x_ptr + t.to(tl.int64)[:, None] * sxt + g * sxg                    # [BT, 1]
        w_rows = w_ptr + g * swg + n.to(tl.int64)[:, None] * swn                     # [BN, 1]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < k_hi
            w = tl.load(w_rows + kk.to(tl.int64)[None, :] * swk,
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            a = tl.load(x_rows + kk[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a.to(w.dtype), tl.trans(w), acc=acc, input_precision=DOT_PRECISION)
        y_rows = y_ptr + t.to(tl.int64)[:, None] * syt + g * syg + n[None, :]
        ymask = tmask[:, None] & nmask[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows, acc.to(y_ptr.dtype.element_ty), mask=ymask)
        else:
            # partials [SPLIT_K, G, BLOCK_T, N] fp32; the last program of (g, nb) to arrive sums
            # them in split order
            part = part_ptr + ((g * BLOCK_T + t.to(tl.int64)[:, None]) * N + n[None, :])
            tl.store(part + ks * G * BLOCK_T * N, acc, mask=ymask)
            cnt = cnt_ptr + g * n_blocks + nb
            if last_to_arrive(cnt, SPLIT_K):
                total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(part + s * G * BLOCK_T * N, mask=ymask, other=0.0,
                                     cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_rows, total.to(y_ptr.dtype.element_ty), mask=ymask)
                tl.store(cnt, 0)


    @triton.jit(do_not_specialize=["T"])
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, k_chunk,
                       sxt, sxg,                  # x [T, G, K] (unit stride along K)
                       swg, swn, swk,             # W [G, N, K] (one of swn, swk is 1)
                       syt, syg,                  # y [T, G, N] (unit stride along N)
                       HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False):
        """y[t, g, n] = sum_k x[t, g, k] W[g, n, k] (+ bias[n]) for t < T (<= BLOCK_T)."""
        _skinny_program(tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64),
                        tl.num_programs(0), tl.num_programs(2),
                        x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, k_chunk,
                        sxt, sxg, swg, swn, swk, syt, syg,
                        HAS_BIAS, BLOCK_T, BLOCK_N, BLOCK_K, SPLIT_K, DOT_PRECISION, PDL)


    @triton.jit
    def _dequantized_tile(w, s_ptr, ssn, n, nmask, kb0, K, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        """An fp8 [BLOCK_N, BLOCK_K] tile whose K range starts at block kb0 -> fp32 times its
        128 x 128 blocks' scales (a tile under 128 wide: one block)."""
        KB: tl.constexpr = BLOCK_K // 128 if BLOCK_K >= 128 else 1
        kb = kb0 + tl.arange(0, KB)
        s = tl.load(s_ptr + (n // 128)[:, None] * ssn + kb[None, :],
                    mask=nmask[:, None] & (kb * 128 < K)[None, :], other=0.0)      # [BN, KB]
        wf = tl.reshape(w.to(tl.float32), [BLOCK_N, KB, BLOCK_K // KB]) * s[:, :, None]
        return tl.reshape(wf, [BLOCK_N, BLOCK_K])

    @triton.jit(do_not_specialize=["T"])
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, h_ptr, part_ptr, cnt_ptr, s_ptr,
                     T, N, K, k_chunk, inv_k, eps,
                     sxt, sxg,                      # x [T, G, K] (unit stride along K)
                     swg, swn,                      # W [G, N, K] (unit stride along K)
                     syt, syg,                      # y [T, G, N] (unit stride along N)
                     srt,                           # ADD_NORM: residual [T, K], h [T, K]
                     ssn,                           # SCALED: scales [cdiv(N, 128), cdiv(K, 128)]
                     HAS_BIAS: tl.constexpr, ADD_NORM: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     EARLY: tl.constexpr, SCALED: tl.constexpr = False,
                     PDL: tl.constexpr = False):
        """y[t, g, n] = sum_k x[t, g, k] W[g, n, k] (+ bias[n]) for t < T <= ROWS: program
        (nb, g, ks) loads its whole [BLOCK_N, k_chunk] weight tile (k_chunk <= BLOCK_K, the
        K range ks * k_chunk ...) in one go (EARLY: before the PDL wait; weights are no
        kernel's output), then takes the products row by row in fp32 registers (no shared
        memory, no second pass over the weights). SPLIT_K > 1 (K past one tile): fp32
        partials [SPLIT_K, G, ROWS, N], summed in split order by the last program of (g, nb)
        to arrive (the skinny kernel's ordering).
        ADD_NORM (G = 1, SPLIT_K = 1): x is the decoder's input norm of h = residual + x, which
        every program forms from the whole row it holds anyway (fused_ops' add + RMS norm
        rule); program 0 stores h (contiguous rows) for the next layer.
        SCALED (G = 1): W is block fp8 (helix.layers.fp8): the tile is dequantized once in
        registers, each 128-wide K group times its block's scale (k_chunk on block edges)."""
        nb = tl.program_id(0)
        g = tl.program_id(1).to(tl.int64)
        ks = tl.program_id(2)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        k = ks * k_chunk + tl.arange(0, BLOCK_K)
        nmask = n < N
        kmask = (k < K) & (k < ks * k_chunk + k_chunk)
        tile = w_ptr + g * swg + n.to(tl.int64)[:, None] * swn + k[None, :]
        if EARLY:
            w = tl.load(tile, mask=nmask[:, None] & kmask[None, :], other=0.0)
            pdl_sync(PDL)
        else:
            pdl_sync(PDL)
            w = tl.load(tile, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if SCALED:
            w = _dequantized_tile(w, s_ptr, ssn, n, nmask, ks * k_chunk // 128, K, BLOCK_N,
                                  BLOCK_K)
        if HAS_BIAS:
            b = tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        for r in tl.static_range(ROWS):
            live = tl.full([BLOCK_K], r, tl.int32) < T
            if ADD_NORM:
                m = (kmask & live)[None, :]
                one = tl.zeros([1, 1], dtype=tl.int64)
                h = _added(one + x_ptr + r * sxt, one + r_ptr + r * srt, k, m,
                           h_ptr.dtype.element_ty)                                # [1, BK]
                v = h.to(tl.float32)
                x = _normed(h, _rstd(tl.sum(v * v, axis=1), inv_k, eps), nw_ptr, k, kmask,
                            h_ptr.dtype.element_ty, x_ptr.dtype.element_ty)
                if nb == 0:
                    tl.store(h_ptr + r * K + k[None, :], h, mask=m)
            else:
                x = tl.load(x_ptr + r * sxt + g * sxg + k, mask=kmask & live,
                            other=0.0)[None, :]
            y = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
            ymask = nmask & (tl.full([BLOCK_N], r, tl.int32) < T)
            if SPLIT_K == 1:
                if HAS_BIAS:
                    y += b
                tl.store(y_ptr + r * syt + g * syg + n, y.to(y_ptr.dtype.element_ty),
                         mask=ymask)
            else:
                tl.store(part_ptr + ((ks * tl.num_programs(1) + g) * ROWS + r) * N + n, y,
                         mask=ymask)
        if SPLIT_K > 1:
            cnt = cnt_ptr + g * tl.num_programs(0) + nb
            if last_to_arrive(cnt, SPLIT_K):
                for r in tl.static_range(ROWS):
                    ymask = nmask & (tl.full([BLOCK_N], r, tl.int32) < T)
                    total = tl.zeros([BLOCK_N], dtype=tl.float32)
                    for s in tl.static_range(SPLIT_K):
                        total += tl.load(part_ptr + ((s * tl.num_programs(1) + g) * ROWS + r)
                                         * N + n, mask=ymask, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        total += b
                    tl.store(y_ptr + r * syt + g * syg + n,
                             total.to(y_ptr.dtype.element_ty), mask=ymask)
                tl.store(cnt, 0)


def gemv_config(T: int, N: int, K: int, groups: int, sm_count: int,
                config: dict | None = None) -> dict:
    """The one-tile GEMV's tiles from shapes only: a weight tile of the whole K (rounded up to
    a power of two; past GEMV_MAX_K, K in SPLIT_K = cdiv(K, GEMV_MAX_K) equal ranges, each a
    tile) and TILE = 8192 / rows elements (measured on the H200 in a chain of
    DeepSeek-V2-Lite's projections: the best of 4K-32K tiles and 4 or 8 warps at 1 and at 2
    rows, profiling/results/gemv.md), its feature rows halved (down to 1) until the launch has
    a program per SM. DeepSeek-V2-Lite at one row, 132 SMs: the x projection 3648 x 2048 ->
    912 programs of 4 rows, o_proj 2048 x 2048 -> 512 of 4, W_UV 16 heads of 128 x 512 ->
    256 of 8, kv_a 576 x 2048 alone -> 144 of 4."""
    cfg = dict(TILE=8192 // pow2(T), BLOCK_N=None, num_warps=4)
    unknown = set(config or {}) - set(GEMV_TUNABLES)
    if unknown:
        raise ValueError(f"unknown GEMV tunables {sorted(unknown)}; known: {GEMV_TUNABLES}")
    cfg.update(config or {})
    split = -(-K // GEMV_MAX_K)
    block_k = pow2(-(-K // split))
    if cfg["BLOCK_N"] is None:
        bn = max(1, cfg["TILE"] // block_k)
        while bn > 1 and -(-N // bn) * groups * split < sm_count:
            bn //= 2
        cfg["BLOCK_N"] = bn
    cfg["BLOCK_K"] = block_k
    cfg["SPLIT_K"] = split
    del cfg["TILE"]
    return cfg


def gemv_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether _launch takes the one-tile GEMV for views x [T, G, K], w [G, N, K]: GEMV on,
    T <= GEMV_MAX_ROWS, K <= GEMV_MAX_K (or split in K: GEMV_SPLIT, a weight of at most
    GEMV_SPLIT_MAX_ELEMENTS), the weight's unit stride along K. The split's bound, measured
    on the H200 in whole steps: DeepSeek-V2-Lite's dense down (2048 x 10944, 22.4M) gained
    (the skinny kernel took 38.7 us, the GEMV is part of a 31-52 us faster step), Llama-3.1-8B's
    down (4096 x 14336, 58.7M, which the skinny kernel streams at ~0.87 of the copy rate) lost
    ~6 us a layer (profiling/results/step_small.md)."""
    K = x.shape[2]
    return (GEMV and x.shape[0] <= GEMV_MAX_ROWS and w.stride(2) == 1
            and (K <= GEMV_MAX_K or (GEMV_SPLIT and w.numel() <= GEMV_SPLIT_MAX_ELEMENTS)))


def gemv_launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                y: torch.Tensor, config: dict | None = None, add_norm=None,
                scale: torch.Tensor | None = None):
    """-> (grid, args, meta) of _gemv_kernel for skinny_launch's contract where gemv_fits;
    None when y is empty. add_norm = (residual [T, K], norm weight [K], eps, h [T, K]): x is
    the input of the add + norm (G = 1), h its residual output. scale: w [1, N, K] is block
    fp8 with these [cdiv(N, 128), cdiv(K, 128)] scales (gemv_scaled_fits)."""
    from helix.attention.triton_splits import sm_count_of
    T, G, K = x.shape
    N = w.shape[1]
    assert w.shape == (G, N, K) and y.shape == (T, G, N) and T <= GEMV_MAX_ROWS, (
        x.shape, w.shape, y.shape)
    assert x.stride(2) == 1 and y.stride(2) == 1 and w.stride(2) == 1
    if y.numel() == 0:
        return None
    cfg = gemv_config(T, N, K, G, sm_count_of(x.device), config)
    split, rows, blocks = cfg["SPLIT_K"], pow2(T), -(-N // cfg["BLOCK_N"])
    res, nw, eps, h = add_norm if add_norm is not None else (x, x, 0.0, x)
    assert add_norm is None or (G == 1 and split == 1 and res.stride(-1) == 1
                                and h.is_contiguous())
    if split > 1:
        part = torch.empty((split, G, rows, N), dtype=torch.float32, device=x.device)
        cnt = arrival_counters(x.device, G * blocks)
    else:
        part = cnt = y
    chunk = split_chunk(K, split, scaled=scale is not None)
    assert scale is None or (G == 1 and scale.stride(1) == 1)
    args = (x, w, bias if bias is not None else w, y, res, nw, h, part, cnt,
            scale if scale is not None else w, T, N, K,
            chunk, 1.0 / K, float(eps), x.stride(0), x.stride(1), w.stride(0),
            w.stride(1), y.stride(0), y.stride(1), res.stride(0),
            scale.stride(0) if scale is not None else 0)
    meta = dict(HAS_BIAS=bias is not None, ADD_NORM=add_norm is not None, ROWS=rows,
                EARLY=GEMV_EARLY, **cfg)
    if scale is not None:
        meta["SCALED"] = True
    return (blocks, G, split), args, meta


def split_chunk(K: int, split: int, scaled: bool = False) -> int:
    """K elements a split's range holds: cdiv(K, split), for block-fp8 weights rounded up to
    whole 128-blocks (every range starts on a block edge; the last one is shorter). Never past
    the tile: gemv_config's tile is a power of two >= cdiv(K, split) > 128 where K is split."""
    chunk = -(-K // split)
    return -(-chunk // 128) * 128 if scaled and split > 1 else chunk


def gemv_scaled_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the one-tile GEMV takes x [T, K] times a block-fp8 w [N, K] (helix.layers.fp8):
    gemv_fits (the split's bound in bytes: one byte an element), and where K is split, every
    range of split_chunk non-empty (DeepSeek-V2-Lite's dense down, K 10944: three of 3712, 3712,
    3520; it took the tiled kernel at 0.55 TB/s before, profiling/results/fp8_weights.md)."""
    K = x.shape[1]
    if not (HAS_TRITON and x.dim() == 2 and x.stride(-1) == 1 and w.stride(1) == 1 and GEMV
            and x.shape[0] <= GEMV_MAX_ROWS
            and (K <= GEMV_MAX_K or (GEMV_SPLIT and w.numel() <= 2 * GEMV_SPLIT_MAX_ELEMENTS))):
        return False
    split = -(-K // GEMV_MAX_K)
    return (split - 1) * split_chunk(K, split, scaled=True) < K


def gemv_scaled(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a block-fp8 weight in one _gemv_kernel launch (where gemv_scaled_fits)."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _run(gemv_launch(x[:, None], w[None], bias, y[:, None], scale=scale), _gemv_kernel)
    return y


def skinny_config(T: int, N: int, K: int, groups: int, sm_count: int,
                  config: dict | None = None) -> dict:
    """Tiles from shapes only (graph-safe): 32-wide feature blocks, 128-deep K tiles, and K
    split in powers of two (each split >= one K tile, at most 16) until the launch has about
    two programs per SM: DeepSeek-V2-Lite at batch 1, q_proj 3072 x 2048 -> 96 blocks x 4
    splits, kv_a 576 x 2048 -> 18 x 16, o_proj 2048 x 2048 -> 64 x 8, W_UK 16 heads of
    512 x 128 -> 256 x 1."""
    cfg = dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=None, num_warps=4, num_stages=3)
    unknown = set(config or {}) - set(TUNABLES)
    if unknown:
        raise ValueError(f"unknown skinny GEMM tunables {sorted(unknown)}; known: {TUNABLES}")
    cfg.update(config or {})
    if cfg["SPLIT_K"] is None:
        blocks = -(-N // cfg["BLOCK_N"]) * groups
        split = 1
        while blocks * split < 2 * sm_count and K // (2 * split) >= cfg["BLOCK_K"] and split < 16:
            split *= 2
        cfg["SPLIT_K"] = split
    return cfg


def skinny_launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  y: torch.Tensor, config: dict | None = None):
    """-> (grid, args, meta) of _skinny_kernel for y[t, g, n] = sum_k x[t, g, k] w[g, n, k]
    (+ bias[n]) on views x [T, G, K] (unit stride along K), w [G, N, K] (unit stride along N
    or K), y [T, G, N] (unit stride along N); None when y is empty."""
    from helix.attention.triton_splits import sm_count_of
    T, G, K = x.shape
    N = w.shape[1]
    assert w.shape == (G, N, K) and y.shape == (T, G, N) and T <= ABSORB_MAX_ROWS, (
        x.shape, w.shape, y.shape)
    assert x.stride(2) == 1 and y.stride(2) == 1 and 1 in (w.stride(1), w.stride(2))
    if y.numel() == 0:
        return None
    cfg = skinny_config(T, N, K, G, sm_count_of(x.device), config)
    split = cfg.pop("SPLIT_K")
    block_t = max(16, pow2(T))
    k_chunk = -(-K // split)
    blocks = -(-N // cfg["BLOCK_N"])
    if split > 1:
        part = torch.empty((split, G, block_t, N), dtype=torch.float32, device=x.device)
        cnt = arrival_counters(x.device, G * blocks)
    else:
        part = cnt = y
    precision = "ieee" if w.dtype == torch.float32 else "tf32"
    args = (x, w, bias if bias is not None else w, y, part, cnt, T, N, K, k_chunk,
            x.stride(0), x.stride(1), *w.stride(), y.stride(0), y.stride(1))
    meta = dict(HAS_BIAS=bias is not None, BLOCK_T=block_t, SPLIT_K=split,
                DOT_PRECISION=precision, **cfg)
    return (blocks, split, G), args, meta


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            config: dict | None = None) -> None:
    """The one-tile GEMV where it fits and no skinny tiles are given, else the skinny kernel."""
    if config is None and gemv_fits(x, w):
        _run(gemv_launch(x, w, bias, y), _gemv_kernel)
    else:
        _run(skinny_launch(x, w, bias, y, config))


def _run(launch, kernel=None) -> None:
    """Launch `kernel` (_skinny_kernel) from its launch's (grid, args, meta); None: nothing to
    do."""
    if launch is not None:
        grid, args, meta = launch
        run_kernel(kernel or _skinny_kernel, grid, *args, **meta)


def linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x[:, None], w[None], bias, y[:, None], config)
    return y


def norm_in_gemv(T: int, N: int, K: int, sm_count: int) -> bool:
    """The shape part of add_norm_linear's rule: whether the input add + norm of T rows rides in
    the launch of their GEMM with a weight [N, K] (the GEMV's, one K range, >= NORM_MIN_ROWS
    weight rows a program). helix.perf.cost counts the decode step's kernels with it."""
    return (ENABLED and GEMV and NORM_IN_GEMV and 0 < T <= min(GEMV_MAX_ROWS, MAX_ROWS)
            and K <= GEMV_MAX_K and N * K <= MAX_WEIGHT_ELEMENTS
            and gemv_config(T, N, K, 1, sm_count)["BLOCK_N"] >= NORM_MIN_ROWS)


def add_norm_linear_triton(a: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                           eps: float, w: torch.Tensor, bias: torch.Tensor | None = None,
                           config: dict | None = None, scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_norm_linear in one _gemv_kernel launch (its ADD_NORM prologue)."""
    h = torch.empty(a.shape, dtype=residual.dtype, device=a.device)
    y = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    _run(gemv_launch(a[:, None], w[None], bias, y[:, None], config, (residual, norm_w, eps, h),
                     scale), _gemv_kernel)
    return y, h


def absorb_q_launch(q: torch.Tensor, w_uk: torch.Tensor, config: dict | None = None):
    """-> (y [T, h, N], skinny_launch of W_UK's absorption into it)."""
    T, H, _ = q.shape
    y = torch.empty((T, H, w_uk.shape[2]), dtype=q.dtype, device=q.device)
    return y, skinny_launch(q, w_uk.transpose(1, 2), None, y, config)


def absorb_q_triton(q: torch.Tensor, w_uk: torch.Tensor,
                    config: dict | None = None) -> torch.Tensor:
    y, launch = absorb_q_launch(q, w_uk, config)
    _run(launch)
    return y


def absorb_v_triton(o: torch.Tensor, w_uv: torch.Tensor,
                    config: dict | None = None) -> torch.Tensor:
    T, H, _ = o.shape
    y = torch.empty((T, H * w_uv.shape[1]), dtype=o.dtype, device=o.device)
    _launch(o, w_uv, None, y.view(T, H, -1), config)
    return y


def absorb_v_torch(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thc,hvc->thv", o, w_uv).reshape(o.shape[0], -1)


def _fits(x: torch.Tensor, w: torch.Tensor, rows: int, max_rows: int = MAX_ROWS,
          any_float: bool = False) -> bool:
    return (ENABLED and use_triton(x) and 0 < rows <= max_rows and w.dtype == x.dtype
            and (any_float or x.dtype in (torch.bfloat16, torch.float16))
            and x.stride(-1) == 1 and w.numel() <= MAX_WEIGHT_ELEMENTS)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [T, K], w [N, K]; the skinny kernel for decode-sized T."""
    if (x.dim() == 2 and _fits(x, w, x.shape[0]) and w.stride(1) == 1
            and (bias is None or bias.dtype == x.dtype)
            and (x.shape[0] <= GEMV_MAX_ROWS or w.numel() <= SKINNY_MAX_WEIGHT_ELEMENTS)):
        return linear_triton(x, w, bias)
    return F.linear(x, w, bias)


def add_norm_linear(a: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                    w: torch.Tensor, bias: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(residual + a) * norm_w, w, bias), residual + a): the decoder's residual
    add and RMS norm before a projection, in the GEMV's launch (NORM_IN_GEMV) where linear
    takes the GEMV, every operand has one 16-bit dtype and a program's weight tile has at
    least NORM_MIN_ROWS rows; elsewhere fused_ops.add_rms_norm, then linear. Every program
    re-reads the whole rows it normalises: on the H200 that paid with DeepSeek-V2-Lite's x
    projection (4 rows of 2048 a program: 1 x 32K 2.552 -> 2.531 ms) and lost with Llama-3.1-8B's
    qkv (2 rows of 4096: 5.484 -> 5.641 ms; profiling/results/gemv.md). scale: w is block
    fp8 with these scales (helix.layers.fp8; the GEMV dequantizes its tile, gemv_scaled_fits),
    its product elsewhere fp8.linear."""
    from helix.attention.triton_splits import sm_count_of
    fits = (_fits(a, w, a.shape[0]) if scale is None else
            (ENABLED and use_triton(a) and a.dtype in (torch.bfloat16, torch.float16)
             and gemv_scaled_fits(a, w)))
    if (a.dim() == 2 and fits and w.stride(1) == 1
            and residual.shape == a.shape
            and residual.stride(1) == 1 and residual.dtype == norm_w.dtype == a.dtype
            and norm_w.stride(0) == 1 and (bias is None or bias.dtype == a.dtype)
            and norm_in_gemv(a.shape[0], w.shape[0], w.shape[1], sm_count_of(a.device))):
        return add_norm_linear_triton(a, residual, norm_w, eps, w, bias, scale=scale)
    x, h = add_rms_norm(a, residual, norm_w, eps)
    if scale is not None:
        from helix.layers import fp8          # (fp8 takes this module's GEMV)
        return fp8.linear(x, w, scale, bias), h
    return linear(x, w, bias), h


def absorb_q(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q [T, h, K] (the queries' nope dims), w_uk [h, K, N] -> q absorbed into latent space
    [T, h, N]."""
    if absorb_q_fits(q, w_uk):
        return absorb_q_triton(q, w_uk)
    return torch.einsum("thk,hkn->thn", q, w_uk)


def absorb_q_fits(q: torch.Tensor, w_uk: torch.Tensor) -> bool:
    """Whether absorb_q takes the kernel."""
    return _fits(q, w_uk, q.shape[0]) and (w_uk.stride(2) == 1 or w_uk.stride(1) == 1)


def absorb_v(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o [T, h, Dl] latent outputs, w_uv [h, v, Dl] -> [T, h * v] (contiguous: o_proj's
    input)."""
    if _fits(o, w_uv, o.shape[0], ABSORB_MAX_ROWS, any_float=True) and w_uv.stride(2) == 1:
        return absorb_v_triton(o, w_uv)
    return absorb_v_torch(o, w_uv)
