"""Small fused Triton kernels of the decode step, CUDA-graph safe (no host synchronisation; every
launch grid depends on shapes only), each with an exact torch fallback.

    rms_norm(x [..., D], weight [D], eps)            -> [..., D]
    add_rms_norm(x, residual, weight, eps)           -> (rms_norm(residual + x), residual + x)
    rope(x [T, h, dim], cos [P, dim/2], sin [P, dim/2], pos [T], interleave) -> [T, h, dim]
    silu_mul(gate_up [T, 2*I])                       -> silu(gate_up[:, :I]) * gate_up[:, I:]
    select_tokens(src [T], ids [T], tokens [R])      -> tokens[src] where src >= 0, else ids

The public functions launch the Triton kernel when the tensor is on CUDA and Triton is
importable (HELIX_FUSED_OPS=0 in the environment turns the kernels off), and otherwise run the
`*_torch` fallback: the formulas the layers used before, unchanged. The `*_triton` functions
always launch the kernel (on CPU tensors that needs TRITON_INTERPRET=1, which the tests use).

Rounding follows the torch formulas step by step, so that bf16 / fp16 results agree with the
torch path bitwise or within one ulp:
  - rms_norm: sum of squares in fp32, times fp32(1/D) (torch's CUDA mean), + eps,
    1 / sqrt (both correctly rounded), x * rstd in fp32, rounded to the norm's input dtype,
    then times the weight (product in fp32, rounded once to promote(x, weight), which is what
    torch's bf16 / fp16 multiply gives). Only the order of the D-term sum differs from torch.
  - add_rms_norm: residual + x in fp32 rounded to promote(residual, x) (torch's `h + y`),
    stored as the new residual, and the norm reads that rounded sum.
  - rope: fp32, a*cos - b*sin and b*cos + a*sin with each product and sum rounded separately
    (launched with enable_fp_fusion=False, so no FMA contraction): fp32 results are bitwise
    the torch formula's, bf16 / fp16 after one rounding likewise.
  - silu_mul: silu in fp32 as g / (1 + exp(-g)) (F.silu's CUDA formula; the division
    correctly rounded, exp to a few ulp like expf: _exp_f32), rounded to x.dtype like F.silu's
    output, then times up in fp32 rounded once (torch's bf16 multiply).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from helix.triton_util import HAS_TRITON, pdl_sync, pow2, run_kernel, tl, triton

__all__ = ["rms_norm", "add_rms_norm", "rope", "silu_mul", "select_tokens",
           "rms_norm_torch", "add_rms_norm_torch", "rope_torch", "silu_mul_torch",
           "select_tokens_torch", "rms_norm_triton", "add_rms_norm_triton", "rope_triton",
           "silu_mul_triton", "select_tokens_triton",
           "use_triton", "HAS_TRITON"]

ENABLED = os.environ.get("HELIX_FUSED_OPS", "1") not in ("0", "")
MAX_BLOCK_D = 8192          # a norm row wider than this is done in chunks (two passes)
NORM_TILE = 4096            # elements of one norm program's [BLOCK_R, BLOCK_D] tile (rows < D)


def use_triton(x: torch.Tensor) -> bool:
    """Whether the public functions launch the Triton kernel for a tensor on x's device."""
    return HAS_TRITON and ENABLED and x.is_cuda


# -- torch fallbacks: the layers' original formulas ----------------------------------------------

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = residual + x
    return rms_norm_torch(h, weight, eps), h


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    c = cos[pos].unsqueeze(1)            # [T, 1, dim/2]
    s = sin[pos].unsqueeze(1)
    xf = x.float()
    if interleave:                       # pairs (2i, 2i+1); output in [evens | odds] order
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:                                # halves (rotate_half)
        a, b = xf.chunk(2, dim=-1)
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


# -- kernels -------------------------------------------------------------------------------------

