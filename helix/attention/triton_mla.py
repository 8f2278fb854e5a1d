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
heads would not fit one program.) The running max is rescaled lazily (only when it grows by
> 2^8), sparing the [64, 512] accumulator multiply on most tiles. Small test dims are padded to
powers of two >= 16 with masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helix.attention.triton_splits import (LN2, LOG2E, choose_num_splits, reduce_splits,
                                           run_kernel, sm_count_of, split_range, token_rows)


@triton.jit
def _mla_split_kernel(
    ql_ptr, qr_ptr, kv_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
    stride_qlb, stride_qlh,                # q_latent [B, H, Dl]
    stride_qrb, stride_qrh,                # q_rope [B, H, Dr]
    stride_kvp, stride_kvt,                # kv_cache [P, page, Dl + Dr]
    stride_btb,                            # block_tables [B, max_pages] int32
    stride_ob, stride_oh, stride_os,       # o: [B, H, S, Dl] partials, or [B, H, Dl] (S = 1)
    stride_lb, stride_lh,                  # lse: [B, H, S] partials, or [B, H]
    HEADS, D_LATENT, D_ROPE,
    BLOCK_H: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < HEADS
    cl = tl.arange(0, BLOCK_DL)
    lmask = cl < D_LATENT
    cr = tl.arange(0, BLOCK_DR)
    rmask = cr < D_ROPE
    kv_dtype = kv_ptr.dtype.element_ty

    ql = tl.load(ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + cl[None, :],
                 mask=hmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)   # [BH, DL]
    qr = tl.load(qr_ptr + b * stride_qrb + heads[:, None] * stride_qrh + cr[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0).to(kv_dtype)   # [BH, DR]

    kv_len = tl.load(lens_ptr + b)
    start, end = split_range(kv_len, split, NUM_SPLITS, BLOCK_N)
    bt_row = bt_ptr + b * stride_btb

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        rows, tmask = token_rows(bt_row, t0, end, stride_kvp, stride_kvt, BLOCK_N, PAGE_SIZE)
        c = tl.load(kv_ptr + rows[:, None] + cl[None, :],
                    mask=tmask[:, None] & lmask[None, :], other=0.0)             # [N, DL]
        kr = tl.load(kv_ptr + rows[:, None] + D_LATENT + cr[None, :],
                     mask=tmask[:, None] & rmask[None, :], other=0.0)            # [N, DR]
        s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(qr, tl.trans(kr), acc=s, input_precision=DOT_PRECISION)
        s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))             # [BH, N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Lazy rescale: keep a stale running max until some row's grows by > 2^8 (the first
        # block always rescales). Exact, since l and acc share the max; p stays <= 256. Saves
        # the [BH, Dl] accumulator multiply on most blocks.
        if tl.max(m_new - m_i, axis=0) > 8.0:
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i += tl.sum(p, axis=1)
        acc = tl.dot(p.to(kv_dtype), c, acc=acc, input_precision=DOT_PRECISION)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    o_off = b * stride_ob + heads.to(tl.int64)[:, None] * stride_oh + split * stride_os
    tl.store(o_ptr + o_off + cl[None, :], out, mask=hmask[:, None] & lmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


def mla_launch_config(heads: int, d_latent: int, d_rope: int, dtype: torch.dtype) -> dict:
    """BLOCK_H heads per program (64 for DeepSeek: the 64 x 512 fp32 accumulator over 8 warps,
    two warpgroups of wgmma), BLOCK_N tokens per tile (32 x 576 bf16 = 36 KB). DeepSeek on sm_90
    (profiling/kernel_resources.py): wgmma, 255 registers, 8 bytes of stack, 144 KB of shared
    memory (Q 72 KB + 2 KV stages): one program per SM. BLOCK_N = 64 spills 248 bytes."""
    block_dl = max(16, triton.next_power_of_2(d_latent))
    block_dr = max(16, triton.next_power_of_2(d_rope))
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    block_n = 32 if block_dl >= 256 else 64
    if dtype == torch.float32:          # 4-byte tiles: half the heads and tokens per program
        block_h, block_n = min(block_h, 32), block_n // 2
    big = block_h * block_dl >= 64 * 256
    return dict(BLOCK_H=block_h, BLOCK_DL=block_dl, BLOCK_DR=block_dr, BLOCK_N=block_n,
                num_warps=8 if big else 4, num_stages=2)


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
               block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
               num_splits: int | None = None, block_n: int | None = None,
               block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [B, H, Dl], q_rope [B, H, Dr], kv_cache [P, page, Dl + Dr] (latent, rope key),
    block_tables [B, max_pages] int32, kv_lens [B] int32 -> o [B, H, Dl] in q_latent.dtype,
    lse [B, H] fp32 (natural log, -inf where kv_len == 0)."""
    B, H, Dl = q_latent.shape
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
    config = mla_launch_config(H, Dl, Dr, kv_cache.dtype)
    if block_n is not None:
        config["BLOCK_N"] = block_n
    if block_h is not None:
        config["BLOCK_H"] = block_h
    head_blocks = triton.cdiv(H, config["BLOCK_H"])
    if num_splits is None:   # fill the GPU: compute-bound, and one program per SM (smem)
        num_splits = choose_num_splits(B, head_blocks, block_tables.shape[1] * page_size,
                                       sm_count_of(q_latent.device))
    if num_splits == 1:
        o_ws, lse_ws = o, lse
        so, sl = (o.stride(0), o.stride(1), 0), (lse.stride(0), lse.stride(1))
    else:
        o_ws = torch.empty((B, H, num_splits, Dl), dtype=torch.float32, device=o.device)
        lse_ws = torch.empty((B, H, num_splits), dtype=torch.float32, device=o.device)
        so = (o_ws.stride(0), o_ws.stride(1), o_ws.stride(2))
        sl = (lse_ws.stride(0), lse_ws.stride(1))
    precision = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    run_kernel(
        _mla_split_kernel, (head_blocks, num_splits, B),
        q_latent, q_rope, kv_cache, block_tables, kv_lens, o_ws, lse_ws, scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), *so, *sl,
        H, Dl, Dr, PAGE_SIZE=page_size, NUM_SPLITS=num_splits, DOT_PRECISION=precision,
        **config)
    if num_splits > 1:
        reduce_splits(o_ws, lse_ws, o, lse)
    return o, lse
