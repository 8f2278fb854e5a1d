"""Qwen3's per-head q / k RMS norms and the rotary embedding of both, one Triton launch; in a
step without context parallelism, the KV append in that launch too (Llama: rope alone).

    qk_norm_rope(q [T, Hq, d], k [T, Hk, d], q_w [d], k_w [d], eps, cos, sin, pos, interleave)
        -> (rope(rms_norm(q) * q_w), rope(rms_norm(k) * k_w)), each [T, H, d] contiguous
    rope_append(q, k, v, q_w | None, k_w | None, eps, cos, sin, pos, interleave, k_cache,
                v_cache, slots) -> rope(q); rope(k) and v written to the caches at slots

rope_append replaces the rotation launch and triton_append's append launch of a GQA decode
step (one dependent launch fewer a layer): the program of a k head stores its rotated head at
the row's slot instead of to an output, v's heads are a third range of heads copied there.

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
from helix.triton_util import HAS_TRITON, cache_cast, pdl_sync, pow2, run_kernel, tl, triton

FUSE = True          # module flag (benches switch it): the one-launch path where it applies
FUSE_APPEND = True   # module flag (benches switch it): rope_append's one launch where it applies

if HAS_TRITON:
    from helix.layers.fused_ops import _rope_pairs, _rstd

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, ko_ptr,
        HQ, HK, HALF, inv_d, eps,
        sqt, sqh, skt, skh,             # q [T, HQ, 2*HALF], k [T, HK, 2*HALF]: unit stride in d
        sct, sst,                       # cos / sin [P, HALF], unit stride
        v_ptr, svt, svh, slots_ptr, kc_ptr, vc_ptr, stride_slot,    # APPEND only
        INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr,
        NORM: tl.constexpr = True, APPEND: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        """Program (t, hb): heads hb * BLOCK_H ... of row t, numbered q heads first, then k,
        then (APPEND) v. NORM: each q / k head's RMS norm before its rotation. APPEND: k's
        rotated heads and v's heads go to the paged caches [P, page, HK, 2*HALF] at slot
        slots[t] (-1: skipped), not to ko."""
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
        dt = qo_ptr.dtype.element_ty
        if NORM:
            rstd = _rstd(tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1), inv_d, eps)   # [BH]
            sel = is_q[:, None]
            wa = tl.where(sel, tl.load(qw_ptr + fa, mask=fmask, other=0.0).to(tl.float32)[None, :],
                          tl.load(kw_ptr + fa, mask=fmask, other=0.0).to(tl.float32)[None, :])
            wb = tl.where(sel, tl.load(qw_ptr + fb, mask=fmask, other=0.0).to(tl.float32)[None, :],
                          tl.load(kw_ptr + fb, mask=fmask, other=0.0).to(tl.float32)[None, :])
            ya = ((a * rstd[:, None]).to(dt).to(tl.float32) * wa).to(dt).to(tl.float32)
            yb = ((b * rstd[:, None]).to(dt).to(tl.float32) * wb).to(dt).to(tl.float32)
        else:
            ya = a
            yb = b
        p = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + p * sct + f, mask=fmask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + p * sst + f, mask=fmask, other=0.0).to(tl.float32)[None, :]
        lo = (ya * c - yb * s).to(dt)
        hi = (yb * c + ya * s).to(dt)
        q_out = qo_ptr + (t * HQ + hh[:, None]) * (2 * HALF) + f[None, :]
        tl.store(q_out, lo, mask=mq)
        tl.store(q_out + HALF, hi, mask=mq)
        if APPEND:
            # slot -1 (another rank owns the position, or a padding row): nothing written
            slot = tl.load(slots_ptr + t).to(tl.int64)      # int64: slot * row can pass 2^31
            own = (tl.full([BLOCK_H], 0, tl.int64) + slot >= 0)[:, None]
            cdt = kc_ptr.dtype.element_ty
            k_out = kc_ptr + slot * stride_slot + hk[:, None] * (2 * HALF) + f[None, :]
            tl.store(k_out, cache_cast(lo, cdt), mask=mk & own)
            tl.store(k_out + HALF, cache_cast(hi, cdt), mask=mk & own)
            hv = hh - HQ - HK
            mv = ((hv >= 0) & (hv < HK))[:, None] & fmask[None, :] & own
            v_row = v_ptr + t * svt + hv[:, None] * svh + f[None, :]
            v_out = vc_ptr + slot * stride_slot + hv[:, None] * (2 * HALF) + f[None, :]
            tl.store(v_out, cache_cast(tl.load(v_row, mask=mv, other=0.0), cdt), mask=mv)
            tl.store(v_out + HALF, cache_cast(tl.load(v_row + HALF, mask=mv, other=0.0), cdt),
                     mask=mv)
        else:
            k_out = ko_ptr + (t * HK + hk[:, None]) * (2 * HALF) + f[None, :]
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


def _launch(q, k, q_w, k_w, eps, cos, sin, pos, interleave, qo, ko, append=None):
    """The kernel over q and k (and, with append = (v, k_cache, v_cache, slots), v's heads)."""
    T, HQ, d = q.shape
    HK = k.shape[1]
    half = d // 2
    assert k.shape == (T, HK, d) and 2 * half == d and cos.shape[-1] == half, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert pos.shape == (T,)
    norm = q_w is not None
    if norm:
        assert q_w.shape == k_w.shape == (d,)
    if T == 0:
        return
    if append is None:
        v, kc, vc, slots, heads = q, q, q, pos, HQ + HK
    else:
        v, kc, vc, slots = append
        heads = HQ + 2 * HK
    cfg = launch_config(heads, half)
    run_kernel(_qk_norm_rope_kernel, (T, triton.cdiv(heads, cfg["BLOCK_H"])),
               q, k, q_w if norm else q, k_w if norm else q, cos, sin, pos, qo, ko, HQ, HK, half,
               1.0 / d, float(eps), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
               cos.stride(0), sin.stride(0), v, v.stride(0), v.stride(1), slots, kc, vc,
               HK * d, INTERLEAVE=bool(interleave), NORM=norm, APPEND=append is not None,
               enable_fp_fusion=False, **cfg)


def qk_norm_rope_triton(q, k, q_w, k_w, eps, cos, sin, pos, interleave):
    T, HQ, d = q.shape
    qo = torch.empty((T, HQ, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, k.shape[1], d), dtype=k.dtype, device=k.device)
    _launch(q, k, q_w, k_w, eps, cos, sin, pos, interleave, qo, ko)
    return qo, ko


def _operands_fit(q, k, q_w, k_w) -> bool:
    """The kernel's operands: CUDA (fused_ops.use_triton), q / k (and the norm weights, when
    given) in one dtype, unit stride in d, d even."""
    return (use_triton(q) and q.dtype == k.dtype
            and (q_w is None or q.dtype == q_w.dtype == k_w.dtype)
            and q.stride(2) == 1 and k.stride(2) == 1 and q.shape[-1] % 2 == 0)


def fits(q, k, q_w, k_w) -> bool:
    """Whether qk_norm_rope takes the kernel."""
    return FUSE and _operands_fit(q, k, q_w, k_w)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                 interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(rms_norm(q, q_w)), rope(rms_norm(k, k_w))) by their global positions pos [T]
    (cos / sin [P, d/2] fp32): one launch on CUDA (module doc), else the two functions."""
    if fits(q, k, q_w, k_w):
        return qk_norm_rope_triton(q, k, q_w, k_w, eps, cos, sin, pos, interleave)
    return qk_norm_rope_composed(q, k, q_w, k_w, eps, cos, sin, pos, interleave)


def rope_append_fits(q, k, v, k_cache, v_cache, q_w=None, k_w=None) -> bool:
    """Whether rope_append takes the one launch: FUSE_APPEND (and FUSE with the norms), the
    kernel's operands (_operands_fit), v like k, contiguous caches of k's heads [P, page, HK,
    d]."""
    return (FUSE_APPEND and (q_w is None or FUSE) and _operands_fit(q, k, q_w, k_w)
            and v.dtype == k.dtype and v.shape == k.shape and v.stride(2) == 1
            and k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == k.shape[1:]
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor | None,
                k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor, interleave: bool, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A decode step's q / k rotation and KV append in ONE launch (rope_append_fits): q [T, Hq,
    d], k, v [T, Hk, d], pos / slots [T] -> rope(q) [T, Hq, d] contiguous; rope(k) and v are
    written into k_cache / v_cache at slots (-1 skipped), k itself is not returned. With
    q_w / k_w, the per-head RMS norms come first (Qwen3, qk_norm_rope's values). The same
    values as rotating (qk_norm_rope or fused_ops.rope) and then triton_append.append_kv_pair,
    one launch instead of two."""
    assert slots.shape == pos.shape and k_cache.shape[0] * k_cache.shape[1] > 0
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, k, q_w, k_w, eps, cos, sin, pos, interleave, qo, qo, (v, k_cache, v_cache, slots))
    return qo
