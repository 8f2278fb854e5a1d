"""Qwen3's per-head q / k RMS norms and the rotary embedding of both, one Triton launch.

    qk_norm_rope(q [T, Hq, d], k [T, Hk, d], q_w [d], k_w [d], eps, cos, sin, pos, interleave)
        -> (rope(rms_norm(q) * q_w), rope(rms_norm(k) * k_w)), each [T, H, d] contiguous

In a decode step this was four launches a layer (two norms, two ropes: q and k are no longer
adjacent once each has its own norm weight), each a few microseconds of dependent latency for
a few kilobytes. One program takes (row t, a block of heads across q then k), normalises every
head's d values and rotates them in registers.

Rounding is the composition of helix.layers.fused_ops' rms_norm and rope, step by step: the sum
of squares in fp32, 1 / sqrt(mean + eps) correctly rounded, x * rstd rounded to the input dtype,
times the weight rounded once (the norm's output, which rope reads), then the rotation in fp32
with each product and sum rounded separately (no FMA contraction), rounded to the dtype. Only the
order of the d-term sum of squares differs from the two kernels (pairs of halves here), which
can move rstd by an ulp. The torch fallback (off CUDA, HELIX_FUSED_OPS=0, FUSE off, or a weight
dtype other than the input's) is those two functions composed.
"""

from __future__ import annotations

import torch

from helix.layers.fused_ops import rms_norm, rope, use_triton
from helix.triton_util import HAS_TRITON, pdl_sync, pow2, run_kernel, tl, triton

FUSE = True          # module flag (benches switch it): the one-launch path where it applies

if HAS_TRITON:
    from helix.layers.fused_ops import _rope_pairs, _rstd

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, ko_ptr,
        HQ, HK, HALF, inv_d, eps,
        sqt, sqh, skt, skh,             # q [T, HQ, 2*HALF], k [T, HK, 2*HALF]: unit stride in d
        sct, sst,                       # cos / sin [P, HALF], unit stride
        INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Program (t, hb): heads hb * BLOCK_H ... of row t, numbered q heads first, then k."""
        pdl_sync(PDL)
        t = tl.program_id(0).to(tl.int64)
        hh = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        is_q = hh < HQ
        hk = hh - HQ
        f = tl.arange(0, BLOCK_F)
        fmask = f < HALF
        mq = (is_q[:, None]) & fmask[None, :]
        mk = ((hh >= HQ) & (hh < HQ + HK))[:, None] & fmask[None, :]
        fa, fb = _rope_pairs(f, HALF, INTERLEAVE)
        q_row = q_ptr + t * sqt + hh[:, None] * sqh
        k_row = k_ptr + t * skt + hk[:, None] * skh
        a = (tl.load(q_row + fa[None, :], mask=mq, other=0.0).to(tl.float32)
             + tl.load(k_row + fa[None, :], mask=mk, other=0.0).to(tl.float32))
        b = (tl.load(q_row + fb[None, :], mask=mq, other=0.0).to(tl.float32)
             + tl.load(k_row + fb[None, :], mask=mk, other=0.0).to(tl.float32))
        rstd = _rstd(tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1), inv_d, eps)      # [BH]
        dt = qo_ptr.dtype.element_ty
        sel = is_q[:, None]
        wa = tl.where(sel, tl.load(qw_ptr + fa, mask=fmask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + fa, mask=fmask, other=0.0).to(tl.float32)[None, :])
        wb = tl.where(sel, tl.load(qw_ptr + fb, mask=fmask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + fb, mask=fmask, other=0.0).to(tl.float32)[None, :])
        ya = ((a * rstd[:, None]).to(dt).to(tl.float32) * wa).to(dt).to(tl.float32)
        yb = ((b * rstd[:, None]).to(dt).to(tl.float32) * wb).to(dt).to(tl.float32)
        p = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + p * sct + f, mask=fmask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + p * sst + f, mask=fmask, other=0.0).to(tl.float32)[None, :]
        lo = (ya * c - yb * s).to(dt)
        hi = (yb * c + ya * s).to(dt)
        q_out = qo_ptr + (t * HQ + hh[:, None]) * (2 * HALF) + f[None, :]
        k_out = ko_ptr + (t * HK + hk[:, None]) * (2 * HALF) + f[None, :]
        tl.store(q_out, lo, mask=mq)
        tl.store(q_out + HALF, hi, mask=mq)
        tl.store(k_out, lo, mask=mk)
        tl.store(k_out + HALF, hi, mask=mk)


def qk_norm_rope_composed(q, k, q_w, k_w, eps, cos, sin, pos, interleave):
    """The layer's previous path: fused_ops' rms_norm, then its rope, for q and for k (their
    kernels on CUDA, the torch formulas elsewhere)."""
    return (rope(rms_norm(q, q_w, eps), cos, sin, pos, interleave),
            rope(rms_norm(k, k_w, eps), cos, sin, pos, interleave))


def launch_config(heads: int, half: int) -> dict:
    block_f = pow2(half)
    block_h = max(1, min(pow2(heads), 1024 // block_f))
    return dict(BLOCK_H=block_h, BLOCK_F=block_f, num_warps=4 if block_h * block_f >= 512 else 2)


def qk_norm_rope_triton(q, k, q_w, k_w, eps, cos, sin, pos, interleave):
    T, HQ, d = q.shape
    HK = k.shape[1]
    half = d // 2
    assert k.shape == (T, HK, d) and 2 * half == d and cos.shape[-1] == half, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert pos.shape == (T,) and q_w.shape == k_w.shape == (d,)
    qo = torch.empty((T, HQ, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, HK, d), dtype=k.dtype, device=k.device)
    if T == 0:
        return qo, ko
    cfg = launch_config(HQ + HK, half)
    run_kernel(_qk_norm_rope_kernel, (T, triton.cdiv(HQ + HK, cfg["BLOCK_H"])),
               q, k, q_w, k_w, cos, sin, pos, qo, ko, HQ, HK, half, 1.0 / d, float(eps),
               q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
               INTERLEAVE=bool(interleave), enable_fp_fusion=False, **cfg)
    return qo, ko


def fits(q, k, q_w, k_w) -> bool:
    """Whether qk_norm_rope takes the kernel."""
    return (FUSE and use_triton(q) and q.dtype == k.dtype == q_w.dtype == k_w.dtype
            and q.stride(2) == 1 and k.stride(2) == 1 and q.shape[-1] % 2 == 0)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                 interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(rms_norm(q, q_w)), rope(rms_norm(k, k_w))) by their global positions pos [T]
    (cos / sin [P, d/2] fp32): one launch on CUDA (module doc), else the two functions."""
    if fits(q, k, q_w, k_w):
        return qk_norm_rope_triton(q, k, q_w, k_w, eps, cos, sin, pos, interleave)
    return qk_norm_rope_composed(q, k, q_w, k_w, eps, cos, sin, pos, interleave)
