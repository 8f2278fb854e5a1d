"""Device code of the warp-specialised absorbed-MLA decode kernel for Hopper (sm_90), in Gluon.

Written against triton 3.6's Gluon (the GPU machine's); it also compiles under 3.9, where
`tma.async_copy_global_to_shared` was renamed `tma.async_load` (the old name raises: see
_tma_load) and `warp_specialize`'s register list became optional. The host side (planning,
descriptors, the launch, `gluon_available`) is gluon_mla.py, which documents the design.

One program (CTA) = (head block of BLOCK_H = 64 query heads, KV split, sequence). Partitions:
- producer (SEESAW: the 4-warp default partition at 24 registers, its TMA issue spread over
  the warps; SIMPLE: a 1-warp worker): TMA loads of the KV tiles (latent [BLOCK_N, 512] and rope
  [BLOCK_N, 64]) into a STAGES-deep shared-memory ring; kv_ready[s] (TMA bytes) / kv_empty[s]
  (count 2 for SEESAW: both consumers release a tile).
- SEESAW (two consumer warpgroups, each a worker partition; the producer is the default one):
  WG w owns O[:, 256 w : 256 (w + 1)]. Tile j's QK^T and softmax belong to WG j % 2, which
  publishes P_j (bf16) and the running max m_j through shared memory (p_ready; one slot: the
  reader of P_j is the writer of P_{j+1}, and writes it only after its wgmma on P_j retired).
  Both WGs add P_j V_j to their half of O: the owner with P from registers, the other from
  shared memory. Each WG keeps O's reference max (m_ref) and rescales by exp2(m_ref - m_j) at
  every tile; it sums the denominator of its own tiles only, and the two sums meet at the end
  (l_smem). Order per tile: owner: wait K_j, QK^T (its wait retires the previous PV: release
  tile j - 1), softmax, publish, rescale, PV (async); other: retire its previous PV and release
  tile j - 1 FIRST (with 2 stages the load of tile j + 1 waits for that release), then wait for
  P_j, rescale, PV (async). So one WG's PV runs while the other does QK^T, and the next tile's
  TMA overlaps the softmax. A stricter seesaw (the next QK^T issued during the softmax) needs a
  third KV stage, which does not fit next to Q in 227 KB.
- SIMPLE (fallback): one 8-warp consumer partition, the layout Triton would pick (QK^T split by
  tokens over the two warpgroups, O split by columns), fed by the same producer.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

# triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 renamed it async_load and made
# the old name raise
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

D_LATENT = gl.constexpr(512)
D_ROPE = gl.constexpr(64)
CHUNK = gl.constexpr(64)         # the K step of QK^T over the latent: one 128-byte swizzle atom


@gluon.jit
def _split_tiles(lens_ptr, b, split, num_splits, BLOCK_N: gl.constexpr):
    """(start, end, n_tiles) of this program's split: the same BLOCK_N-aligned chunks as
    triton_splits.split_range, so one split's tiles never straddle a page of >= BLOCK_N."""
    kv_len = gl.load(lens_ptr + b)
    chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, kv_len)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    return start, end, n_tiles


