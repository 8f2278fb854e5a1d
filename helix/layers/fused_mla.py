"""Fused pieces of the absorbed MLA layer's decode step, each one Triton launch on CUDA with the
layer's previous torch formula as the fallback (off CUDA, HELIX_FUSED_OPS=0, or past the row
counts the kernels serve).

    mla_kv_row(ckv [T, Dl + Dr], norm_w [Dl], eps, cos, sin, pos, interleave, q_rope [T, h, Dr],
               cache [P, page, Dl + Dr], slots [T])
        -> (cat(rms_norm(ckv[:, :Dl]) * norm_w, rope(ckv[:, Dl:])) [T, Dl + Dr],
            rope(q_rope) [T, h, Dr] or None without q_rope)            (4 launches -> 1)
        and, given the cache, the KV append of that row at slots (the append's launch too)
    mla_absorb_kv_row(q_nope [T, h, nope], w_uk [h, nope, Dl], ckv, ..., q_rope, cache, slots)
        -> (absorb_q(q_nope, w_uk) [T, h, Dl], *mla_kv_row(...)): W_UK's absorption of the
        queries (skinny_gemm's GEMM) and the kv row in one grid: both read only the x
        projection, so neither waits for the other                     (2 launches -> 1)
(W_UV's absorption of the latent outputs is helix.layers.skinny_gemm.absorb_v.)

Rounding follows the torch formulas (the helix.layers.fused_ops rules): the norm sums squares in
fp32, rounds x * rstd to the input dtype and the product with the weight once; RoPE computes
each product and sum in fp32 without FMA contraction.
"""

from __future__ import annotations

import torch

from helix.attention.torch_ref import append_rows
from helix.layers.fused_ops import rms_norm_torch, rope_torch, use_triton
from helix.layers.skinny_gemm import absorb_q, absorb_q_fits, absorb_q_launch
from helix.triton_util import HAS_TRITON, cache_cast, pdl_sync, pow2, run_kernel, tl, triton

FUSE_ABSORB = True        # mla_absorb_kv_row: one launch where it can (benches switch it)


def mla_kv_row_torch(ckv, norm_w, eps, cos, sin, pos, interleave, q_rope=None, cache=None,
                     slots=None):
    Dl = norm_w.shape[0]
    latent, k_rope = ckv[:, :Dl], ckv[:, Dl:]
    k_rope = rope_torch(k_rope.unsqueeze(1), cos, sin, pos, interleave).squeeze(1)
    q = None if q_rope is None else rope_torch(q_rope, cos, sin, pos, interleave)
    row = torch.cat((rms_norm_torch(latent, norm_w, eps), k_rope), dim=-1)
    if cache is not None:
        append_rows(cache, row, slots)
    return row, q


