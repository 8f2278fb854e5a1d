"""Device code of the one-row MoE launch for Hopper (sm_90), in Gluon: the routed experts' and
the shared experts' gate/up AND down of one token in ONE persistent launch. The host side
(the work plan, descriptors, availability, the launch) is gluon_moe.py, which says why.

One program (CTA) per SM walks its list of work items (gluon_moe.plan: every gate/up item of
the launch comes before every down item, in every list). Items:
- gate/up (kind 0) of slot s (a routed pair j < TOPK, or the shared experts, slot TOPK): BN
  features of the expert's gate and up rows over all of D -> h[s, n0 : n0 + BN] =
  silu(x Wg^T) * (x Wu^T), stored in x's dtype; then the slot's counter is bumped (release).
- down (kind 1) of slot s: 2 x BN output features over one K chunk of the slot's width ->
  y[chunk] = w_s * h[s, chunk] Wd[n, chunk]^T (fp32); the item waits (acquire) until every
  gate/up item of its slot has bumped the counter. The last item of a feature block to arrive
  (an arrival counter) sums y over the chunks in a fixed order into out.

Two partitions:
- producer (1 warp): TMA loads of the items' weight tiles (two [BN, BK] boxes a stage: gate |
  up rows, or the two halves of the down rows) into a ring of STAGES stages. Weights depend on
  no kernel, so it streams ahead of every dependency: the shared experts' tiles even before the
  wait for the previous kernel (the router, whose ids the routed tiles need), and the down
  tiles while their consumer still waits for its slot's gate/up. This is the point of the
  launch: the weight stream does not stop at the gate/up -> down boundary nor at the launch
  boundary before it, and the bytes in flight (the ring) do not cost registers.
- consumer (4 warps, the default partition): per tile, the two boxes from shared memory times
  the activation chunk (x, or h of the slot) in fp32 FMA, summed per feature at the item's end.

No deadlock: a down item waits only for gate/up items, which come first in every list; a
program holding one runs it without waiting, and every program is resident once the next
kernel may launch (each calls launch_dependents after its wait). Counters live in
helix.triton_util.arrival_counters and are all zero again at the end: feature-block counters
reset by their last arrival, slot counters by the last program to finish.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from helix.gluon_util import grid_wait, pdl_wait, reinterpret, sync_threads, tma_load

ITEM_FIELDS = gl.constexpr(8)    # kind, slot, n0, k0, tiles, chunk, -, - (gluon_moe.FIELDS)


@gluon.jit
def _item(items_ptr, pid, it, L):
    """Fields of a program's item `it` (kind -1 past its list: it may be L, a prefetch)."""
    base = items_ptr + (pid * L + it) * ITEM_FIELDS
    ok = it < L
    return (gl.load(base, mask=ok, other=-1), gl.load(base + 1, mask=ok, other=0),
            gl.load(base + 2, mask=ok, other=0), gl.load(base + 3, mask=ok, other=0),
            gl.load(base + 4, mask=ok, other=0), gl.load(base + 5, mask=ok, other=0))


@gluon.jit
def _pick(vec, idx, i):
    """vec[i] of a small register vector (a masked sum: no memory round trip)."""
    return gl.sum(gl.where(idx == i, vec, 0), axis=0)


@gluon.jit
def _local(ids, tk, slot, first, E, TOPK: gl.constexpr):
    """(whether slot's expert is on this rank, its local index) from the router's ids (a
    register vector over tk); the shared slot (TOPK) is local, index 0."""
    routed = slot < TOPK
    q = _pick(ids, tk, slot) - first
    return (routed & (q >= 0) & (q < E)) | (slot == TOPK), gl.where(routed, q, 0)


@gluon.jit
def _producer(args, TOPK: gl.constexpr, TK: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
    (ring, ready, empty, xs, hs, xs2, hs2, items_ptr, ids_ptr, first, E, I, D, dg, du, dd, dgs, dus, dds,
     x_ptr, h_ptr, stride_h, wts_ptr, y_ptr, stride_y, out_ptr, cnt_ptr, chunk_slot_ptr,
     C, NB, G, L, IS) = args
    pid = gl.program_id(0)
    stage_bytes: gl.constexpr = 2 * BN * BK * 2
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tk = gl.arange(0, TK, layout=vec)
    ids = gl.full([TK], -1, gl.int32, layout=vec)
    j = 0
    for it in range(L):
        kind, slot, n0, k0, tiles, chunk = _item(items_ptr, pid, it, L)
        if slot < TOPK:               # the router's ids: only after waiting for it
            grid_wait(PDL)
            ids = gl.load(ids_ptr + tk, mask=tk < TOPK, other=-1).to(gl.int32)
        local, e = _local(ids, tk, slot, first, E, TOPK)
        if (kind >= 0) & local:
            for t in range(tiles):
                s = j % STAGES
                mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)   # fresh barrier: passes
                bar = ready.index(s)
                mbarrier.expect(bar, stage_bytes)
                a = ring.index(2 * s)
                b = ring.index(2 * s + 1)
                k = k0 + t * BK
                if kind == 0:
                    if slot < TOPK:
                        tma_load(dg, [e * I + n0, k], bar, a)
                        tma_load(du, [e * I + n0, k], bar, b)
                    else:
                        tma_load(dgs, [n0, k], bar, a)
                        tma_load(dus, [n0, k], bar, b)
                else:
                    if slot < TOPK:
                        tma_load(dd, [e * D + n0, k], bar, a)
                        tma_load(dd, [e * D + n0 + BN, k], bar, b)
                    else:
                        tma_load(dds, [n0, k], bar, a)
                        tma_load(dds, [n0 + BN, k], bar, b)
                j += 1


