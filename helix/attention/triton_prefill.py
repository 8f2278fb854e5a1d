"""Flash prefill attention over the paged KV cache, GQA and absorbed MLA, causal by global position,
returning (O, LSE) like every Helix attention path (so the exchange merges prefill partials
exactly as it merges decode partials). Memory is linear in the prompt: scores never leave a tile.

One program owns BLOCK_Q query tokens of one sequence x BLOCK_H query heads of one KV head:
M = BLOCK_Q * BLOCK_H rows (row m: query m // BLOCK_H, head m % BLOCK_H, so a query's heads are
adjacent in memory). Folding the GQA group into M loads each K/V tile once for every query head
that reads it. The program walks its sequence's local KV tiles with an online softmax in the
exp2 domain:
    S [M, N] = Q1 [M, D1] K1^T [D1, N] + Q2 [M, D2] K2^T [D2, N]      (scaled by scale * log2 e)
    O [M, DV] += P [M, N] V [N, DV]
- GQA: part 1 is the first D1 = 2^k <= d columns, part 2 the rest (head dim 192 = 128 + 64, the
  decompressed MLA form, pads nothing); V from its own pool.
- absorbed MLA: one latent KV head read by all H heads (GROUP = H): part 1 = q_latent . c (the
  latent columns of the cache row), part 2 = q_rope . k_rope (its rope columns), V = the latent
  tile already loaded for part 1 (V_IS_K1).

Causal masking is by GLOBAL position. Local KV index j on KVP rank r holds global position
local_to_global(j) (helix.kv.ownership), increasing in j, so a query at global position p sees
exactly the first local_len(p + 1) local keys. Every row of a block sees the first
local_len(p_lo + 1) keys (p_lo: the block's lowest position): those tiles run without a mask;
only the tiles up to local_len(p_hi + 1) are masked. Queries need not be contiguous nor aligned
with the local keys (other ranks own other positions; a prefix may be cached; context-parallel
sources hold a rank's own queries against another rank's shard). A row that sees no key gives
O = 0, LSE = -inf (a safe running max keeps exp2 away from -inf - -inf).

A few query rows over a long context (a short chunk after a cached prefix, speculative
decoding's guesses) would be a handful of programs streaming the whole KV: the keys are then
split across NUM_SPLITS programs (`num_splits`: choose_num_splits' rule over the launch's
static sizes, 1 for a long prompt), each writing an fp32 partial (O, LSE) that
triton_splits.reduce_splits merges exactly, the decode kernels' scheme.

Page ids are widened to int64 before they multiply a stride (pools over 2^31 elements). Nothing
asks the host: the grid comes from static sizes (meta.max_q, the head and sequence counts), the
lengths are read on the device, so a launch is CUDA-graph capturable. Query blocks run latest
first (the grid's first axis reversed): the longest programs start in the first wave.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helix.attention.triton_splits import (LN2, LOG2E, choose_num_splits, reduce_splits,
                                           sm_count_of, split_workspace)
from helix.kv.manager import LocalKVMeta
from helix.triton_util import pow2, run_kernel

TUNABLES = ("BLOCK_Q", "BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "num_splits")
MIN_SPLIT = 1024             # keys a KV split keeps at least (num_splits)


@triton.jit
def _local_len(length, kvp_rank, kvp, interleave):
    """Positions of [0, length) that KVP rank kvp_rank holds (helix.kv.ownership.local_len)."""
    cycle = kvp * interleave
    full = length // cycle
    rem = length - full * cycle
    return full * interleave + tl.minimum(tl.maximum(rem - kvp_rank * interleave, 0), interleave)


@triton.jit
def _page_ids(bt_row, t0, limit, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Page ids (int64) of local keys t0 .. t0 + BLOCK_N - 1: a scalar when the tile lies in one
    page (t0 is BLOCK_N-aligned), else one per key; 0 at or past `limit`. Loaded one tile ahead
    of their use and carried through the loop: a tile's K/V loads then do not wait on a load of
    their own iteration (Triton's pipeliner would spend a stage on that indirection)."""
    if PAGE_SIZE % BLOCK_N == 0:
        ids = tl.load(bt_row + t0 // PAGE_SIZE, mask=t0 < limit, other=0)
    else:
        t = t0 + tl.arange(0, BLOCK_N)
        ids = tl.load(bt_row + t // PAGE_SIZE, mask=t < limit, other=0)
    return ids.to(tl.int64)


@triton.jit
def _load_tile(base, page, off, stride_p, stride_t, tmask,
               D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of a paged pool; masked rows and padded columns read 0."""
    cols = tl.arange(0, BLOCK_D)
    ptrs = base + (page * stride_p + off * stride_t)[:, None] + cols[None, :]
    if MASKED or BLOCK_D != D:
        return tl.load(ptrs, mask=tmask[:, None] & (cols < D)[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _tile(q1, q2, k1_base, k2_base, v_base, page, t0, limit, pos, m_i, l_i, acc, scale_log2,
          kvp_rank, kvp, interleave, stride_k1p, stride_k1t, stride_k2p, stride_k2t,
          stride_vp, stride_vt,
          D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
          PAGE_SIZE: tl.constexpr, SHARDED: tl.constexpr, V_IS_K1: tl.constexpr,
          MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One KV tile (keys t0 .. t0 + BLOCK_N - 1, their page ids `page`) of the online softmax.
    MASKED: keys past `limit` and keys a row's causal prefix (by global position) does not
    reach are masked; else every row sees every key."""
    t = t0 + tl.arange(0, BLOCK_N)
    off = (t % PAGE_SIZE).to(tl.int64)
    tmask = t < limit
    k1 = _load_tile(k1_base, page, off, stride_k1p, stride_k1t, tmask, D1, BLOCK_D1,
                    MASKED).to(q1.dtype)                  # cached values (fp8 too) in q's dtype
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    if D2 > 0:
        k2 = _load_tile(k2_base, page, off, stride_k2p, stride_k2t, tmask, D2, BLOCK_D2,
                        MASKED).to(q1.dtype)
        s = tl.dot(q2, tl.trans(k2), acc=s, input_precision=DOT_PRECISION)
    s = s * scale_log2
    if MASKED:
        if SHARDED:
            cycle = kvp * interleave
            gpos = (t // interleave) * cycle + kvp_rank * interleave + t % interleave
        else:
            gpos = t
        s = tl.where((gpos[None, :] <= pos[:, None]) & tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that have seen no key
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_IS_K1:
        v = k1
    else:
        v = _load_tile(v_base, page, off, stride_vp, stride_vt, tmask, DV, BLOCK_DV,
                       MASKED).to(q1.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_btb"])   # block-table width: varies per step
def _prefill_kernel(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, bt_ptr, lens_ptr, cu_ptr, pos_ptr, o_ptr, lse_ptr,
    scale_log2, kvp_rank, kvp, interleave,
    stride_q1t, stride_q1h, stride_q2t, stride_q2h,      # q parts [T, Hq, D1], [T, Hq, D2]
    stride_k1p, stride_k1t, stride_k1h,                  # k parts [P, page, Hkv, D1 / D2]
    stride_k2p, stride_k2t, stride_k2h,
    stride_vp, stride_vt, stride_vh,                     # v [P, page, Hkv, DV]
    stride_btb, stride_ot, stride_oh, stride_lt,         # block_tables [S, W]; o [T, Hq, DV]
    stride_os, stride_lh,            # NUM_SPLITS > 1: o [T, Hq, NS, DV], lse [T, Hq, NS] (fp32)
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SHARDED: tl.constexpr, V_IS_K1: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr = 1,
):
    qb = tl.num_programs(0) - 1 - tl.program_id(0)       # latest (longest) query blocks first
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    s = (tl.program_id(2) // NUM_SPLITS).to(tl.int64)
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_ptr + s)
    n_q = tl.load(cu_ptr + s + 1) - q_start
    if qb * BLOCK_Q >= n_q:
        return

    m = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = qb * BLOCK_Q + m // BLOCK_H
    g = hb * BLOCK_H + m % BLOCK_H
    valid = (qi < n_q) & (g < GROUP)
    tok = (q_start + qi).to(tl.int64)
    head = (kvh * GROUP + g).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=valid, other=-1)                 # global positions
    kv_dtype = q1_ptr.dtype.element_ty          # products in q's dtype; a bf16 q over an fp8
    if k1_ptr.dtype.element_ty == tl.float8e4nv and kv_dtype == tl.bfloat16:   # cache: fp16
        kv_dtype = tl.float16                   # (one cvt per pair on sm_90)
    c1 = tl.arange(0, BLOCK_D1)
    q1 = tl.load(q1_ptr + tok[:, None] * stride_q1t + head[:, None] * stride_q1h + c1[None, :],
                 mask=valid[:, None] & (c1 < D1)[None, :], other=0.0).to(kv_dtype)
    if D2 > 0:
        c2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(q2_ptr + tok[:, None] * stride_q2t + head[:, None] * stride_q2h
                     + c2[None, :], mask=valid[:, None] & (c2 < D2)[None, :],
                     other=0.0).to(kv_dtype)
    else:
        q2 = q1                                                          # unused

    kv_len = tl.load(lens_ptr + s)
    p_lo = tl.min(tl.where(valid, pos, 1 << 62), axis=0)
    p_hi = tl.max(pos, axis=0)
    if SHARDED:
        n_full = _local_len(p_lo + 1, kvp_rank, kvp, interleave)
        n_vis = _local_len(p_hi + 1, kvp_rank, kvp, interleave)
    else:
        n_full = p_lo + 1
        n_vis = p_hi + 1
    n_full = tl.minimum(n_full, kv_len).to(tl.int32)      # keys every row of the block sees
    n_vis = tl.minimum(n_vis, kv_len).to(tl.int32)        # keys some row sees
    full_end = (n_full // BLOCK_N) * BLOCK_N
    # this program's keys: its split's share of [0, n_vis), whole tiles
    chunk = tl.cdiv(tl.cdiv(n_vis, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(n_vis, lo + chunk)
    full_hi = tl.minimum(hi, full_end)
    tail_lo = tl.maximum(lo, full_end)

    bt_row = bt_ptr + s * stride_btb
    kvh64 = kvh.to(tl.int64)
    k1_base = k1_ptr + kvh64 * stride_k1h
    k2_base = k2_ptr + kvh64 * stride_k2h
    v_base = v_ptr + kvh64 * stride_vh
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_DV], dtype=tl.float32)
    page = _page_ids(bt_row, lo, full_hi, BLOCK_N, PAGE_SIZE)
    for t0 in range(lo, full_hi, BLOCK_N):
        page_next = _page_ids(bt_row, t0 + BLOCK_N, full_hi, BLOCK_N, PAGE_SIZE)
        m_i, l_i, acc = _tile(q1, q2, k1_base, k2_base, v_base, page, t0, full_hi, pos,
                              m_i, l_i, acc, scale_log2, kvp_rank, kvp, interleave,
                              stride_k1p, stride_k1t, stride_k2p, stride_k2t,
                              stride_vp, stride_vt, D1, D2, DV, BLOCK_N, BLOCK_D1, BLOCK_D2,
                              BLOCK_DV, PAGE_SIZE, SHARDED, V_IS_K1, False, DOT_PRECISION)
        page = page_next
    page = _page_ids(bt_row, tail_lo, hi, BLOCK_N, PAGE_SIZE)
    for t0 in range(tail_lo, hi, BLOCK_N):
        page_next = _page_ids(bt_row, t0 + BLOCK_N, hi, BLOCK_N, PAGE_SIZE)
        m_i, l_i, acc = _tile(q1, q2, k1_base, k2_base, v_base, page, t0, hi, pos,
                              m_i, l_i, acc, scale_log2, kvp_rank, kvp, interleave,
                              stride_k1p, stride_k1t, stride_k2p, stride_k2t,
                              stride_vp, stride_vt, D1, D2, DV, BLOCK_N, BLOCK_D1, BLOCK_D2,
                              BLOCK_DV, PAGE_SIZE, SHARDED, V_IS_K1, True, DOT_PRECISION)
        page = page_next

    has = l_i > 0                                  # rows that saw a key (pad rows: whatever)
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    cv = tl.arange(0, BLOCK_DV)
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os
             + cv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & (cv < DV)[None, :])
    tl.store(lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=valid)


def prefill_config(group: int, d1: int, d2: int, dv: int, dtype: torch.dtype,
                   config: dict | None = None) -> dict:
    """Tiles and warps. M = BLOCK_Q * BLOCK_H rows per program, BLOCK_H = the group (a power of
    two, at most M). 16-bit, head dims <= 128 + 64 (GQA, decompressed MLA): M = 128, 64-key
    tiles, 8 warps, 3 stages (the flash-attention shape for Hopper's wgmma). Latent width 512
    (absorbed MLA): M = 64 (the [64, 512] fp32 accumulator over 8 warps: 128 registers a
    thread), 32-key tiles, 2 stages; over an fp8 cache (`dtype` is the cache's; its tiles
    converted in registers) M = 32, which spills nothing on sm_90 where M = 64 spills 832 B
    (compiled with triton 3.6, not yet timed). fp32 (FMA units): small tiles. `config`
    overrides any of TUNABLES."""
    wide = max(d1 + d2, dv) > 256
    if dtype == torch.float32:
        rows, block_n, warps, stages = 32, 16, 4, 2
    elif wide:
        rows, block_n, warps, stages = 32 if dtype == torch.float8_e4m3fn else 64, 32, 8, 2
    else:
        rows, block_n, warps, stages = 128, 64, 8, 3
    block_h = min(pow2(group), rows)
    cfg = dict(BLOCK_Q=max(1, rows // block_h), BLOCK_H=block_h, BLOCK_N=block_n,
               num_warps=warps, num_stages=stages)
    unknown = set(config or {}) - set(TUNABLES)
    if unknown:
        raise ValueError(f"unknown prefill tunables {sorted(unknown)}: use {TUNABLES}")
    cfg.update({k: v for k, v in (config or {}).items() if k != "num_splits"})
    return cfg


def _outputs(T: int, heads: int, dv: int, dtype, device, out):
    if out is not None:
        o, lse = out
        assert o.shape == (T, heads, dv) and lse.shape == (T, heads) and o.stride(-1) == 1
        return o, lse
    return (torch.empty((T, heads, dv), dtype=dtype, device=device),
            torch.empty((T, heads), dtype=torch.float32, device=device))


def _launch(q1, q2, k1, k2, v, meta: LocalKVMeta, scale: float, group: int, d1: int, d2: int,
            dv: int, v_is_k1: bool, o, lse, config: dict | None) -> None:
    """q1 [T, Hq, D1], q2 [T, Hq, D2] (ignored when D2 == 0); k1, k2, v [P, page, Hkv, ...]
    (last dim contiguous); o [T, Hq, DV], lse [T, Hq] written for every query row."""
    T, hq = q1.shape[:2]
    hkv, page_size = k1.shape[2], k1.shape[1]
    S = meta.kv_lens.shape[0]
    if T == 0 or S == 0:
        return
    cfg = prefill_config(group, d1, d2, dv, k1.dtype, config)
    head_blocks = triton.cdiv(group, cfg["BLOCK_H"])
    q_blocks = triton.cdiv(meta.max_q, cfg["BLOCK_Q"])
    bt = meta.block_tables
    splits = num_splits(q_blocks * S, hkv * head_blocks, bt.shape[1] * page_size, q1.device,
                        config) if lse.stride(0) == hq and lse.stride(1) == 1 else 1
    o_ws, lse_ws, (sot, soh, sos), (slt, slh) = split_workspace(o, lse, splits)
    run_kernel(
        _prefill_kernel, (q_blocks, hkv * head_blocks, S * splits),
        q1, q2, k1, k2, v, bt, meta.kv_lens, meta.cu_q, meta.q_pos, o_ws, lse_ws,
        scale * LOG2E, meta.kvp_rank, meta.kvp, meta.interleave,
        q1.stride(0), q1.stride(1), q2.stride(0), q2.stride(1),
        k1.stride(0), k1.stride(1), k1.stride(2), k2.stride(0), k2.stride(1), k2.stride(2),
        v.stride(0), v.stride(1), v.stride(2), bt.stride(0), sot, soh, slt, sos, slh,
        GROUP=group, HEAD_BLOCKS=head_blocks, D1=d1, D2=d2, DV=dv,
        BLOCK_D1=max(16, pow2(d1)), BLOCK_D2=max(16, pow2(d2)), BLOCK_DV=max(16, pow2(dv)),
        PAGE_SIZE=page_size, SHARDED=meta.kvp > 1, V_IS_K1=v_is_k1,
        DOT_PRECISION="ieee" if q1.dtype == torch.float32 else "tf32",   # q's dtype
        NUM_SPLITS=splits, **cfg)
    if splits > 1:
        reduce_splits(o_ws, lse_ws, o, lse)


def num_splits(programs: int, heads: int, keys: int, device: torch.device,
               config: dict | None = None) -> int:
    """KV splits per (query block, head block, sequence): 1 for a prompt of many query blocks
    (its programs fill the GPU), more for a few query rows over many keys (a short chunk, or
    speculative decoding's guesses, on a long cached context: without splits a handful of
    programs would stream the whole KV). choose_num_splits' rule over the launch's static
    sizes: `programs` x `heads` programs, `keys` the most keys a sequence can hold. config
    "num_splits" forces it."""
    if config and "num_splits" in config:
        return config["num_splits"]
    return choose_num_splits(programs, heads, keys, sm_count_of(device), min_tokens=MIN_SPLIT)


def _split_dim(d: int) -> tuple[int, int]:
    """(D1, D2): D1 the largest power of two <= d, D2 = d - D1 (pads no column for 192, 80...)."""
    d1 = 1 << (d.bit_length() - 1)
    return d1, d - d1


def gqa_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: LocalKVMeta, scale: float, config: dict | None = None,
                out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d]; k_cache [P, page, Hkv, d], v_cache [P, page, Hkv, dv]; meta: the prefill
    rows (cu_q, q_pos, kv_lens, block_tables, KVP geometry, max_q) -> o [T, Hq, dv] in q.dtype,
    lse [T, Hq] fp32 (natural log; -inf, o = 0 where a query sees no local key). Query head h
    reads KV head h // (Hq / Hkv). out: (o, lse) buffers to write instead."""
    T, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    assert hq % hkv == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    o, lse = _outputs(T, hq, dv, q.dtype, q.device, out)
    d1, d2 = _split_dim(d)
    _launch(q[..., :d1], q[..., d1:] if d2 else q, k_cache[..., :d1],
            k_cache[..., d1:] if d2 else k_cache, v_cache, meta, scale, hq // hkv, d1, d2, dv,
            False, o, lse, config)
    return o, lse


def mla_prefill(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                kv_lora_rank: int, meta: LocalKVMeta, scale: float, config: dict | None = None,
                out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA: q_latent [T, H, Dl], q_rope [T, H, Dr], kv_cache [P, page, Dl + Dr]
    (latent row, then the rope key) -> o [T, H, Dl] in latent space (q_latent.dtype),
    lse [T, H] fp32. All H heads read the one latent KV head."""
    T, H, dl = q_latent.shape
    dr = q_rope.shape[-1]
    assert kv_cache.shape[-1] == kv_lora_rank + dr == dl + dr and kv_cache.stride(-1) == 1
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    o, lse = _outputs(T, H, dl, q_latent.dtype, q_latent.device, out)
    kv = kv_cache.unsqueeze(2)                          # [P, page, 1, Dl + Dr]: one KV head
    _launch(q_latent, q_rope, kv[..., :dl], kv[..., dl:], kv[..., :dl], meta, scale, H, dl, dr,
            dl, True, o, lse, config)
    return o, lse