if HAS_TRITON:
    from helix.layers.fused_ops import _rope_pairs
    from helix.layers.skinny_gemm import _skinny_program

    @triton.jit
    def _kv_row_program(t, ckv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, q_ptr, qo_ptr,
                        slots_ptr, cache_ptr,
                        D_LAT, HALF, HQ, inv_d, eps, stride_ct, stride_ot, sct, sst, sqt, sqh,
                        INTERLEAVE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_H: tl.constexpr, APPEND: tl.constexpr, PDL: tl.constexpr):
        """Row t (int64) of _kv_row_kernel; also the kv-row part of
        _absorb_kv_row_kernel."""
        pdl_sync(PDL)
        row = ckv_ptr + t * stride_ct
        dst = out_ptr + t * stride_ot
        dt = out_ptr.dtype.element_ty
        slot = tl.zeros([], tl.int64) - 1
        if APPEND:
            slot = tl.load(slots_ptr + t).to(tl.int64)        # int64: slot * width can pass 2^31
        kv = cache_ptr + slot * (D_LAT + 2 * HALF)
        c = tl.arange(0, BLOCK_L)
        cmask = c < D_LAT
        v = tl.load(row + c, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(v * v, axis=0) * inv_d + eps))
        xn = (v * rstd).to(ckv_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        lat = (xn * w).to(dt)
        tl.store(dst + c, lat, mask=cmask)
        f = tl.arange(0, BLOCK_F)
        fmask = f < HALF
        p = tl.load(pos_ptr + t).to(tl.int64)
        cs = tl.load(cos_ptr + p * sct + f, mask=fmask, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + p * sst + f, mask=fmask, other=0.0).to(tl.float32)
        fa, fb = _rope_pairs(f, HALF, INTERLEAVE)
        a = tl.load(row + D_LAT + fa, mask=fmask, other=0.0).to(tl.float32)
        b = tl.load(row + D_LAT + fb, mask=fmask, other=0.0).to(tl.float32)
        ra = (a * cs - b * sn).to(dt)
        rb = (b * cs + a * sn).to(dt)
        tl.store(dst + D_LAT + f, ra, mask=fmask)
        tl.store(dst + D_LAT + HALF + f, rb, mask=fmask)
        if APPEND:
            ct = cache_ptr.dtype.element_ty
            lk = cmask & (c * 0 + slot >= 0)                      # slot -1: skip the row
            fk = fmask & (f * 0 + slot >= 0)
            tl.store(kv + c, cache_cast(lat, ct), mask=lk)
            tl.store(kv + D_LAT + f, cache_cast(ra, ct), mask=fk)
            tl.store(kv + D_LAT + HALF + f, cache_cast(rb, ct), mask=fk)
        if BLOCK_H > 0:
            hh = tl.arange(0, BLOCK_H).to(tl.int64)
            m = (hh < HQ)[:, None] & fmask[None, :]
            q_row = q_ptr + t * sqt + hh[:, None] * sqh                            # [BH, 1]
            qa = tl.load(q_row + fa[None, :], mask=m, other=0.0).to(tl.float32)
            qb = tl.load(q_row + fb[None, :], mask=m, other=0.0).to(tl.float32)
            q_dst = qo_ptr + (t * HQ + hh[:, None]) * (2 * HALF) + f[None, :]
            qt = qo_ptr.dtype.element_ty
            tl.store(q_dst, (qa * cs[None, :] - qb * sn[None, :]).to(qt), mask=m)
            tl.store(q_dst + HALF, (qb * cs[None, :] + qa * sn[None, :]).to(qt), mask=m)


    @triton.jit
    def _kv_row_kernel(ckv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, q_ptr, qo_ptr,
                       slots_ptr, cache_ptr,
                       D_LAT, HALF, HQ, inv_d, eps, stride_ct, stride_ot, sct, sst, sqt, sqh,
                       INTERLEAVE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr,
                       BLOCK_H: tl.constexpr, APPEND: tl.constexpr, PDL: tl.constexpr = False):
        """One row: out[:Dl] = rms_norm(ckv[:Dl]) * w, out[Dl:] = rope(ckv[Dl:]); with
        BLOCK_H > 0 also qo[t, :HQ] = rope(q[t, :HQ]) (the query heads' rope dims, unit
        stride along them), the formula of fused_ops' rope kernel; with APPEND the same row
        also into the contiguous pool at cache[slots[t]] (skipped where the slot is -1)."""
        _kv_row_program(tl.program_id(0).to(tl.int64), ckv_ptr, w_ptr, cos_ptr, sin_ptr,
                        pos_ptr, out_ptr, q_ptr, qo_ptr, slots_ptr, cache_ptr, D_LAT, HALF, HQ,
                        inv_d, eps, stride_ct, stride_ot, sct, sst, sqt, sqh,
                        INTERLEAVE, BLOCK_L, BLOCK_F, BLOCK_H, APPEND, PDL)

    @triton.jit(do_not_specialize=["T"])
    def _absorb_kv_row_kernel(
            x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
            T, N, K, k_chunk, sxt, sxg, swg, swn, swk, syt, syg,
            ckv_ptr, lw_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, q_ptr, qo_ptr,
            slots_ptr, cache_ptr,
            D_LAT, HALF, HQ, inv_dl, eps_l, stride_ct, stride_ot, sct, sst, sqt, sqh,
            HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
            INTERLEAVE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr,
            BLOCK_H: tl.constexpr, APPEND: tl.constexpr, PDL: tl.constexpr = False):
        """W_UK's absorption and the kv rows, independent work on the same input (the x
        projection), in one grid (n_blocks + T, SPLIT_K, G): programs nb < n_blocks are the
        skinny GEMM's (skinny_gemm._skinny_program); program (n_blocks + t, 0, 0) is row t's
        of _kv_row_kernel; the others exit."""
        nb = tl.program_id(0)
        ks = tl.program_id(1)
        g = tl.program_id(2)
        n_blocks = tl.num_programs(0) - T
        if nb < n_blocks:
            _skinny_program(nb, ks, g.to(tl.int64), n_blocks, tl.num_programs(2),
                            x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, k_chunk,
                            sxt, sxg, swg, swn, swk, syt, syg, HAS_BIAS, BLOCK_T, BLOCK_N,
                            BLOCK_K, SPLIT_K, DOT_PRECISION, PDL)
        elif (ks == 0) & (g == 0):
            _kv_row_program((nb - n_blocks).to(tl.int64), ckv_ptr, lw_ptr, cos_ptr, sin_ptr,
                            pos_ptr, out_ptr, q_ptr, qo_ptr, slots_ptr, cache_ptr, D_LAT, HALF,
                            HQ, inv_dl, eps_l, stride_ct, stride_ot, sct, sst, sqt, sqh,
                            INTERLEAVE, BLOCK_L, BLOCK_F, BLOCK_H, APPEND, PDL)


def kv_row_launch(ckv, norm_w, eps, cos, sin, pos, interleave, q_rope=None, cache=None,
                  slots=None):
    """-> (out, q_out, args, meta) of _kv_row_kernel (grid (T,)): out [T, Dl + Dr], q_out
    [T, h, Dr] or None."""
    T, width = ckv.shape
    Dl = norm_w.shape[0]
    half = (width - Dl) // 2
    assert ckv.stride(1) == 1 and 2 * half == width - Dl and cos.shape[-1] == half
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and pos.shape == (T,)
    out = torch.empty((T, width), dtype=ckv.dtype, device=ckv.device)
    q_out, hq = None, 0
    if q_rope is not None:
        hq = q_rope.shape[1]
        assert q_rope.shape == (T, hq, 2 * half) and q_rope.stride(2) == 1, q_rope.shape
        q_out = torch.empty((T, hq, 2 * half), dtype=q_rope.dtype, device=q_rope.device)
    q_in = q_rope if q_rope is not None else ckv
    if cache is not None:
        assert cache.is_contiguous() and cache.shape[2:] == (width,), "KV pool [P, page, Dl + Dr]"
        assert slots.shape == (T,), (slots.shape, T)
    block_l = pow2(Dl)
    block_h = pow2(hq) if hq else 0
    args = (ckv, norm_w, cos, sin, pos, out, q_in, q_out if q_out is not None else out,
            slots if cache is not None else pos, cache if cache is not None else out,
            Dl, half, hq, 1.0 / Dl, float(eps), ckv.stride(0), out.stride(0), cos.stride(0),
            sin.stride(0), q_in.stride(0), q_in.stride(1) if hq else 0)
    meta = dict(INTERLEAVE=bool(interleave), BLOCK_L=block_l, BLOCK_F=pow2(half),
                BLOCK_H=block_h, APPEND=cache is not None,
                num_warps=max(1, min(8, max(block_l, block_h * pow2(half)) // 256)),
                enable_fp_fusion=False)
    return out, q_out, args, meta


def mla_kv_row_triton(ckv, norm_w, eps, cos, sin, pos, interleave, q_rope=None, cache=None,
                      slots=None):
    out, q_out, args, meta = kv_row_launch(ckv, norm_w, eps, cos, sin, pos, interleave, q_rope,
                                           cache, slots)
    if ckv.shape[0]:
        run_kernel(_kv_row_kernel, (ckv.shape[0],), *args, **meta)
    return out, q_out


def mla_absorb_kv_row_triton(q_nope, w_uk, ckv, norm_w, eps, cos, sin, pos, interleave,
                             q_rope, cache=None, slots=None):
    """mla_absorb_kv_row in one launch (_absorb_kv_row_kernel), T >= 1 rows."""
    q_latent, launch = absorb_q_launch(q_nope, w_uk)
    out, q_out, row_args, row_meta = kv_row_launch(ckv, norm_w, eps, cos, sin, pos,
                                                   interleave, q_rope, cache, slots)
    (blocks, split, G), gemm_args, gemm_meta = launch
    run_kernel(_absorb_kv_row_kernel, (blocks + ckv.shape[0], split, G), *gemm_args, *row_args,
               **{**row_meta, **gemm_meta})
    return q_latent, out, q_out


def mla_kv_row(ckv: torch.Tensor, norm_w: torch.Tensor, eps: float, cos: torch.Tensor,
               sin: torch.Tensor, pos: torch.Tensor, interleave: bool,
               q_rope: torch.Tensor | None = None, cache: torch.Tensor | None = None,
               slots: torch.Tensor | None = None):
    """ckv [T, Dl + Dr] (the kv_a projection), norm_w [Dl] -> (the latent cache row
    [T, Dl + Dr]: RMS-normed latent, then the rope key rotated by pos [T] (cos / sin [P, Dr/2]
    fp32); the query heads' rope dims q_rope [T, h, Dr] rotated alike, contiguous, or None).
    Given the KV pool cache [P, page, Dl + Dr] (contiguous) and slots [T], the row is also
    appended to it (the AttentionBackend.append_kv contract: flat slots, -1 skipped)."""
    args = (ckv, norm_w, eps, cos, sin, pos, interleave, q_rope, cache, slots)
    if _kv_row_fits(ckv, norm_w, q_rope, cache):
        return mla_kv_row_triton(*args)
    return mla_kv_row_torch(*args)


def _kv_row_fits(ckv, norm_w, q_rope, cache) -> bool:
    return (use_triton(ckv) and ckv.stride(1) == 1 and norm_w.dtype == ckv.dtype
            and (q_rope is None or q_rope.stride(2) == 1)
            and (cache is None or cache.is_contiguous()))


def mla_absorb_kv_row(q_nope: torch.Tensor, w_uk: torch.Tensor, ckv: torch.Tensor,
                      norm_w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      pos: torch.Tensor, interleave: bool, q_rope: torch.Tensor,
                      cache: torch.Tensor | None = None, slots: torch.Tensor | None = None):
    """-> (skinny_gemm.absorb_q(q_nope, w_uk), *mla_kv_row(ckv, ..., q_rope, cache, slots)):
    the two read only the x projection, so where both kernels take the shapes and the rows
    are the same (absorbed steps: every row), they are one launch (FUSE_ABSORB)."""
    if (FUSE_ABSORB and 0 < q_nope.shape[0] == ckv.shape[0] and absorb_q_fits(q_nope, w_uk)
            and _kv_row_fits(ckv, norm_w, q_rope, cache)):
        return mla_absorb_kv_row_triton(q_nope, w_uk, ckv, norm_w, eps, cos, sin, pos,
                                        interleave, q_rope, cache, slots)
    return (absorb_q(q_nope, w_uk),
            *mla_kv_row(ckv, norm_w, eps, cos, sin, pos, interleave, q_rope, cache, slots))