if HAS_TRITON:
    # The add + RMS norm rule for kernels that form a norm's output themselves (the router's
    # and the GEMV's prologues), in _rms_norm_kernel's roundings: h = residual + x rounded to
    # h's dtype, y = (h * rstd rounded to h's dtype) * weight, rounded to y's dtype.
    @triton.jit
    def _added(x_rows, r_rows, dd, m, h_dt: tl.constexpr):
        """h [BT, BD] = residual + x rounded to h_dt: row pointers [BT, 1], features dd."""
        return (tl.load(x_rows + dd[None, :], mask=m, other=0.0).to(tl.float32)
                + tl.load(r_rows + dd[None, :], mask=m, other=0.0).to(tl.float32)).to(h_dt)

    @triton.jit
    def _rstd(ss, inv_d, eps):
        """1 / sqrt(mean of squares + eps) from the rows' sums of squares ss."""
        return tl.div_rn(1.0, tl.sqrt_rn(ss * inv_d + eps))

    @triton.jit
    def _normed(h, rstd, nw_ptr, dd, dmask, h_dt: tl.constexpr, y_dt: tl.constexpr):
        """y [BT, BD] = (h * rstd rounded to h_dt) * norm weight, rounded to y_dt."""
        xn = (h.to(tl.float32) * rstd[:, None]).to(h_dt).to(tl.float32)
        nw = tl.load(nw_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
        return (xn * nw[None, :]).to(y_dt)

    @triton.jit
    def _norm_input(x_row, r_row, h_row, cols, m, sxd, srd,
                    HAS_RES: tl.constexpr, STORE_RES: tl.constexpr):
        """fp32 tile of the norm's input: x, or residual + x rounded to the residual's dtype
        (stored to h when STORE_RES)."""
        v = tl.load(x_row + cols[None, :] * sxd, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            v = v + tl.load(r_row + cols[None, :] * srd, mask=m, other=0.0).to(tl.float32)
            v = v.to(h_row.dtype.element_ty)
            if STORE_RES:
                tl.store(h_row + cols[None, :], v, mask=m)
            v = v.to(tl.float32)
        return v

    @triton.jit(do_not_specialize=["R"])
    def _rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, y_ptr, h_ptr,
        R, N1, D, inv_d, eps,
        sx0, sx1, sxd,                  # x rows r = (r // N1, r % N1), feature stride
        sr0, sr1, srd,                  # residual, same row decomposition
        HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
        CHUNKS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """y [R, D] = rms_norm(in) * w; in = x, or (HAS_RES) h [R, D] = residual + x.
        Without a residual h_ptr is x_ptr: only its element type (the rounding of x * rstd)
        is used."""
        pdl_sync(PDL)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        rows = rows.to(tl.int64)
        i0 = rows // N1
        i1 = rows % N1
        x_row = x_ptr + (i0 * sx0 + i1 * sx1)[:, None]                     # [BR, 1]
        r_row = r_ptr + (i0 * sr0 + i1 * sr1)[:, None]
        h_row = h_ptr + (rows * D)[:, None]
        y_row = y_ptr + (rows * D)[:, None]
        cols = tl.arange(0, BLOCK_D)
        if CHUNKS == 1:                 # the whole row stays in registers
            cmask = cols < D
            m = rmask[:, None] & cmask[None, :]
            v = _norm_input(x_row, r_row, h_row, cols, m, sxd, srd, HAS_RES, True)
            ms = tl.sum(v * v, axis=1) * inv_d
            rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
            xn = (v * rstd[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            tl.store(y_row + cols[None, :], (xn * w[None, :]).to(y_ptr.dtype.element_ty), mask=m)
        else:                           # wide rows: sum of squares, then normalise (recomputed)
            ss = tl.zeros([BLOCK_R], dtype=tl.float32)
            for c in range(CHUNKS):
                cc = c * BLOCK_D + cols
                m = rmask[:, None] & (cc < D)[None, :]
                v = _norm_input(x_row, r_row, h_row, cc, m, sxd, srd, HAS_RES, True)
                ss += tl.sum(v * v, axis=1)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(ss * inv_d + eps))
            for c in range(CHUNKS):
                cc = c * BLOCK_D + cols
                cmask = cc < D
                m = rmask[:, None] & cmask[None, :]
                v = _norm_input(x_row, r_row, h_row, cc, m, sxd, srd, HAS_RES, False)
                xn = (v * rstd[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
                w = tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
                tl.store(y_row + cc[None, :], (xn * w[None, :]).to(y_ptr.dtype.element_ty),
                         mask=m)

    @triton.jit
    def _rope_pairs(f, HALF, INTERLEAVE: tl.constexpr):
        """The feature indices (a, b) of rotation pair f: (2f, 2f + 1) with INTERLEAVE (the
        adjacent-pairs convention), else (f, f + HALF) (rotate_half). Every RoPE kernel's
        rule; each writes its pair f's results to [f] and [HALF + f]."""
        if INTERLEAVE:
            return 2 * f, 2 * f + 1
        else:
            return f, f + HALF

    @triton.jit
    def _rope_kernel(
        x_ptr, cos_ptr, sin_ptr, pos_ptr, y_ptr,
        H, HALF,
        sxt, sxh, sxd,                  # x [T, H, 2*HALF]
        sct, scf, sst, ssf, sp,         # cos / sin [P, HALF], pos [T]
        INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """y [T, H, 2*HALF] contiguous: [a*cos - b*sin | b*cos + a*sin] for the pairs
        (a, b) = (x[2f], x[2f+1]) (INTERLEAVE) or (x[f], x[HALF+f]), in fp32."""
        pdl_sync(PDL)
        t = tl.program_id(0).to(tl.int64)
        hh = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        f = tl.arange(0, BLOCK_F)
        fmask = f < HALF
        m = (hh < H)[:, None] & fmask[None, :]
        p = tl.load(pos_ptr + t * sp).to(tl.int64)
        c = tl.load(cos_ptr + p * sct + f * scf, mask=fmask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + p * sst + f * ssf, mask=fmask, other=0.0).to(tl.float32)[None, :]
        row = x_ptr + t * sxt + hh[:, None] * sxh                          # [BH, 1]
        fa, fb = _rope_pairs(f, HALF, INTERLEAVE)
        a = tl.load(row + fa[None, :] * sxd, mask=m, other=0.0).to(tl.float32)
        b = tl.load(row + fb[None, :] * sxd, mask=m, other=0.0).to(tl.float32)
        out = y_ptr + (t * H + hh[:, None]) * (2 * HALF) + f[None, :]
        dt = y_ptr.dtype.element_ty
        tl.store(out, (a * c - b * s).to(dt), mask=m)
        tl.store(out + HALF, (b * c + a * s).to(dt), mask=m)

    @triton.jit
    def _exp_f32(x):
        """exp(x) in fp32 to a few ulp (like CUDA's expf), for fp32 x. tl.exp is
        exp2(x * log2e) on the fast exp2, whose product rounding costs |x| * 2^-24 relative
        accuracy; here exp(x) = 2^n exp(r) with r = x - n ln2 (Cody-Waite, FMA), so exp2 only
        sees |r log2e| <= 1/2, and 2^n is applied as two exact power-of-two factors (overflow
        to inf and underflow to 0 as expf)."""
        x = tl.minimum(tl.maximum(x, -110.0), 89.0)
        n = tl.floor(x * 1.4426950408889634 + 0.5)
        r = tl.fma(n, -0.693145751953125, x)              # ln 2 = hi + lo, hi has 15 bits
        r = tl.fma(n, -1.428606765330187e-06, r)
        e = tl.exp2(r * 1.4426950408889634)
        ni = n.to(tl.int32)                                 # [-159, 128]
        n1 = ni >> 1
        s1 = ((n1 + 127) << 23).to(tl.float32, bitcast=True)
        s2 = ((ni - n1 + 127) << 23).to(tl.float32, bitcast=True)
        return e * s1 * s2

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, I, sxt, sxi, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        """y [T, I] = silu(x[:, :I]) * x[:, I:]; silu rounded to y's dtype first."""
        pdl_sync(PDL)
        t = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < I
        row = x_ptr + t * sxt
        g = tl.load(row + i * sxi, mask=m, other=0.0).to(tl.float32)
        u = tl.load(row + (i + I) * sxi, mask=m, other=0.0).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        act = tl.div_rn(g, 1.0 + _exp_f32(-g)).to(dt).to(tl.float32)
        tl.store(y_ptr + t * I + i, (act * u).to(dt), mask=m)


# -- launchers ------------------------------------------------------------------------------------

def _rows(x: torch.Tensor):
    """x [..., D] -> (x', R, N1, s0, s1, sd): row r of the R = prod(leading) rows sits at
    (r // N1) * s0 + (r % N1) * s1. Up to two leading dims are taken as strided views (a q / k
    head view of a projection output needs no copy); more are reshaped."""
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
    if x.dim() == 1:
        return x, 1, 1, 0, 0, x.stride(0)
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0, x.stride(1)
    return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1), x.stride(2)


def norm_launch_config(R: int, D: int, max_block_d: int = MAX_BLOCK_D) -> dict:
    """Static tile sizes: a row (or max_block_d chunks of it) per program column, several rows
    per program while the tile stays <= NORM_TILE elements."""
    block_d = min(pow2(D), pow2(max_block_d))
    chunks = -(-D // block_d)
    block_r = max(1, min(pow2(R), NORM_TILE // block_d))
    warps = min(16, max(1, block_r * block_d // 512))
    return dict(BLOCK_R=block_r, BLOCK_D=block_d, CHUNKS=chunks, num_warps=warps)


def _norm(x, residual, weight, eps, max_block_d):
    D = x.shape[-1]
    assert weight.shape == (D,), (weight.shape, D)
    if residual is not None:
        assert residual.shape == x.shape, (residual.shape, x.shape)
        h_dtype = torch.promote_types(residual.dtype, x.dtype)
    else:
        h_dtype = x.dtype
    y = torch.empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    h = torch.empty(x.shape, dtype=h_dtype, device=x.device) if residual is not None else None
    xv, R, N1, sx0, sx1, sxd = _rows(x)
    if residual is not None:
        rv, _, _, sr0, sr1, srd = _rows(residual)
    else:
        rv, sr0, sr1, srd = xv, 0, 0, 0
    if R == 0 or D == 0:
        return y, h
    cfg = norm_launch_config(R, D, max_block_d)
    run_kernel(_rms_norm_kernel, (triton.cdiv(R, cfg["BLOCK_R"]),),
               xv, rv, weight, y, h if h is not None else xv,
               R, N1, D, 1.0 / D, float(eps), sx0, sx1, sxd, sr0, sr1, srd,
               HAS_RES=residual is not None, **cfg)
    return y, h


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    max_block_d: int = MAX_BLOCK_D) -> torch.Tensor:
    return _norm(x, None, weight, eps, max_block_d)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, max_block_d: int = MAX_BLOCK_D
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps, max_block_d)


def rope_launch_config(H: int, half: int) -> dict:
    block_f = pow2(half)
    block_h = max(1, min(pow2(H), 1024 // block_f))
    return dict(BLOCK_H=block_h, BLOCK_F=block_f, num_warps=4 if block_h * block_f >= 512 else 2)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                interleave: bool) -> torch.Tensor:
    T, H, dim = x.shape
    half = dim // 2
    assert dim == 2 * half and cos.shape[-1] == half and sin.shape[-1] == half, (x.shape, cos.shape)
    assert pos.shape == (T,), (pos.shape, T)
    y = torch.empty((T, H, dim), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    cfg = rope_launch_config(H, half)
    run_kernel(_rope_kernel, (T, triton.cdiv(H, cfg["BLOCK_H"])),
               x, cos, sin, pos, y, H, half, *x.stride(), *cos.stride(), *sin.stride(),
               pos.stride(0), INTERLEAVE=bool(interleave), enable_fp_fusion=False, **cfg)
    return y


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    shape = gate_up.shape
    x = gate_up.reshape(-1, shape[-1]) if gate_up.dim() != 2 else gate_up
    T, two_i = x.shape
    inter = two_i // 2
    assert two_i == 2 * inter, shape
    y = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if y.numel() > 0:
        block = min(1024, pow2(inter))
        run_kernel(_silu_mul_kernel, (T, triton.cdiv(inter, block)), x, y, inter,
                   x.stride(0), x.stride(1), BLOCK=block, num_warps=4 if block >= 512 else 1)
    return y.view(*shape[:-1], inter)


def select_tokens_torch(src: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.where(src >= 0, tokens[src.clamp(min=0)], ids)


if HAS_TRITON:
    @triton.jit(do_not_specialize=["T"])
    def _select_tokens_kernel(src_ptr, ids_ptr, tok_ptr, out_ptr, T, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
        pdl_sync(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < T
        s = tl.load(src_ptr + i, mask=m, other=-1)
        from_dev = s >= 0
        t = tl.load(tok_ptr + tl.where(from_dev, s, 0), mask=m & from_dev, other=0)
        x = tl.load(ids_ptr + i, mask=m & (s < 0), other=0)
        tl.store(out_ptr + i, tl.where(from_dev, t, x), mask=m)


def select_tokens_triton(src: torch.Tensor, ids: torch.Tensor,
                         tokens: torch.Tensor) -> torch.Tensor:
    T = src.numel()
    assert ids.shape == src.shape and src.is_contiguous() and ids.is_contiguous()
    out = torch.empty_like(ids)
    if T:
        block = min(1024, pow2(T))
        run_kernel(_select_tokens_kernel, (triton.cdiv(T, block),), src, ids, tokens, out, T,
                   BLOCK=block, num_warps=1)
    return out


# -- dispatch -------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in promote(x.dtype, weight.dtype)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x); one kernel on CUDA."""
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
         interleave: bool) -> torch.Tensor:
    """x [T, h, dim] (any strides), cos / sin [P, dim/2] fp32 tables, pos [T] -> [T, h, dim]
    contiguous in x.dtype. Positions are not bounds-checked on the Triton path."""
    if use_triton(x):
        return rope_triton(x, cos, sin, pos, interleave)
    return rope_torch(x, cos, sin, pos, interleave)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2*I] -> silu(gate) * up [..., I] in gate_up.dtype."""
    if use_triton(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_torch(gate_up)


def select_tokens(src: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Input ids of a step whose tokens may still be on the device: out[i] = tokens[src[i]]
    where src[i] >= 0 (a row of the previous step's sampled tokens), else ids[i]. src and ids
    int64 [T], tokens int64 [R]; one kernel on CUDA."""
    if use_triton(src):
        return select_tokens_triton(src, ids, tokens)
    return select_tokens_torch(src, ids, tokens)