@gluon.jit
def _load_q(ql_ptr, qr_ptr, q_lat, q_rope, b, hb, HEADS, stride_qlb, stride_qlh, stride_qrb,
            stride_qrh, BLOCK_H: gl.constexpr, num_warps: gl.constexpr):
    """Q [BLOCK_H, 512 + 64] -> shared memory, 64 columns at a time; heads >= HEADS read 0."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
    heads = hb * BLOCK_H + rows
    mask = gl.expand_dims(heads < HEADS, 1)
    heads64 = gl.expand_dims(heads.to(gl.int64), 1)
    base_l = ql_ptr + b * stride_qlb + heads64 * stride_qlh + gl.expand_dims(cols, 0)
    for c in gl.static_range(D_LATENT // CHUNK):
        x = gl.load(base_l + c * CHUNK, mask=mask, other=0.0)
        q_lat.slice(c * CHUNK, CHUNK, dim=1).store(x.to(q_lat.dtype))
    x = gl.load(qr_ptr + b * stride_qrb + heads64 * stride_qrh + gl.expand_dims(cols, 0),
                mask=mask, other=0.0)
    q_rope.store(x.to(q_rope.dtype))


@gluon.jit
def _producer(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BOX_ROWS: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: the KV tiles of this split through TMA, STAGES deep."""
    (kv_lat, kv_rope, q_lat, q_rope, p_smem, m_smem, l_smem, kv_ready, kv_empty, p_ready, l_bar,
     desc_lat, desc_rope, bt_ptr, o_ptr, lse_ptr, b, hb, split, start, end, n_tiles, HEADS,
     scale_log2, stride_btb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh) = args
    bt_row = bt_ptr + b * stride_btb
    tile_bytes: gl.constexpr = BLOCK_N * (D_LATENT + D_ROPE) * 2
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)   # fresh barrier: passes
        ready = kv_ready.index(s)
        mbarrier.expect(ready, tile_bytes)
        t0 = start + j * BLOCK_N
        for sub in gl.static_range(BLOCK_N // BOX_ROWS):
            t = t0 + sub * BOX_ROWS
            # a box past the end (pages < BLOCK_N only) reads page 0: its rows are masked (S)
            # and zeroed (V) by the consumers, and the byte count stays the tile's
            page = gl.load(bt_row + t // PAGE_SIZE, mask=t < end, other=0)
            row = page * PAGE_SIZE + t % PAGE_SIZE                   # < 2^31 (host checks)
            _tma_load(desc_lat, [row, 0], ready,
                                            kv_lat.index(s).slice(sub * BOX_ROWS, BOX_ROWS, 0))
            _tma_load(desc_rope, [row, 0], ready,
                                            kv_rope.index(s).slice(sub * BOX_ROWS, BOX_ROWS, 0))


@gluon.jit
def _qk(q_lat, q_rope, k_lat, k_rope, s_layout: gl.constexpr, BLOCK_H: gl.constexpr,
        BLOCK_N: gl.constexpr):
    """Issue S [BLOCK_H, BLOCK_N] = Q_lat K_lat^T + Q_rope K_rope^T as 9 async wgmma groups
    of K = 64 (one swizzle atom each); returns the in-flight accumulator."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_rope, k_rope.permute((1, 0)), s, use_acc=False, is_async=True)
    for c in gl.static_range(D_LATENT // CHUNK):
        s = warpgroup_mma(q_lat.slice(c * CHUNK, CHUNK, dim=1),
                          k_lat.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _zero_stale_rows(k_lat, valid, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Rows >= valid of a partial tile's latent: stale slots (maybe non-finite), and P = 0 there
    does not stop NaN * 0 in the PV product, so they are zeroed in shared memory."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims(rows < valid, 1)
    for c in gl.static_range(D_LATENT // CHUNK):
        part = k_lat.slice(c * CHUNK, CHUNK, dim=1)
        x = part.load(layout)
        part.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()          # generic-proxy stores -> the async proxy (wgmma) reads


@gluon.jit
def _mask_cols(sc, valid, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """S with the tokens >= valid of a partial tile at -inf (their K rows are stale)."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.where(gl.expand_dims(cols < valid, 0), sc, float("-inf"))


@gluon.jit
def _finish(o, m_ref, l_own, l_smem, l_bar, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob,
            stride_oh, stride_os, stride_lb, stride_lh, COL0: gl.constexpr, WG: gl.constexpr,
            NUM_WG: gl.constexpr, BLOCK_H: gl.constexpr, o_layout: gl.constexpr):
    """Add the consumers' denominators (l_smem, l_bar with NUM_WG arrivals), then store this
    warpgroup's columns of O / l and (WG 0) the LSE; empty rows give O = 0, LSE = -inf."""
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    if NUM_WG > 1:
        l_smem.slice(WG * BLOCK_H, BLOCK_H).store(l_own)
        mbarrier.arrive(l_bar, count=1)
        mbarrier.wait(l_bar, 0)
        l_tot = (l_smem.slice(0, BLOCK_H).load(row_l)
                 + l_smem.slice(BLOCK_H, BLOCK_H).load(row_l))
    else:
        l_tot = l_own
    has = l_tot > 0
    inv = 1.0 / gl.where(has, l_tot, 1.0)
    out = o * gl.expand_dims(inv, 1)
    half: gl.constexpr = o.shape[1]
    rows = gl.arange(0, BLOCK_H, layout=row_l)
    cols = gl.arange(0, half, layout=gl.SliceLayout(0, o_layout))
    heads = hb * BLOCK_H + rows
    hmask = heads < HEADS
    o_off = (b * stride_ob + gl.expand_dims(heads.to(gl.int64), 1) * stride_oh + split * stride_os
             + COL0 + gl.expand_dims(cols, 0))
    gl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(hmask, 1))
    if WG == 0:
        lse = gl.where(has, (m_ref + gl.log2(gl.where(has, l_tot, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        gl.store(lse_ptr + b * stride_lb + heads.to(gl.int64) * stride_lh + split, lse,
                 mask=hmask)


@gluon.jit
def _seesaw_consumer(args, WG: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                     PAGE_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup of the seesaw schedule (module doc). Per tile j (owner j % 2):
    owner: wait K_j, S_j = QK^T (this wait also retires its PV_{j-1}: release tile j - 1),
           m_j = max(m_{j-1}, rowmax S_j), P_j = exp2(S_j - m_j), publish (P_j, m_j), rescale
           its O half and l by exp2(m_{j-1} - m_j), O += P_j V_j (P from registers, async);
    other: wait (P_j, m_j), retire its own PV_{j-1} (release tile j - 1), rescale,
           O += P_j V_j (P from shared memory, async)."""
    (kv_lat, kv_rope, q_lat, q_rope, p_smem, m_smem, l_smem, kv_ready, kv_empty, p_ready, l_bar,
     desc_lat, desc_rope, bt_ptr, o_ptr, lse_ptr, b, hb, split, start, end, n_tiles, HEADS,
     scale_log2, stride_btb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh) = args
    HALF: gl.constexpr = D_LATENT // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # O is carried through the loop as an in-flight wgmma accumulator (each branch ends by
    # issuing its PV), so both branches yield the same type
    o = warpgroup_mma_init(gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout))
    l_own = gl.zeros([BLOCK_H], gl.float32, layout=row_o)     # this WG's tiles, ref m_ref
    m_ref = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_o)   # O's reference max
    for j in range(n_tiles):
        s = j % STAGES
        k_lat = kv_lat.index(s)
        v_half = k_lat.slice(WG * HALF, HALF, dim=1)              # [BLOCK_N, 256]
        if j % 2 == WG:
            mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
            sc = _qk(q_lat, q_rope, k_lat, kv_rope.index(s), s_layout, BLOCK_H, BLOCK_N)
            sc, o = warpgroup_mma_wait(0, deps=(sc, o))            # also retires PV_{j-1}
            if j > 0:
                mbarrier.arrive(kv_empty.index((j - 1) % STAGES), count=1)
            valid = end - (start + j * BLOCK_N)
            sc = sc * scale_log2
            if valid < BLOCK_N:                                     # the split's last tile
                _zero_stale_rows(k_lat, valid, BLOCK_N, 4)
                sc = _mask_cols(sc, valid, s_layout, BLOCK_N)
            m_prev = gl.convert_layout(m_ref, row_s)               # = m_{j-1}
            m_new = gl.maximum(m_prev, gl.max(sc, axis=1))
            p = gl.exp2(sc - gl.expand_dims(m_new, 1))
            l_tile = gl.sum(p, axis=1)
            p16 = p.to(p_smem.dtype)
            p_smem.store(p16)
            m_smem.store(m_new)
            fence_async_shared()                                    # P -> the other's wgmma
            mbarrier.arrive(p_ready, count=1)
            m_new_o = gl.convert_layout(m_new, row_o)
            alpha = gl.exp2(m_ref - m_new_o)
            o = o * gl.expand_dims(alpha, 1)
            l_own = l_own * alpha + gl.convert_layout(l_tile, row_o)
            m_ref = m_new_o
            o = warpgroup_mma(gl.convert_layout(p16, p_layout), v_half, o, is_async=True)
        else:
            # retire PV_{j-1} (own tile) and release its stage BEFORE waiting for P_j: with 2
            # stages the load of tile j + 1 waits for that release, and the other warpgroup's
            # QK^T_j + softmax_j then hide it
            o = warpgroup_mma_wait(0, deps=(o,))
            if j > 0:
                mbarrier.arrive(kv_empty.index((j - 1) % STAGES), count=1)
            mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)   # (V_j: the TMA bytes landed)
            mbarrier.wait(p_ready, j & 1)
            m_new_o = m_smem.load(row_o)
            alpha = gl.exp2(m_ref - m_new_o)
            o = o * gl.expand_dims(alpha, 1)
            l_own = l_own * alpha
            m_ref = m_new_o
            o = warpgroup_mma(p_smem, v_half, o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    _finish(o, m_ref, l_own, l_smem, l_bar, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob,
            stride_oh, stride_os, stride_lb, stride_lh, WG * HALF, WG, 2, BLOCK_H, o_layout)


@gluon.jit
def _seesaw_wg0(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BOX_ROWS: gl.constexpr, STAGES: gl.constexpr):
    _seesaw_consumer(args, 0, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS, STAGES)


@gluon.jit
def _seesaw_wg1(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BOX_ROWS: gl.constexpr, STAGES: gl.constexpr):
    _seesaw_consumer(args, 1, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS, STAGES)


@gluon.jit
def _simple_consumer(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BOX_ROWS: gl.constexpr, STAGES: gl.constexpr):
    """SIMPLE: 8 warps in one partition; S [64, BLOCK_N] with warps [4, 2] (each warpgroup
    half of the tokens), O [64, 512] with warps [4, 2] (each warpgroup 256 columns); the
    compiler moves P and the row maxima between the warpgroups."""
    (kv_lat, kv_rope, q_lat, q_rope, p_smem, m_smem, l_smem, kv_ready, kv_empty, p_ready, l_bar,
     desc_lat, desc_rope, bt_ptr, o_ptr, lse_ptr, b, hb, split, start, end, n_tiles, HEADS,
     scale_log2, stride_btb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh) = args
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D_LATENT // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    o = warpgroup_mma_init(gl.zeros([BLOCK_H, D_LATENT], gl.float32, layout=o_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_o)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_o)
    for j in range(n_tiles):
        s = j % STAGES
        k_lat = kv_lat.index(s)
        mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
        sc = _qk(q_lat, q_rope, k_lat, kv_rope.index(s), s_layout, BLOCK_H, BLOCK_N)
        sc, o = warpgroup_mma_wait(0, deps=(sc, o))
        if j > 0:
            mbarrier.arrive(kv_empty.index((j - 1) % STAGES), count=1)
        valid = end - (start + j * BLOCK_N)
        sc = sc * scale_log2
        if valid < BLOCK_N:
            _zero_stale_rows(k_lat, valid, BLOCK_N, 8)
            sc = _mask_cols(sc, valid, s_layout, BLOCK_N)
        m_new = gl.maximum(m_i, gl.convert_layout(gl.max(sc, axis=1), row_o))
        p = gl.exp2(sc - gl.expand_dims(gl.convert_layout(m_new, gl.SliceLayout(1, s_layout)), 1))
        alpha = gl.exp2(m_i - m_new)
        o = o * gl.expand_dims(alpha, 1)
        l_i = l_i * alpha + gl.convert_layout(gl.sum(p, axis=1), row_o)
        m_i = m_new
        o = warpgroup_mma(gl.convert_layout(p.to(k_lat.dtype), p_layout), k_lat, o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    _finish(o, m_i, l_i, l_smem, l_bar, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob,
            stride_oh, stride_os, stride_lb, stride_lh, 0, 0, 1, BLOCK_H, o_layout)


@gluon.jit
def mla_decode_kernel(
    ql_ptr, qr_ptr, desc_lat, desc_rope, bt_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh,      # q_latent [B, H, 512], q_rope [B, H, 64]
    stride_btb,                                          # block_tables [B, W] int32
    stride_ob, stride_oh, stride_os,                     # o [B, H, S, 512] (or [B, H, 512])
    stride_lb, stride_lh,                                # lse [B, H, S] (or [B, H])
    HEADS, num_splits,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BOX_ROWS: gl.constexpr, STAGES: gl.constexpr, SEESAW: gl.constexpr,
    WG_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    hb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    dtype: gl.constexpr = desc_lat.dtype

    q_lat = gl.allocate_shared_memory(dtype, [BLOCK_H, D_LATENT], desc_lat.layout)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], desc_rope.layout)
    kv_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_LATENT], desc_lat.layout)
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], desc_rope.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    if SEESAW:
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
        l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)
    else:       # unused by SIMPLE: the smallest placeholders
        p_smem = gl.allocate_shared_memory(dtype, [8, 64], p_layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [1], flat)
        l_smem = gl.allocate_shared_memory(gl.float32, [2], flat)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    n_consumers: gl.constexpr = 2 if SEESAW else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=n_consumers)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(l_bar, count=n_consumers)

    _load_q(ql_ptr, qr_ptr, q_lat, q_rope, b, hb, HEADS, stride_qlb, stride_qlh, stride_qrb,
            stride_qrh, BLOCK_H, num_warps)
    fence_async_shared()          # Q (generic stores) -> wgmma (async proxy)

    start, end, n_tiles = _split_tiles(lens_ptr, b, split, num_splits, BLOCK_N)
    args = (kv_lat, kv_rope, q_lat, q_rope, p_smem, m_smem, l_smem, kv_ready, kv_empty, p_ready,
            l_bar, desc_lat, desc_rope, bt_ptr, o_ptr, lse_ptr, b, hb, split, start, end, n_tiles,
            HEADS, scale_log2, stride_btb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh)
    if SEESAW:
        # constexprs must sit in the literal tuples: a tuple bound to a name holds tensors
        # the producer is the default partition (num_warps = 4, the registers left over) and
        # the consumers are workers: values a worker uses arrive through shared memory, where
        # the default partition would keep the parent's values live in registers (a consumer
        # there spilled at 240 registers)
        gl.warp_specialize([(_producer, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS, STAGES)),
                            (_seesaw_wg0, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS, STAGES)),
                            (_seesaw_wg1, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS, STAGES))],
                           [4, 4], [WG_REGS, WG_REGS])
    else:
        gl.warp_specialize([(_simple_consumer, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS,
                                                 STAGES)),
                            (_producer, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS, STAGES))],
                           [1], [PRODUCER_REGS])
