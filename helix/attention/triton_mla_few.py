"""Absorbed MLA decode for few query heads per rank (DeepSeek-V2-Lite: 16; <= 64), paged,
split along KV. Same contract as triton_mla.mla_decode; the 128-head kernel there is unchanged.

With 16 heads the head block is the M dimension of triton_mla's products: 16 rows, below the
64 a Hopper wgmma needs, so those products run as mma.sync, and the kernel (tuned for 64-head
blocks: 8 warps, split-QK layout, TMA descriptors built per program) carries per-program costs
that short splits do not amortise. Here one program owns (split, batch) with ALL heads, and
the products can be swapped (SWAP, "swap AB") so the TOKENS fill M:
    S^T [BLOCK_N, H] = C [BLOCK_N, Dl] Q_latent^T + Kr [BLOCK_N, Dr] Q_rope^T
    O^T [Dl, H]     += C^T [Dl, BLOCK_N] P^T [BLOCK_N, H]         (C doubles as V)
(M = BLOCK_N and Dl, N = H >= 16: wgmma shapes m64n16k16 and up); the online softmax runs down
the token axis per head. SWAP=False keeps heads as M (triton_mla's orientation, no TMA). KV
tiles go through plain loads that Triton's pipeliner turns into cp.async stages (num_stages);
no tensor descriptors. Split partials merge in triton_splits.reduce_splits.

Variants (FEW_TUNABLES, `mla_decode_few(config=...)`) are compared on the GPU by
profiling/bench_step_kernels.py. triton_mla.mla_decode routes heads <= FEW_HEADS_DEFAULT here
(HELIX_MLA_FEW=0 turns that off, =1 extends it to FEW_HEADS_MAX): whole DeepSeek-V2-Lite
decode steps on one H200 were faster with it at every point measured, batch 1 and 8 x 1K-128K,
3.8 -> 5.3 ms at batch 1 x 128K (profiling/results/step_floor_1gpu/).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from helix.attention.triton_splits import (LN2, LOG2E, choose_num_splits, fill_num_splits,
                                           reduce_splits, run_kernel, sm_count_of, split_range,
                                           split_workspace, token_rows)
from helix.triton_util import pdl_sync

MODE = os.environ.get("HELIX_MLA_FEW", "")       # "" default, "0" off, anything else: up to 64
FEW_HEADS_MAX = 64                # the kernel's limit
FEW_HEADS_DEFAULT = 32            # routed here by default (measured: 16 heads)


def routes(heads: int) -> bool:
    """Whether triton_mla.mla_decode sends a launch of `heads` query heads here."""
    if MODE == "0":
        return False
    return heads <= (FEW_HEADS_MAX if MODE else FEW_HEADS_DEFAULT)
FEW_TUNABLES = ("SWAP", "BLOCK_N", "num_warps", "num_stages", "split_policy", "min_tokens",
                "partial_dtype")


@triton.jit(do_not_specialize=["stride_btb"])   # block-table width: varies per step
def _mla_few_kernel(
    ql_ptr, qr_ptr, kv_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
    stride_qlb, stride_qlh,                # q_latent [B, H, Dl]
    stride_qrb, stride_qrh,                # q_rope [B, H, Dr]
    stride_kvp, stride_kvt,                # kv_cache [P, page, Dl + Dr]
    stride_btb,                            # block_tables [B, max_pages] int32
    stride_ob, stride_oh, stride_os,       # o: [B, H, S, Dl] partials, or [B, H, Dl] (S = 1)
    stride_lb, stride_lh,                  # lse: [B, H, S] partials, or [B, H]
    HEADS, num_splits,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SWAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_sync(PDL)
    split = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < HEADS
    cl = tl.arange(0, BLOCK_DL)
    lmask = cl < D_LATENT
    cr = tl.arange(0, BLOCK_DR)
    rmask = cr < D_ROPE
    kv_dtype = ql_ptr.dtype.element_ty     # cached values become the query's dtype; fp8 ones
    if kv_ptr.dtype.element_ty == tl.float8e4nv and kv_dtype == tl.bfloat16:   # under bf16:
        kv_dtype = tl.float16              # fp16, q too (one cvt per pair on sm_90)
    ql = tl.load(ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + cl[None, :],
                 mask=hmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)   # [BH, DL]
    qr = tl.load(qr_ptr + b * stride_qrb + heads[:, None] * stride_qrh + cr[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0).to(kv_dtype)   # [BH, DR]
    kv_len = tl.load(lens_ptr + b)
    start, end = split_range(kv_len, split, num_splits, BLOCK_N)
    bt_row = bt_ptr + b * stride_btb

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([BLOCK_DL, BLOCK_H], dtype=tl.float32)                     # O^T
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        rows, tmask = token_rows(bt_row, t0, end, stride_kvp, stride_kvt, BLOCK_N, PAGE_SIZE)
        c = tl.load(kv_ptr + rows[:, None] + cl[None, :],
                    mask=tmask[:, None] & lmask[None, :], other=0.0).to(kv_dtype)    # [N, DL]
        kr = tl.load(kv_ptr + rows[:, None] + D_LATENT + cr[None, :],
                     mask=tmask[:, None] & rmask[None, :], other=0.0).to(kv_dtype)   # [N, DR]
        if SWAP:
            s = tl.dot(c, tl.trans(ql), input_precision=DOT_PRECISION)
            s = tl.dot(kr, tl.trans(qr), acc=s, input_precision=DOT_PRECISION)       # [N, BH]
            s = tl.where(tmask[:, None], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha[None, :]
            acc = tl.dot(tl.trans(c), p.to(kv_dtype), acc=acc,
                         input_precision=DOT_PRECISION)                              # [DL, BH]
        else:
            s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
            s = tl.dot(qr, tl.trans(kr), acc=s, input_precision=DOT_PRECISION)       # [BH, N]
            s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kv_dtype), c, acc=acc, input_precision=DOT_PRECISION)  # [BH, DL]
        m_i = m_new

    has = l_i > 0                                  # an empty split or sequence: O = 0, -inf
    inv = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    o_row = o_ptr + b * stride_ob + split * stride_os
    if SWAP:
        tl.store(o_row + heads.to(tl.int64)[None, :] * stride_oh + cl[:, None],
                 acc * inv[None, :], mask=lmask[:, None] & hmask[None, :])
    else:
        tl.store(o_row + heads.to(tl.int64)[:, None] * stride_oh + cl[None, :],
                 acc * inv[:, None], mask=hmask[:, None] & lmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


def few_launch_config(heads: int, d_latent: int, d_rope: int, dtype: torch.dtype) -> dict:
    """Defaults before measuring. SWAP with 64-token tiles (wgmma M = 64), 4 warps (one
    warpgroup: O^T [512, 16] fp32 is 64 registers a thread), 2 stages (Q 18 KB + 2 x 72 KB of
    smem at DeepSeek's widths), splits from the fill policy with >= 2 tiles a split. `dtype`
    is the KV cache's: fp32 and fp8 (its tiles converted in registers: 760 B of spills at 64
    tokens, none at 32; sm_90 compiles with triton 3.6, not yet timed) take 32-token tiles."""
    block_n = 64 if dtype in (torch.bfloat16, torch.float16) else 32
    return dict(SWAP=True, BLOCK_N=block_n, num_warps=4, num_stages=2, split_policy="fill",
                min_tokens=2 * block_n, partial_dtype=None,
                BLOCK_H=max(16, triton.next_power_of_2(heads)),
                BLOCK_DL=max(16, triton.next_power_of_2(d_latent)),
                BLOCK_DR=max(16, triton.next_power_of_2(d_rope)))


def few_plan(batch: int, heads: int, d_latent: int, d_rope: int, dtype: torch.dtype,
             max_context: int, device: torch.device, config: dict | None = None,
             num_splits: int | None = None) -> tuple[dict, int, torch.dtype]:
    cfg = few_launch_config(heads, d_latent, d_rope, dtype)
    unknown = set(config or {}) - set(FEW_TUNABLES)
    if unknown:
        raise ValueError(f"unknown few-heads MLA tunables {sorted(unknown)}; known: {FEW_TUNABLES}")
    cfg.update(config or {})
    policy, min_tokens = cfg.pop("split_policy"), cfg.pop("min_tokens")
    partial_dtype = cfg.pop("partial_dtype") or torch.float32
    if num_splits is None:
        args = (batch, 1, max_context, sm_count_of(device))
        if policy == "fill":
            num_splits = fill_num_splits(*args, min_tokens=min_tokens, max_splits=128)
        elif policy in ("2waves", "1wave"):
            num_splits = choose_num_splits(*args, min_tokens=min_tokens, max_splits=128,
                                           waves=2.0 if policy == "2waves" else 1.0,
                                           round_up=policy == "2waves")
        else:
            raise ValueError(f"split_policy {policy!r} not in ('fill', '2waves', '1wave')")
    return cfg, num_splits, partial_dtype


def mla_decode_few(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                   block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                   num_splits: int | None = None,
                   config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_mla.mla_decode's contract for H <= FEW_HEADS_MAX: q_latent [B, H, Dl], q_rope
    [B, H, Dr], kv_cache [P, page, Dl + Dr], block_tables [B, max_pages] int32, kv_lens [B]
    int32 -> o [B, H, Dl] in q_latent.dtype, lse [B, H] fp32 (natural log)."""
    B, H, Dl = q_latent.shape
    Dr = q_rope.shape[-1]
    _, page_size, width = kv_cache.shape
    assert width == Dl + Dr and kv_cache.stride(-1) == 1 and H <= FEW_HEADS_MAX
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    o = torch.empty((B, H, Dl), dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.empty((B, H), dtype=torch.float32, device=q_latent.device)
    if B == 0:
        return o, lse
    cfg, num_splits, partial_dtype = few_plan(B, H, Dl, Dr, kv_cache.dtype,
                                              block_tables.shape[1] * page_size,
                                              q_latent.device, config, num_splits)
    o_ws, lse_ws, so, sl = split_workspace(o, lse, num_splits, partial_dtype)
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"   # products in q's dtype
    run_kernel(
        _mla_few_kernel, (num_splits, B),
        q_latent, q_rope, kv_cache, block_tables, kv_lens, o_ws, lse_ws, scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), *so, *sl,
        H, num_splits, D_LATENT=Dl, D_ROPE=Dr, PAGE_SIZE=page_size, DOT_PRECISION=precision,
        **cfg)
    if num_splits > 1:
        reduce_splits(o_ws, lse_ws, o, lse)
    return o, lse
