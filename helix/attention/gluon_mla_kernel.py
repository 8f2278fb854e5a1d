"""Device code of the warp-specialised absorbed-MLA decode kernel for Hopper (sm_90), in Gluon.

Written against triton 3.6's Gluon (the GPU machine's); it also compiles under 3.9, where
`tma.async_copy_global_to_shared` was renamed `tma.async_load` (the old name raises: see
_tma_load), `thread_barrier` became `barrier` (_sync_threads) and `warp_specialize`'s register
list became optional. The host side (planning,
descriptors, the launch, `gluon_available`) is gluon_mla.py, which documents the design.

One program (CTA) = (head block of BLOCK_H = 64 query heads, KV split, sequence).

SEESAW (default): three partitions, FlashMLA's published schedule for sm_90 re-derived here.
- producer (the 4-warp default partition, 24 registers): TMA loads of the KV tiles into two
  tile buffers K0 / K1 (tile 2i -> K0, 2i + 1 -> K1), each in two parts with their own
  barriers: "lo" = latent columns 0..255, "hi" = latent 256..511 + rope. A part is reloaded as
  soon as its last reader released it (ready_* / empty_*), so the next tile's bytes stream in
  while the current pair is still being multiplied.
- two consumer warpgroups (workers, 240 registers each). WG w owns O[:, 256 w : 256 (w + 1)]
  and computes S = Q K^T for the tiles of its buffer (WG 0: 2i, WG 1: 2i + 1), so both QK^T are
  m64n64 wgmmas (Q in shared memory, its 64 rope columns in registers to leave room for the
  second P buffer). Per pair i (S_0 in WG 0's registers, S_1 in WG 1's):
    WG 0: m_0 = max(m, rowmax S_0), P_0 = exp2(S_0 - m_0) -> publish (P_0, m_0) [bar_a];
          O_L = O_L exp2(m - m_0) + P_0 V_0L (P from registers, async);
          wait (P_1, m_1) [bar_b]; retire -> release K0 lo; O_L = O_L exp2(m_0 - m_1)
          + P_1 V_1L (P from shared memory, async); issue S_0' of tile 2i + 2 (QK^T, async);
          retire the PV -> release K1 lo; retire S_0'.
    WG 1: wait (P_0, m_0) [bar_a]; O_R = O_R exp2(m - m_0) + P_0 V_0R (async); meanwhile
          m_1 = max(m_0, rowmax S_1), P_1 = exp2(S_1 - m_1) -> publish (P_1, m_1) [bar_b];
          retire -> release K0 hi; O_R = O_R exp2(m_0 - m_1) + P_1 V_1R (async); retire ->
          release K1 hi; issue and retire S_1' of tile 2i + 3.
  So each warpgroup's softmax runs under the other's (or its own) wgmmas, both QK^T of a pair
  need no softmax first, and every part of a tile buffer is reloaded while the other buffer is
  being computed. Each warpgroup sums the denominators of its own tiles (same reference max);
  the two sums meet at the end (l_smem). A P buffer is rewritten only after its reader's
  wgmma retired (the reader's release of the tile part it multiplied, waited by the writer).
  A tile past the split's end (odd tile counts) and the stale rows of the last tile are read
  from page 0 / the stale slots, masked to -inf in S and zeroed in V (P = 0 does not stop
  NaN * 0).
- SIMPLE (fallback): one 8-warp consumer partition, the layout Triton would pick (QK^T split by
  tokens over the two warpgroups, O split by columns), fed by a 1-warp producer through a
  2-stage ring of whole tiles.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from helix.gluon_util import gdc as _gdc
from helix.gluon_util import pdl_wait as _pdl_wait
from helix.gluon_util import sync_threads as _sync_threads
from helix.gluon_util import tma_load as _tma_load

D_LATENT = gl.constexpr(512)
D_ROPE = gl.constexpr(64)
HALF = gl.constexpr(256)         # one consumer warpgroup's columns of O (SEESAW)
CHUNK = gl.constexpr(64)         # the K step of QK^T over the latent: one 128-byte swizzle atom


@gluon.jit
def _kv_wait(t0, kv_len, PDL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Before loading the tile at token t0: with PDL, wait for the previous kernel if the tile
    may hold the sequence's last row (kv_len - 1), the only KV row a kernel of this step can
    still be writing (the new token's append); earlier tiles stream under that kernel."""
    if PDL:
        if (PDL & 8) or t0 + BLOCK_N >= kv_len:          # 8: gluon_mla.PDL_KV_LATE
            _gdc("griddepcontrol.wait;")


