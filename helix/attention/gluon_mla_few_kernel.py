"""Device code of the absorbed-MLA decode for few query heads (DeepSeek-V2-Lite: 16 a rank) on
Hopper, in Gluon: variant "few" of helix.attention.gluon_mla (the host side).

Why another kernel: a wgmma's M is 64, so the seesaw (gluon_mla_kernel.py), whose M is the head
block, pads 16 heads to 64 rows and spends 4 x the tensor work a KV tile needs; at batch 1 that
padded work sits on the step's critical path after Q arrives (a pair of tiles: ~2.4 us of an
SM's tensor rate). Here the products are swapped so the TOKENS and the latent dims fill M:

    S^T [BLOCK_N, BLOCK_H] = K_lat [BLOCK_N, 512] Q_lat^T + K_rope [BLOCK_N, 64] Q_rope^T
    O^T [512, BLOCK_H]    += K_lat^T [512, BLOCK_N] P^T [BLOCK_N, BLOCK_H]   (K_lat doubles as V)

(wgmma m64nBLOCK_Hk16: N = BLOCK_H = 16 or 32 heads, no padding at 16). The online softmax runs
down the token axis per head (column reductions of S^T).

One program (CTA) = (head block, KV split, sequence), two partitions:
- producer (a 1-warp worker, 24 registers): whole KV tiles (latent + rope) through TMA into a
  ring of STAGES buffers (ready / empty mbarriers). With PDL the tiles before the sequence's
  last row are loaded before waiting for the previous kernel (gluon_mla_kernel._kv_wait).
- consumer (the 4-warp default partition, one warpgroup): waits for the previous kernel (Q is
  its output), stores Q in shared memory, then per tile: S^T (9 async wgmmas), the masked
  online softmax, P^T to shared memory, O^T += K_lat^T P^T (the tile's transposed view as the
  A operand), retire, release the buffer. O^T is 64 fp32 registers a thread at 16 heads.
Stale rows of a partial tile are masked to -inf in S^T and zeroed in shared memory before the
PV product (P = 0 does not stop NaN * 0). Outputs, split rule, empty splits (SKIP_EMPTY) and
64-bit offsets are the seesaw's: the same fp32 partials for triton_splits.reduce_splits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from helix.attention.gluon_mla_kernel import (CHUNK, D_LATENT, D_ROPE, _kv_wait, _load_q,
                                              _pdl_wait, _split_tiles, _sync_threads, _tile_row,
                                              _tma_load, _zero_stale_rows)


@gluon.jit
def _few_producer(args, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
                  BOX_ROWS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
    """1 warp: the split's tiles, STAGES deep; the tile that may hold the sequence's last row
    (and those after it) only after the previous kernel finished."""
    (kv_lat, kv_rope, q_lat, q_rope, p_smem, ready, empty, desc_lat, desc_rope, ql_ptr, qr_ptr,
     stride_qlb, stride_qlh, stride_qrb, stride_qrh, bt_ptr, o_ptr, lse_ptr, b, hb, split, start,
     end, n_tiles, kv_len, live, HEADS, scale_log2, stride_btb, stride_ob, stride_oh, stride_os,
     stride_lb, stride_lh) = args
    bt_row = bt_ptr + b * stride_btb
    tile_bytes: gl.constexpr = BLOCK_N * (D_LATENT + D_ROPE) * 2
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)     # fresh barrier: passes
        t0 = start + j * BLOCK_N
        _kv_wait(t0, kv_len, PDL, BLOCK_N)
        bar = ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        for sub in gl.static_range(BLOCK_N // BOX_ROWS):
            row = _tile_row(bt_row, t0 + sub * BOX_ROWS, end, PAGE_SIZE)
            _tma_load(desc_lat, [row, 0], bar, kv_lat.index(s).slice(sub * BOX_ROWS, BOX_ROWS, 0))
            _tma_load(desc_rope, [row, 0], bar,
                      kv_rope.index(s).slice(sub * BOX_ROWS, BOX_ROWS, 0))


@gluon.jit
def _few_consumer(args, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  PDL: gl.constexpr):
    (kv_lat, kv_rope, q_lat, q_rope, p_smem, ready, empty, desc_lat, desc_rope, ql_ptr, qr_ptr,
     stride_qlb, stride_qlh, stride_qrb, stride_qrh, bt_ptr, o_ptr, lse_ptr, b, hb, split, start,
     end, n_tiles, kv_len, live, HEADS, scale_log2, stride_btb, stride_ob, stride_oh, stride_os,
     stride_lb, stride_lh) = args
    if live:
        # one layout for S^T [BLOCK_N, BLOCK_H] and O^T [512, BLOCK_H]: a head's column
        # statistics (max, sum, rescale) need no conversion between the two
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_H, 16])
        col: gl.constexpr = gl.SliceLayout(0, acc_layout)
        row: gl.constexpr = gl.SliceLayout(1, acc_layout)
        _pdl_wait(PDL)                                     # Q is the previous kernel's output
        _load_q(ql_ptr, qr_ptr, q_lat, q_rope, b, hb, HEADS, stride_qlb, stride_qlh, stride_qrb,
                stride_qrh, BLOCK_H, 0, D_LATENT, True, 4)
        fence_async_shared()                           # Q (generic stores) -> wgmma (async proxy)
        _sync_threads()
        o = gl.zeros([D_LATENT, BLOCK_H], gl.float32, layout=acc_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=col)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=col)
        tok = gl.arange(0, BLOCK_N, layout=row)
        for j in range(n_tiles):
            s = j % STAGES
            k_lat = kv_lat.index(s)
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            st = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=acc_layout)
            st = warpgroup_mma(kv_rope.index(s), q_rope.permute((1, 0)), st, use_acc=False,
                               is_async=True)
            for c in gl.static_range(D_LATENT // CHUNK):
                st = warpgroup_mma(k_lat.slice(c * CHUNK, CHUNK, dim=1),
                                   q_lat.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), st,
                                   is_async=True)
            st = warpgroup_mma_wait(0, deps=(st,))
            valid = end - (start + j * BLOCK_N)                  # tokens of this tile (>= 1)
            if valid < BLOCK_N:
                st = gl.where(gl.expand_dims(tok < valid, 1), st, float("-inf"))
                _zero_stale_rows(k_lat, valid, BLOCK_N, 4)
            m_new = gl.maximum(m_i, gl.max(st, axis=0) * scale_log2)
            p = gl.exp2(st * scale_log2 - gl.expand_dims(m_new, 0))
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=0)
            o = o * gl.expand_dims(alpha, 0)
            m_i = m_new
            # P^T [BLOCK_N, BLOCK_H] into P [BLOCK_H, BLOCK_N] (tokens contiguous): read back as
            # a K-major B operand, like a KV tile in the seesaw's QK^T
            p_smem.store(gl.permute(p.to(k_lat.dtype), (1, 0)))
            fence_async_shared()
            _sync_threads()
            o = warpgroup_mma(k_lat.permute((1, 0)), p_smem.permute((1, 0)), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(empty.index(s), count=1)
        _finish_t(o, m_i, l_i, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob, stride_oh,
                  stride_os, stride_lb, stride_lh, BLOCK_H, acc_layout)


@gluon.jit
def _finish_t(o, m_i, l_i, o_ptr, lse_ptr, b, hb, split, HEADS, stride_ob, stride_oh, stride_os,
              stride_lb, stride_lh, BLOCK_H: gl.constexpr, acc_layout: gl.constexpr):
    """O^T / l into o[b, head, split, :] and the LSE (natural log); a head that saw no token
    gets O = 0, LSE = -inf."""
    col: gl.constexpr = gl.SliceLayout(0, acc_layout)
    has = l_i > 0
    out = o * gl.expand_dims(1.0 / gl.where(has, l_i, 1.0), 0)
    dims = gl.arange(0, D_LATENT, layout=gl.SliceLayout(1, acc_layout))
    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=col)
    hmask = heads < HEADS
    off = (b * stride_ob + gl.expand_dims(heads.to(gl.int64), 0) * stride_oh + split * stride_os
           + gl.expand_dims(dims, 1))
    gl.store(o_ptr + off, out.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(hmask, 0))
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    gl.store(lse_ptr + b * stride_lb + heads.to(gl.int64) * stride_lh + split, lse, mask=hmask)


@gluon.jit
def mla_decode_few_kernel(
    ql_ptr, qr_ptr, desc_lat, desc_rope, bt_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh,      # q_latent [B, H, 512], q_rope [B, H, 64]
    stride_btb,                                          # block_tables [B, W] int32
    stride_ob, stride_oh, stride_os,                     # o [B, H, S, 512] (or [B, H, 512])
    stride_lb, stride_lh,                                # lse [B, H, S] (or [B, H])
    HEADS, num_splits,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BOX_ROWS: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr, MIN_CHUNK: gl.constexpr = 0, SKIP_EMPTY: gl.constexpr = False,
    PDL: gl.constexpr = 0, CLUSTER: gl.constexpr = 1,
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
    q_lat = gl.allocate_shared_memory(dtype, [BLOCK_H, D_LATENT], lat_layout)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], rope_layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # SKIP_EMPTY: a program of an empty split writes nothing (reduce_splits skips the split;
    # the host sets it only with more than one split)
    if SKIP_EMPTY:
        live = n_tiles > 0
    else:
        live = n_tiles >= 0
    args = (kv_lat, kv_rope, q_lat, q_rope, p_smem, ready, empty, desc_lat, desc_rope, ql_ptr,
            qr_ptr, stride_qlb, stride_qlh, stride_qrb, stride_qrh, bt_ptr, o_ptr, lse_ptr, b, hb,
            split, start, end, n_tiles, kv_len, live, HEADS, scale_log2, stride_btb, stride_ob,
            stride_oh, stride_os, stride_lb, stride_lh)
    gl.warp_specialize([(_few_consumer, (args, BLOCK_H, BLOCK_N, STAGES, PDL)),
                        (_few_producer, (args, BLOCK_N, PAGE_SIZE, BOX_ROWS, STAGES, PDL))],
                       [1], [PRODUCER_REGS])