@gluon.jit
def _stage(smem, ptr, k0, rows, limit, FROM_L2: gl.constexpr, num_warps: gl.constexpr):
    """smem [R, BK] <- ptr[k0 + r * BK + c] for rows r < `rows` and k0 + r * BK + c < limit
    (0 elsewhere), one load of all of them. FROM_L2: another program's stores (.cg)."""
    R: gl.constexpr = smem.shape[0]
    BK: gl.constexpr = smem.shape[1]
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, lay)), 1)
    k = k0 + r * BK + gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, lay)), 0)
    mask = (r < rows) & (k < limit)
    if FROM_L2:
        v = gl.load(ptr + k, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        v = gl.load(ptr + k, mask=mask, other=0.0)
    smem.store(v)


@gluon.jit
def _tiles(ring, ready, empty, vs, j, tiles, tile: gl.constexpr, kcol: gl.constexpr,
           BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """An item's tiles: (the two boxes' row sums against the activation rows vs [t, BK] in
    shared memory, the ring position after them)."""
    acc_a = gl.zeros([BN, BK], gl.float32, layout=tile)
    acc_b = gl.zeros([BN, BK], gl.float32, layout=tile)
    for t in range(tiles):
        s = j % STAGES
        v = gl.expand_dims(vs.index(t).load(kcol).to(gl.float32), 0)  # [1, BK]
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        a = ring.index(2 * s).load(tile).to(gl.float32)
        b = ring.index(2 * s + 1).load(tile).to(gl.float32)
        mbarrier.arrive(empty.index(s), count=1)
        acc_a += a * v
        acc_b += b * v
        j += 1
    return gl.sum(acc_a, axis=1), gl.sum(acc_b, axis=1), j


@gluon.jit
def _consumer(args, TOPK: gl.constexpr, TK: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, XR: gl.constexpr, HR: gl.constexpr, CP: gl.constexpr,
              PDL: gl.constexpr, num_warps: gl.constexpr):
    (ring, ready, empty, xs, hs, xs2, hs2, items_ptr, ids_ptr, first, E, I, D, dg, du, dd, dgs, dus, dds,
     x_ptr, h_ptr, stride_h, wts_ptr, y_ptr, stride_y, out_ptr, cnt_ptr, chunk_slot_ptr,
     C, NB, G, L, IS) = args
    pid = gl.program_id(0)
    # a [BN, BK] tile: 8 contiguous K elements (16 bytes) a thread, 16 threads along a row
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    kcol: gl.constexpr = gl.SliceLayout(0, tile)
    frow: gl.constexpr = gl.SliceLayout(1, tile)
    small: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [num_warps, 1], [1, 0])
    cols = gl.arange(0, BK, layout=kcol)
    rows = gl.arange(0, BN, layout=frow)
    tk = gl.arange(0, TK, layout=gl.SliceLayout(0, small))
    pdl_wait(PDL)                         # x, the ids and weights: the previous kernel's output
    ids = gl.load(ids_ptr + tk, mask=tk < TOPK, other=-1).to(gl.int32)
    wts = gl.load(wts_ptr + tk, mask=tk < TOPK, other=0.0).to(gl.float32)
    # x into shared memory once: [D / BK, BK], one row a tile
    _stage(xs2, x_ptr, 0, D // BK, D, False, num_warps)
    sync_threads()
    j = 0
    nxt = _item(items_ptr, pid, 0, L)
    for it in range(L):
        kind, slot, n0, k0, tiles, chunk = nxt
        nxt = _item(items_ptr, pid, it + 1, L)      # its fields arrive under this item
        local, e = _local(ids, tk, slot, first, E, TOPK)
        if (kind == 0) & local:
            g, u, j = _tiles(ring, ready, empty, xs, j, tiles, tile, kcol, BN, BK, STAGES)
            hv = g / (1.0 + gl.exp(-g)) * u                               # silu(g) * u
            gl.store(h_ptr + slot * stride_h + n0 + rows, hv.to(h_ptr.dtype.element_ty))
            sync_threads()
            gl.atomic_add(cnt_ptr + slot, 1, sem="release", scope="gpu")
        if kind == 1:
            nb = n0 // (2 * BN)
            if local:
                width = gl.where(slot < TOPK, I, IS)
                need = width // BN                        # the slot's gate/up items
                while gl.atomic_add(cnt_ptr + slot, 0, sem="acquire", scope="gpu") < need:
                    pass
                # the chunk of h into shared memory (every reader of the last one has passed
                # the barrier before the last arrival)
                _stage(hs2, h_ptr + slot * stride_h, k0, tiles, width, True, num_warps)
                sync_threads()
                ya, yb, j = _tiles(ring, ready, empty, hs, j, tiles, tile, kcol, BN, BK, STAGES)
                w = gl.where(slot < TOPK, _pick(wts, tk, slot), 1.0)
                y_row = y_ptr + chunk * stride_y + n0 + rows
                gl.store(y_row, ya * w)
                gl.store(y_row + BN, yb * w)
            # every chunk of the feature block counts in (non-local ones too); the last sums
            sync_threads()
            if gl.atomic_add(cnt_ptr + TOPK + 1 + nb, 1, sem="acq_rel", scope="gpu") == C - 1:
                _combine(ids, first, E, y_ptr, stride_y, out_ptr, chunk_slot_ptr, n0, C,
                         TOPK, TK, BN, CP, small)
                gl.store(cnt_ptr + TOPK + 1 + nb, 0)
    # the last program to finish resets the slot counters (every wait on them has passed)
    sync_threads()
    done = cnt_ptr + TOPK + 1 + NB
    if gl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == G - 1:
        for q in range(TOPK + 1):
            gl.store(cnt_ptr + q, 0)
        gl.store(done, 0)


@gluon.jit
def _combine(ids, first, E, y_ptr, stride_y, out_ptr, chunk_slot_ptr, n0, C,
             TOPK: gl.constexpr, TK: gl.constexpr, BN: gl.constexpr, CP: gl.constexpr,
             small: gl.constexpr):
    """out[n0 : n0 + 2 BN] = the sum of y over the chunks of local slots (one tree order)."""
    c = gl.arange(0, CP, layout=gl.SliceLayout(1, small))
    tk = gl.arange(0, TK, layout=gl.SliceLayout(0, small))
    n = n0 + gl.arange(0, 2 * BN, layout=gl.SliceLayout(0, small))
    slot = gl.load(chunk_slot_ptr + c, mask=c < C, other=-1)
    q = gl.sum(gl.where(gl.expand_dims(slot, 1) == gl.expand_dims(tk, 0),
                        gl.expand_dims(ids, 0), 0), axis=1) - first
    local = (slot == TOPK) | ((slot >= 0) & (slot < TOPK) & (q >= 0) & (q < E))
    y = gl.load(y_ptr + gl.expand_dims(c, 1) * stride_y + gl.expand_dims(n, 0),
                mask=gl.expand_dims(local, 1), other=0.0, cache_modifier=".cg")
    gl.store(out_ptr + n, gl.sum(y, axis=0).to(out_ptr.dtype.element_ty))


@gluon.jit
def moe_row_kernel(
    x_ptr, ids_ptr, wts_ptr, first, E, I, D, IS,
    dg, du, dd, dgs, dus, dds,             # TMA descriptors: gate, up [E*I, D], down [E*D, I],
                                           # shared gate, up [Is, D], shared down [D, Is]
    items_ptr, chunk_slot_ptr, C, NB, G, L,   # the plan: items [G, L, 8], each chunk's slot [C]
    h_ptr, stride_h, y_ptr, stride_y, out_ptr, cnt_ptr,
    TOPK: gl.constexpr, TK: gl.constexpr, XR: gl.constexpr, HR: gl.constexpr,
    CP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = 0,
):
    dtype: gl.constexpr = dg.dtype
    ring = gl.allocate_shared_memory(dtype, [2 * STAGES, BN, BK], dg.layout)
    # x, and a down item's chunk of h: a row of BK a tile, stored as [R, BK] and read a row at
    # a time through a view with a one-dimensional layout
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    rows1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    xs2 = gl.allocate_shared_memory(dtype, [XR, BK], plain)
    hs2 = gl.allocate_shared_memory(dtype, [HR, BK], plain)
    xs = reinterpret(xs2, dtype, [XR, BK], rows1)
    hs = reinterpret(hs2, dtype, [HR, BK], rows1)
    mbar: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    args = (ring, ready, empty, xs, hs, xs2, hs2, items_ptr, ids_ptr, first, E, I, D, dg, du, dd, dgs,
            dus, dds, x_ptr, h_ptr, stride_h, wts_ptr, y_ptr, stride_y, out_ptr, cnt_ptr,
            chunk_slot_ptr, C, NB, G, L, IS)
    gl.warp_specialize([(_consumer, (args, TOPK, TK, BN, BK, STAGES, XR, HR, CP, PDL,
                                     num_warps)),
                        (_producer, (args, TOPK, TK, BN, BK, STAGES, PDL))],
                       [1], [PRODUCER_REGS])