@gluon.jit
def _split_tiles(lens_ptr, b, split, num_splits, BLOCK_N: gl.constexpr,
                 MIN_CHUNK: gl.constexpr):
    """(start, end, n_tiles, kv_len) of this program's split: triton_splits.split_range's
    BLOCK_N-aligned chunks, of at least MIN_CHUNK tokens (a pair of tiles for the seesaw: a
    sequence far shorter than the block table, whose width sets num_splits, fills the first
    splits in pairs and leaves the rest empty), so one split's tiles never straddle a page of
    >= BLOCK_N."""
    kv_len = gl.load(lens_ptr + b)
    chunk = gl.maximum(gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = split * chunk
    end = gl.minimum(start + chunk, kv_len)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    return start, end, n_tiles, kv_len


@gluon.jit
def _load_q(ql_ptr, qr_ptr, q_lat, q_rope, b, hb, HEADS, stride_qlb, stride_qlh, stride_qrb,
            stride_qrh, BLOCK_H: gl.constexpr, COL0: gl.constexpr, COLS: gl.constexpr,
            WITH_ROPE: gl.constexpr, num_warps: gl.constexpr):
    """Q's latent columns COL0..COL0 + COLS [BLOCK_H, COLS] (+ the 64 rope columns when
    WITH_ROPE) -> shared memory, 64 columns at a time; heads >= HEADS read 0."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
    heads = hb * BLOCK_H + rows
    mask = gl.expand_dims(heads < HEADS, 1)
    heads64 = gl.expand_dims(heads.to(gl.int64), 1)
    base_l = ql_ptr + b * stride_qlb + heads64 * stride_qlh + gl.expand_dims(cols, 0)
    for c in gl.static_range(COL0 // CHUNK, (COL0 + COLS) // CHUNK):
        x = gl.load(base_l + c * CHUNK, mask=mask, other=0.0)
        q_lat.slice(c * CHUNK, CHUNK, dim=1).store(x.to(q_lat.dtype))
    if WITH_ROPE:
        x = gl.load(qr_ptr + b * stride_qrb + heads64 * stride_qrh + gl.expand_dims(cols, 0),
                    mask=mask, other=0.0)
        q_rope.store(x.to(q_rope.dtype))


@gluon.jit
def _tile_row(bt_row, t, end, PAGE_SIZE: gl.constexpr):
    """Pool row of token t (page 0's slot when t >= end: masked in S, zeroed in V)."""
    page = gl.load(bt_row + t // PAGE_SIZE, mask=t < end, other=0)
    return page * PAGE_SIZE + t % PAGE_SIZE                   # < 2^31 (host checks)


@gluon.jit
def _zero_stale_rows(part, valid, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Rows >= valid of a partial tile's V columns (`part`, [BLOCK_N, 64 k]): stale slots (maybe
    non-finite), and P = 0 does not stop NaN * 0 in the PV product, so they are zeroed in shared
    memory before the wgmma reads them."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims(rows < valid, 1)
    for c in gl.static_range(part.shape[1] // CHUNK):
        piece = part.slice(c * CHUNK, CHUNK, dim=1)
        x = piece.load(layout)
        piece.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()          # generic-proxy stores -> the async proxy (wgmma) reads
    _sync_threads()           # every warp's stores, before the warpgroup issues the wgmma


@gluon.jit
def _mask_cols(sc, valid, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """S with the tokens >= valid of a partial tile at -inf (their K rows are stale)."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.where(gl.expand_dims(cols < valid, 0), sc, float("-inf"))


@gluon.jit
def _finish(o, m_ref, l_own, l_smem, l_bar, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob,
            stride_oh, stride_os, stride_lb, stride_lh, COL0: gl.constexpr, WG: gl.constexpr,
            NUM_WG: gl.constexpr, BLOCK_H: gl.constexpr, o_layout: gl.constexpr,
            L_PHASE: gl.constexpr = 0):
    """Add the consumers' denominators (l_smem; l_bar with NUM_WG arrivals, phase L_PHASE),
    then store this warpgroup's columns of O / l and (WG 0) the LSE; empty rows give O = 0,
    LSE = -inf."""
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    if NUM_WG > 1:
        l_smem.slice(WG * BLOCK_H, BLOCK_H).store(l_own)
        _sync_threads()
        mbarrier.arrive(l_bar, count=1)
        mbarrier.wait(l_bar, L_PHASE)
        l_tot = (l_smem.slice(0, BLOCK_H).load(row_l)
                 + l_smem.slice(BLOCK_H, BLOCK_H).load(row_l))
    else:
        l_tot = l_own
    has = l_tot > 0
    inv = 1.0 / gl.where(has, l_tot, 1.0)
    out = o * gl.expand_dims(inv, 1)
    width: gl.constexpr = o.shape[1]
    rows = gl.arange(0, BLOCK_H, layout=row_l)
    cols = gl.arange(0, width, layout=gl.SliceLayout(0, o_layout))
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


# ----------------------------------------------------------------------------------- SEESAW


@gluon.jit
def _load_part(desc_lat, desc_rope, k_lat, k_rope, ready, empty, phase, row, t0, end, bt_row,
               COL0: gl.constexpr, WITH_ROPE: gl.constexpr, BLOCK_N: gl.constexpr,
               PAGE_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr):
    """One part of a tile (latent columns COL0..COL0 + 255, plus the rope columns when
    WITH_ROPE) into its buffer, once its last reader released it. `row` is the tile's pool row
    when one box covers the tile (looked up before the wait); smaller pages look up per box."""
    nbytes: gl.constexpr = BLOCK_N * (HALF + (D_ROPE if WITH_ROPE else 0)) * 2
    mbarrier.wait(empty, phase)
    mbarrier.expect(ready, nbytes)
    for sub in gl.static_range(BLOCK_N // BOX_ROWS):
        if BOX_ROWS == BLOCK_N:
            r = row
        else:
            r = _tile_row(bt_row, t0 + sub * BOX_ROWS, end, PAGE_SIZE)
        _tma_load(desc_lat, [r, COL0], ready,
                  k_lat.slice(sub * BOX_ROWS, BOX_ROWS, 0).slice(COL0, HALF, 1))
        if WITH_ROPE:
            _tma_load(desc_rope, [r, 0], ready, k_rope.slice(sub * BOX_ROWS, BOX_ROWS, 0))


@gluon.jit
def _seesaw_producer(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                     PAGE_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr, PDL: gl.constexpr):
    """Per pair i: K0 lo, K0 hi (tile 2i), K1 hi, K1 lo (tile 2i + 1): the order the consumers
    release them in. With PDL the tiles before the sequence's last row are loaded without
    waiting for the previous kernel (_kv_wait)."""
    (kv_lat, kv_rope, q_lat, p_smem, m_smem, l_smem, ready, empty, bar_ab, l_bar, desc_lat,
     desc_rope, ql_ptr, qr_ptr, stride_qlb, stride_qlh, stride_qrb, stride_qrh, bt_ptr, o_ptr,
     lse_ptr, b, hb, split, start, end, n_tiles, kv_len, HEADS, scale_log2, stride_btb, stride_ob,
     stride_oh, stride_os, stride_lb, stride_lh) = args
    bt_row = bt_ptr + b * stride_btb
    for i in range(gl.cdiv(n_tiles, 2)):
        phase = (i & 1) ^ 1                                    # fresh barriers pass
        t0 = start + 2 * i * BLOCK_N
        t1 = t0 + BLOCK_N
        row0 = _tile_row(bt_row, t0, end, PAGE_SIZE)
        row1 = _tile_row(bt_row, t1, end, PAGE_SIZE)
        _kv_wait(t1, kv_len, PDL, BLOCK_N)          # (t1's tile covers t0's: one test a pair)
        k0 = kv_lat.index(0)
        k1 = kv_lat.index(1)
        _load_part(desc_lat, desc_rope, k0, kv_rope.index(0), ready.index(0), empty.index(0),
                   phase, row0, t0, end, bt_row, 0, False, BLOCK_N, PAGE_SIZE, BOX_ROWS)
        _load_part(desc_lat, desc_rope, k0, kv_rope.index(0), ready.index(1), empty.index(1),
                   phase, row0, t0, end, bt_row, HALF, True, BLOCK_N, PAGE_SIZE, BOX_ROWS)
        _load_part(desc_lat, desc_rope, k1, kv_rope.index(1), ready.index(3), empty.index(3),
                   phase, row1, t1, end, bt_row, HALF, True, BLOCK_N, PAGE_SIZE, BOX_ROWS)
        _load_part(desc_lat, desc_rope, k1, kv_rope.index(1), ready.index(2), empty.index(2),
                   phase, row1, t1, end, bt_row, 0, False, BLOCK_N, PAGE_SIZE, BOX_ROWS)


@gluon.jit
def _qk_part(q_lat, k_lat, s, C0: gl.constexpr, FIRST: gl.constexpr):
    """S += Q[:, C0:C0 + 256] K[:, C0:C0 + 256]^T: 4 async wgmmas of K = 64."""
    for c in gl.static_range(HALF // CHUNK):
        s = warpgroup_mma(q_lat.slice(C0 + c * CHUNK, CHUNK, dim=1),
                          k_lat.slice(C0 + c * CHUNK, CHUNK, dim=1).permute((1, 0)), s,
                          use_acc=(not FIRST) or c > 0, is_async=True)
    return s


@gluon.jit
def _qk_tile(q_lat, q_r, k_lat, k_rope, ready_lo, ready_hi, phase, s_layout: gl.constexpr,
             LO_FIRST: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):
    """Issue S = Q K^T for one tile as 9 async wgmmas (the rope one with Q from registers),
    each part as soon as its bytes landed, LO_FIRST choosing the part that is loaded first."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    if LO_FIRST:
        mbarrier.wait(ready_lo, phase)
        s = _qk_part(q_lat, k_lat, s, 0, True)
        mbarrier.wait(ready_hi, phase)
        s = _qk_part(q_lat, k_lat, s, HALF, False)
        s = warpgroup_mma(q_r, k_rope.permute((1, 0)), s, is_async=True)
    else:
        mbarrier.wait(ready_hi, phase)
        s = warpgroup_mma(q_r, k_rope.permute((1, 0)), s, use_acc=False, is_async=True)
        s = _qk_part(q_lat, k_lat, s, HALF, False)
        mbarrier.wait(ready_lo, phase)
        s = _qk_part(q_lat, k_lat, s, 0, False)
    return s


@gluon.jit
def _softmax(sc, m_prev, valid, scale_log2, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """(P, rowsum P, m_new): the scores scaled into log2 units, masked past `valid` on the
    split's last tiles, against the running max m_prev (S's row layout)."""
    if valid < BLOCK_N:
        sc = _mask_cols(sc, valid, s_layout, BLOCK_N)
    m_new = gl.maximum(m_prev, gl.max(sc, axis=1) * scale_log2)
    p = gl.exp2(sc * scale_log2 - gl.expand_dims(m_new, 1))
    return p, gl.sum(p, axis=1), m_new


@gluon.jit
def _publish(p_slot, m_slot, p16, m_new, read_bar, read_phase, ready_bar):
    """P and its running max to the other warpgroup: once it has read the previous P from this
    slot (read_bar: its release of the tile part it multiplied), store, fence for its wgmma,
    and signal ready_bar after every thread's stores."""
    mbarrier.wait(read_bar, read_phase)
    p_slot.store(p16)
    m_slot.store(m_new)
    fence_async_shared()
    _sync_threads()
    mbarrier.arrive(ready_bar, count=1)


@gluon.jit
def _rescale(o, l_own, m_old, m_new):
    """O and the denominator from reference max m_old to m_new (O's row layout)."""
    alpha = gl.exp2(m_old - m_new)
    return o * gl.expand_dims(alpha, 1), l_own * alpha


@gluon.jit
def _q_rope_regs(qr_ptr, b, hb, HEADS, stride_qrb, stride_qrh, layout: gl.constexpr,
                 BLOCK_H: gl.constexpr):
    """Q's 64 rope columns [BLOCK_H, 64] straight into wgmma A-operand registers."""
    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, layout))
    heads = hb * BLOCK_H + rows
    ptrs = (qr_ptr + b * stride_qrb + gl.expand_dims(heads.to(gl.int64), 1) * stride_qrh
            + gl.expand_dims(cols, 0))
    return gl.load(ptrs, mask=gl.expand_dims(heads < HEADS, 1), other=0.0)


@gluon.jit
def _seesaw_consumer(args, WG: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                     PDL: gl.constexpr):
    """One consumer warpgroup of the seesaw schedule (module doc). Barriers: ready / empty
    [lo K0, hi K0, lo K1, hi K1]; bar_ab [a: (P_0, m_0) published, b: (P_1, m_1) published];
    each completes once per pair, so its wait parity is the pair's."""
    (kv_lat, kv_rope, q_lat, p_smem, m_smem, l_smem, ready, empty, bar_ab, l_bar, desc_lat,
     desc_rope, ql_ptr, qr_ptr, stride_qlb, stride_qlh, stride_qrb, stride_qrh, bt_ptr, o_ptr,
     lse_ptr, b, hb, split, start, end, n_tiles, kv_len, HEADS, scale_log2, stride_btb, stride_ob,
     stride_oh, stride_os, stride_lb, stride_lh) = args
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = kv_lat.dtype
    k0 = kv_lat.index(0)
    k1 = kv_lat.index(1)
    mine = kv_lat.index(WG)
    my_rope = kv_rope.index(WG)
    my_lo = ready.index(2 * WG)
    my_hi = ready.index(2 * WG + 1)
    v0 = k0.slice(WG * HALF, HALF, dim=1)              # [BLOCK_N, 256]: this WG's V columns
    v1 = k1.slice(WG * HALF, HALF, dim=1)
    # Q: each warpgroup stores half of Q's latent columns (the producer's first loads are
    # already in flight), both wait for both halves (l_bar's first phase); the rope columns go
    # straight to registers. Q is the previous kernel's output: wait for it (PDL)
    _pdl_wait(PDL)
    _load_q(ql_ptr, qr_ptr, q_lat.index(0), None, b, hb, HEADS, stride_qlb, stride_qlh,
            stride_qrb, stride_qrh, BLOCK_H, WG * HALF, HALF, False, 4)
    q_r = _q_rope_regs(qr_ptr, b, hb, HEADS, stride_qrb, stride_qrh, qa_layout,
                       BLOCK_H).to(dtype)
    fence_async_shared()          # Q (generic stores) -> wgmma (async proxy)
    _sync_threads()
    mbarrier.arrive(l_bar, count=1)
    mbarrier.wait(l_bar, 0)

    n_pairs = gl.cdiv(n_tiles, 2)
    o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    l_own = gl.zeros([BLOCK_H], gl.float32, layout=row_o)     # this WG's tiles, ref m_ref
    m_ref = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_o)   # O's reference max
    sc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    if n_pairs > 0:
        s = _qk_tile(q_lat.index(0), q_r, mine, my_rope, my_lo, my_hi, 0, s_layout, WG == 0,
                     BLOCK_H, BLOCK_N)
        sc = warpgroup_mma_wait(0, deps=(s,))
    for i in range(n_pairs):
        phase = i & 1
        valid0 = end - (start + 2 * i * BLOCK_N)               # tokens of tile 2i (>= 1)
        valid1 = valid0 - BLOCK_N                              # of tile 2i + 1 (maybe <= 0)
        if WG == 0:
            p, l_tile, m0 = _softmax(sc, gl.convert_layout(m_ref, row_s), valid0, scale_log2,
                                     s_layout, BLOCK_N)
            p16 = p.to(dtype)
            # (empty[1]: WG 1 retired its PV on P_0 of pair i - 1)
            _publish(p_smem.index(0), m_smem.index(0), p16, m0, empty.index(1), phase ^ 1,
                     bar_ab.index(0))
            m0_o = gl.convert_layout(m0, row_o)
            o, l_own = _rescale(o, l_own, m_ref, m0_o)
            l_own = l_own + gl.convert_layout(l_tile, row_o)
            if valid0 < BLOCK_N:
                _zero_stale_rows(v0, valid0, BLOCK_N, 4)
            acc = warpgroup_mma(gl.convert_layout(p16, pa_layout), v0, o, is_async=True)
            mbarrier.wait(bar_ab.index(1), phase)              # (P_1, m_1) published
            m1 = m_smem.index(1).load(row_o)
            o = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(0), count=1)           # K0 lo free
            o, l_own = _rescale(o, l_own, m0_o, m1)
            m_ref = m1
            if valid1 < BLOCK_N:
                _zero_stale_rows(v1, valid1, BLOCK_N, 4)
            acc = warpgroup_mma(p_smem.index(1), v1, o, is_async=True)
            if i + 1 < n_pairs:                                 # S_0' of tile 2i + 2
                # the buffers through a runtime index the compiler cannot prove 0: hoisting
                # the 72 loop-invariant wgmma descriptors out of the loop spills them
                z = i >> 30
                q_cur = q_lat.index(z)
                k_cur = kv_lat.index(z)
                s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
                mbarrier.wait(my_lo, phase ^ 1)
                s = _qk_part(q_cur, k_cur, s, 0, True)
                o = warpgroup_mma_wait(4, deps=(acc,))         # the PV retired, S_0' in flight
                mbarrier.arrive(empty.index(2), count=1)       # K1 lo free
                mbarrier.wait(my_hi, phase ^ 1)
                s = _qk_part(q_cur, k_cur, s, HALF, False)
                s = warpgroup_mma(q_r, kv_rope.index(z).permute((1, 0)), s, is_async=True)
                sc = warpgroup_mma_wait(0, deps=(s,))
            else:
                o = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index(2), count=1)
        else:
            mbarrier.wait(bar_ab.index(0), phase)              # (P_0, m_0) published
            m0_o = m_smem.index(0).load(row_o)
            o, l_own = _rescale(o, l_own, m_ref, m0_o)
            if valid0 < BLOCK_N:
                _zero_stale_rows(v0, valid0, BLOCK_N, 4)
            acc = warpgroup_mma(p_smem.index(0), v0, o, is_async=True)
            p, l_tile, m1 = _softmax(sc, gl.convert_layout(m0_o, row_s), valid1, scale_log2,
                                     s_layout, BLOCK_N)
            p16 = p.to(dtype)
            # (empty[2]: WG 0 retired its PV on P_1 of pair i - 1)
            _publish(p_smem.index(1), m_smem.index(1), p16, m1, empty.index(2), phase ^ 1,
                     bar_ab.index(1))
            o = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(1), count=1)           # K0 hi free
            m1_o = gl.convert_layout(m1, row_o)
            o, l_own = _rescale(o, l_own, m0_o, m1_o)
            l_own = l_own + gl.convert_layout(l_tile, row_o)
            m_ref = m1_o
            if valid1 < BLOCK_N:
                _zero_stale_rows(v1, valid1, BLOCK_N, 4)
            acc = warpgroup_mma(gl.convert_layout(p16, pa_layout), v1, o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(3), count=1)           # K1 hi free
            if i + 1 < n_pairs:
                z = i >> 30                                    # (see WG 0's)
                s = _qk_tile(q_lat.index(z), q_r, kv_lat.index(1 + z), kv_rope.index(1 + z),
                             my_lo, my_hi, phase ^ 1, s_layout, False, BLOCK_H, BLOCK_N)
                sc = warpgroup_mma_wait(0, deps=(s,))
    _finish(o, m_ref, l_own, l_smem, l_bar, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob,
            stride_oh, stride_os, stride_lb, stride_lh, WG * HALF, WG, 2, BLOCK_H, o_layout, 1)


@gluon.jit
def _seesaw_wg0(args, live, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                PAGE_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr, PDL: gl.constexpr):
    if live:
        _seesaw_consumer(args, 0, BLOCK_H, BLOCK_N, PDL)


@gluon.jit
def _seesaw_wg1(args, live, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                PAGE_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr, PDL: gl.constexpr):
    if live:
        _seesaw_consumer(args, 1, BLOCK_H, BLOCK_N, PDL)


# ----------------------------------------------------------------------------------- SIMPLE


@gluon.jit
def _simple_producer(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                     PAGE_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: whole KV tiles of this split through TMA, STAGES deep."""
    (kv_lat, kv_rope, q_lat, q_rope, kv_ready, kv_empty, desc_lat, desc_rope, bt_ptr, o_ptr,
     lse_ptr, b, hb, split, start, end, n_tiles, kv_len, HEADS, scale_log2, stride_btb, stride_ob,
     stride_oh, stride_os, stride_lb, stride_lh) = args
    bt_row = bt_ptr + b * stride_btb
    tile_bytes: gl.constexpr = BLOCK_N * (D_LATENT + D_ROPE) * 2
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)   # fresh barrier: passes
        ready = kv_ready.index(s)
        mbarrier.expect(ready, tile_bytes)
        t0 = start + j * BLOCK_N
        for sub in gl.static_range(BLOCK_N // BOX_ROWS):
            row = _tile_row(bt_row, t0 + sub * BOX_ROWS, end, PAGE_SIZE)
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
def _simple_consumer(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                     PAGE_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr, STAGES: gl.constexpr):
    """SIMPLE: 8 warps in one partition; S [64, BLOCK_N] with warps [4, 2] (each warpgroup
    half of the tokens), O [64, 512] with warps [4, 2] (each warpgroup 256 columns); the
    compiler moves P and the row maxima between the warpgroups."""
    (kv_lat, kv_rope, q_lat, q_rope, kv_ready, kv_empty, desc_lat, desc_rope, bt_ptr, o_ptr,
     lse_ptr, b, hb, split, start, end, n_tiles, kv_len, HEADS, scale_log2, stride_btb, stride_ob,
     stride_oh, stride_os, stride_lb, stride_lh) = args
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
    _finish(o, m_i, l_i, None, None, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob, stride_oh,
            stride_os, stride_lb, stride_lh, 0, 0, 1, BLOCK_H, o_layout)


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
    MIN_CHUNK: gl.constexpr = 0, SKIP_EMPTY: gl.constexpr = False, PDL: gl.constexpr = 0,
    CLUSTER: gl.constexpr = 1,             # launch-side only (triton_util.run_kernel's cluster)
):
    hb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    dtype: gl.constexpr = desc_lat.dtype
    lat_layout: gl.constexpr = desc_lat.layout
    rope_layout: gl.constexpr = desc_rope.layout
    mbar: gl.constexpr = mbarrier.MBarrierLayout()
    start, end, n_tiles, kv_len = _split_tiles(lens_ptr, b, split, num_splits, BLOCK_N,
                                               MIN_CHUNK)

    kv_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_LATENT], lat_layout)
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], rope_layout)
    if SEESAW:
        # Q's rope columns live in the consumers' registers: their 8 KB hold the second P
        p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                      element_bitwidth=16, rank=2)
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_lat = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_LATENT], lat_layout)
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], p_layout)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], flat)
        l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbar)      # K0 lo, K0 hi, K1 lo, hi
        empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbar)
        bar_ab = gl.allocate_shared_memory(gl.int64, [2, 1], mbar)
        l_bar = gl.allocate_shared_memory(gl.int64, [1], mbar)
        for i in gl.static_range(4):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(bar_ab.index(0), count=1)
        mbarrier.init(bar_ab.index(1), count=1)
        mbarrier.init(l_bar, count=2)
        args = (kv_lat, kv_rope, q_lat, p_smem, m_smem, l_smem, ready, empty, bar_ab, l_bar,
                desc_lat, desc_rope, ql_ptr, qr_ptr, stride_qlb, stride_qlh, stride_qrb,
                stride_qrh, bt_ptr, o_ptr, lse_ptr, b, hb, split, start, end, n_tiles, kv_len,
                HEADS, scale_log2, stride_btb, stride_ob, stride_oh, stride_os, stride_lb,
                stride_lh)
        # constexprs must sit in the literal tuples: a tuple bound to a name holds tensors.
        # The producer is the default partition (num_warps = 4, the registers left over) and
        # the consumers are workers: values a worker uses arrive through shared memory, where
        # the default partition would keep the parent's values live in registers
        # SKIP_EMPTY: a program of an empty split writes nothing (reduce_splits skips the
        # split; the host sets it only with more than one split): it leaves its SM at once
        if SKIP_EMPTY:
            live = n_tiles > 0
        else:
            live = n_tiles >= 0
        gl.warp_specialize([(_seesaw_producer, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS,
                                                 PDL)),
                            (_seesaw_wg0, (args, live, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS,
                                           PDL)),
                            (_seesaw_wg1, (args, live, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS,
                                           PDL))],
                           [4, 4], [WG_REGS, WG_REGS])
    else:
        q_lat = gl.allocate_shared_memory(dtype, [BLOCK_H, D_LATENT], lat_layout)
        q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], rope_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=1)
        _pdl_wait(PDL)                        # (simple: Q and every tile after the wait)
        _load_q(ql_ptr, qr_ptr, q_lat, q_rope, b, hb, HEADS, stride_qlb, stride_qlh, stride_qrb,
                stride_qrh, BLOCK_H, 0, D_LATENT, True, num_warps)
        fence_async_shared()
        args = (kv_lat, kv_rope, q_lat, q_rope, kv_ready, kv_empty, desc_lat, desc_rope, bt_ptr,
                o_ptr, lse_ptr, b, hb, split, start, end, n_tiles, kv_len, HEADS, scale_log2,
                stride_btb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh)
        gl.warp_specialize([(_simple_consumer, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS,
                                                 STAGES)),
                            (_simple_producer, (args, BLOCK_H, BLOCK_N, PAGE_SIZE, BOX_ROWS,
                                                STAGES))],
                           [1], [PRODUCER_REGS])
