"""Device code of the one-row MoE launch for Hopper (sm_90), in Gluon: the routed experts' and
the shared experts' gate/up AND down of one token in ONE persistent launch. The host side
(the work plan, descriptors, availability, the launch) is gluon_moe.py, which says why.

One program (CTA) per SM walks its list of work items (gluon_moe.plan), its gate/up items
first, then its down items:
- gate/up: BN features [n0, n0 + BN) of one slot (a routed pair j < TOPK, or the shared
  experts, slot TOPK) over all of D: h = w_slot * silu(x Wg^T) * (x Wu^T), fp32, into the
  slot's rows of the h buffer (rows of BK: the shared slot's first, then each routed slot's);
  then the slot's counter is bumped (release).
- down: 2 BN output features [n0, n0 + 2 BN) over EVERY local slot and all of its K:
  out[n0 : n0 + 2 BN] = sum over slots of h_slot Wd_slot[n0 : n0 + 2 BN]^T, stored once: an
  item owns its outputs, so nothing is combined afterwards. Before a slot's first use the
  program waits (acquire) for the slot's gate/up items, then copies the rows of every slot
  that is ready by then into its shared memory (one load); slots come in the gate/up order
  (shared first), so the waits are rare and short.

Two partitions:
- producer (1 warp): TMA loads of the items' weight tiles into a ring of STAGES stages of two
  [BN, BK] boxes (gate | up rows at one K step; or the two halves of the down rows). Weights
  depend on no kernel, so it streams ahead of every dependency: the shared experts' tiles even
  before the wait for the previous kernel (the router, whose ids the routed tiles need), and
  the down tiles while its consumer waits for a slot. The bytes in flight (the ring) cost no
  registers, and the weight stream does not stop between gate/up and down.
- consumer (4 warps, the default partition): per stage, the two boxes from shared memory
  times the activation row (x, or h) in fp32 FMA, summed per feature at the item's end.

No deadlock: a wait is only for gate/up work, which every program does first without waiting;
every program is resident once the next kernel may launch (each calls launch_dependents after
its wait). The slot counters and the finish counter (helix.triton_util.arrival_counters) are
reset by the last program to finish.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from helix.gluon_util import grid_wait, pdl_wait, reinterpret, sync_threads, tma_load

ITEM_FIELDS = gl.constexpr(4)    # kind, slot, n0, - (gluon_moe.FIELDS)


@gluon.jit
def _item(items_ptr, pid, it, L):
    """(slot, n0) of a program's item `it` (zeros past its list: `it` may be L, a prefetch)."""
    base = items_ptr + (pid * L + it) * ITEM_FIELDS
    ok = it < L
    return gl.load(base + 1, mask=ok, other=0), gl.load(base + 2, mask=ok, other=0)


@gluon.jit
def _pick(vec, idx, i):
    """vec[i] of a small register vector (a masked sum: no memory round trip)."""
    return gl.sum(gl.where(idx == i, vec, 0), axis=0)


@gluon.jit
def _slot(q, TOPK: gl.constexpr, SHARED: gl.constexpr):
    """The q-th slot of a down item: the shared experts (TOPK) first where there are any."""
    if SHARED:
        return gl.where(q == 0, TOPK, q - 1)
    return q


@gluon.jit
def _local(ids, tk, slot, first, E, TOPK: gl.constexpr):
    """(whether slot's expert is on this rank, its local index) from the router's ids (a
    register vector over tk); the shared slot (TOPK) is local, index 0."""
    routed = slot < TOPK
    q = _pick(ids, tk, slot) - first
    return (routed & (q >= 0) & (q < E)) | (slot == TOPK), gl.where(routed, q, 0)


@gluon.jit
def _k_steps(slot, I, IS, TOPK: gl.constexpr, BK: gl.constexpr):
    """Stages of a slot's down K (BK a stage): its rows in the h buffer."""
    return gl.cdiv(gl.where(slot < TOPK, I, IS), BK)


@gluon.jit
def _h_row(slot, I, IS, TOPK: gl.constexpr, BK: gl.constexpr):
    """First row (of BK) of a slot in the h buffer: the shared slot at 0, routed j after it."""
    return gl.where(slot < TOPK, gl.cdiv(IS, BK) + slot * gl.cdiv(I, BK), 0)


@gluon.jit
def _up_tiles(ring, ready, empty, dgate, dup, row, j, D, BK: gl.constexpr,
              STAGES: gl.constexpr, stage_bytes: gl.constexpr):
    """A gate/up item's stages: gate and up rows [row, row + BN) at each K step of BK."""
    for t in range(D // BK):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)     # a fresh barrier passes
        bar = ready.index(s)
        mbarrier.expect(bar, stage_bytes)
        tma_load(dgate, [row, t * BK], bar, ring.index(2 * s))
        tma_load(dup, [row, t * BK], bar, ring.index(2 * s + 1))
        j += 1
    return j


@gluon.jit
def _producer(args, TOPK: gl.constexpr, TK: gl.constexpr, SHARED: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
    (ring, ready, empty, xs, xs2, hs, hs2, items_ptr, counts_ptr, ids_ptr, wts_ptr, first, E,
     I, D, IS, dg, du, dd, dgs, dus, dds, x_ptr, h_ptr, out_ptr, cnt_ptr, G, L) = args
    pid = gl.program_id(0)
    stage_bytes: gl.constexpr = 2 * BN * BK * 2
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tk = gl.arange(0, TK, layout=vec)
    n_sh = gl.load(counts_ptr + 3 * pid)          # its first n_sh items: shared gate/up
    n_up = gl.load(counts_ptr + 3 * pid + 1)
    n_down = gl.load(counts_ptr + 3 * pid + 2)
    j = 0
    nxt = _item(items_ptr, pid, 0, L)
    for it in range(n_sh):            # the shared experts' weights: before waiting for anyone
        slot, n0 = nxt
        nxt = _item(items_ptr, pid, it + 1, L)      # its fields arrive under this item
        j = _up_tiles(ring, ready, empty, dgs, dus, n0, j, D, BK, STAGES, stage_bytes)
    grid_wait(PDL)                    # the router's ids
    ids = gl.load(ids_ptr + tk, mask=tk < TOPK, other=-1).to(gl.int32)
    for it in range(n_sh, n_up + n_down):
        slot, n0 = nxt
        nxt = _item(items_ptr, pid, it + 1, L)
        if it < n_up:                                                  # routed gate/up
            local, e = _local(ids, tk, slot, first, E, TOPK)
            if local:
                j = _up_tiles(ring, ready, empty, dg, du, e * I + n0, j, D, BK, STAGES,
                              stage_bytes)
        else:                                                          # down: every slot
            for q in range(TOPK + SHARED):
                sl = _slot(q, TOPK, SHARED)
                local, e = _local(ids, tk, sl, first, E, TOPK)
                if local:
                    for t in range(_k_steps(sl, I, IS, TOPK, BK)):
                        s = j % STAGES
                        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
                        bar = ready.index(s)
                        mbarrier.expect(bar, stage_bytes)
                        k = t * BK
                        if sl < TOPK:
                            tma_load(dd, [e * D + n0, k], bar, ring.index(2 * s))
                            tma_load(dd, [e * D + n0 + BN, k], bar, ring.index(2 * s + 1))
                        else:
                            tma_load(dds, [n0, k], bar, ring.index(2 * s))
                            tma_load(dds, [n0 + BN, k], bar, ring.index(2 * s + 1))
                        j += 1


@gluon.jit
def _stage_x(xs2, x_ptr, D, BK: gl.constexpr, num_warps: gl.constexpr):
    """x [D] into shared memory as rows of BK (0 past D), one load."""
    R: gl.constexpr = xs2.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, lay)), 1)
    k = r * BK + gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, lay)), 0)
    xs2.store(gl.load(x_ptr + k, mask=k < D, other=0.0))


@gluon.jit
def _stage_h(hs2, h_ptr, ready, I, IS, TOPK: gl.constexpr, BK: gl.constexpr,
             num_warps: gl.constexpr):
    """The rows of the ready slots (`ready`: a 0/1 vector over the slots 0 .. TOPK) of the h
    buffer into shared memory, 0 past each slot's width (the TMA boxes past a weight's last
    column read 0 too, and 0 * garbage could be NaN). Rows of slots staged before are
    written again with the same values. Written by other programs: read through L2 (.cg)."""
    R: gl.constexpr = hs2.shape[0]
    TS: gl.constexpr = ready.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    r1 = gl.arange(0, R, layout=gl.SliceLayout(1, lay))
    rs = gl.cdiv(IS, BK)                              # the shared slot's rows
    rr = gl.cdiv(I, BK)                               # a routed slot's rows
    slot = gl.where(r1 < rs, TOPK, (r1 - rs) // rr)                               # [R]
    ts = gl.arange(0, TS, layout=gl.SliceLayout(0, lay))
    rdy = gl.convert_layout(ready, gl.SliceLayout(0, lay))
    on = gl.sum(gl.where(gl.expand_dims(slot, 1) == gl.expand_dims(ts, 0),
                         gl.expand_dims(rdy, 0), 0), axis=1) > 0                  # [R]
    r = gl.expand_dims(r1, 1)
    c = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, lay)), 0)
    k = gl.where(r < rs, r * BK, ((r - rs) % rr) * BK) + c         # K of the element
    ok = gl.where(r < rs, k < IS, (k < I) & (r < rs + TOPK * rr)) & gl.expand_dims(on, 1)
    hs2.store(gl.load(h_ptr + r * BK + c, mask=ok, other=0.0, cache_modifier=".cg"))


@gluon.jit
def _refresh(ready, ts, slot, hs2, h_ptr, cnt_ptr, I, IS, TOPK: gl.constexpr, BN: gl.constexpr,
             BK: gl.constexpr, num_warps: gl.constexpr):
    """Wait (acquire) until `slot`'s gate/up items are all done, then mark every slot done by
    now and stage the rows of all of them: -> the new ready vector."""
    need = gl.where(slot < TOPK, I, IS) // BN
    while gl.atomic_add(cnt_ptr + slot, 0, sem="acquire", scope="gpu") < need:
        pass
    needs = gl.where(ts < TOPK, I, IS) // BN
    done = gl.atomic_add(cnt_ptr + ts, gl.zeros_like(ts), mask=ts <= TOPK, sem="acquire",
                         scope="gpu")
    ready = gl.where((ts <= TOPK) & (done >= needs), 1, ready)
    sync_threads()                        # every reader of the staged rows is past them
    _stage_h(hs2, h_ptr, ready, I, IS, TOPK, BK, num_warps)
    sync_threads()
    return ready


@gluon.jit
def _consumer(args, TOPK: gl.constexpr, TK: gl.constexpr, TS: gl.constexpr,
              SHARED: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
              num_warps: gl.constexpr):
    (ring, ready_bar, empty, xs, xs2, hs, hs2, items_ptr, counts_ptr, ids_ptr, wts_ptr, first,
     E, I, D, IS, dg, du, dd, dgs, dus, dds, x_ptr, h_ptr, out_ptr, cnt_ptr, G, L) = args
    pid = gl.program_id(0)
    # a [BN, BK] box: 8 contiguous K elements (16 bytes) a thread, a warp along a row
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    kcol: gl.constexpr = gl.SliceLayout(0, tile)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, tile))
    tk = gl.arange(0, TK, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    n_up = gl.load(counts_ptr + 3 * pid + 1)
    n_down = gl.load(counts_ptr + 3 * pid + 2)
    pdl_wait(PDL)                         # x, the ids and weights: the previous kernel's output
    ids = gl.load(ids_ptr + tk, mask=tk < TOPK, other=-1).to(gl.int32)
    wts = gl.load(wts_ptr + tk, mask=tk < TOPK, other=0.0).to(gl.float32)
    _stage_x(xs2, x_ptr, D, BK, num_warps)
    sync_threads()
    j = 0
    nxt = _item(items_ptr, pid, 0, L)
    for it in range(n_up):                                             # phase A: gate/up
        slot, n0 = nxt
        nxt = _item(items_ptr, pid, it + 1, L)      # its fields arrive under this item
        local, e = _local(ids, tk, slot, first, E, TOPK)
        if local:
            acc_g = gl.zeros([BN, BK], gl.float32, layout=tile)
            acc_u = gl.zeros([BN, BK], gl.float32, layout=tile)
            for t in range(D // BK):
                s = j % STAGES
                v = gl.expand_dims(xs.index(t).load(kcol).to(gl.float32), 0)
                mbarrier.wait(ready_bar.index(s), (j // STAGES) & 1)
                a = ring.index(2 * s).load(tile).to(gl.float32)
                b = ring.index(2 * s + 1).load(tile).to(gl.float32)
                mbarrier.arrive(empty.index(s), count=1)
                acc_g += a * v
                acc_u += b * v
                j += 1
            g = gl.sum(acc_g, axis=1)
            u = gl.sum(acc_u, axis=1)
            w = gl.where(slot < TOPK, _pick(wts, tk, slot), 1.0)
            hv = w * (g / (1.0 + gl.exp(-g)) * u)                      # w * silu(g) * u
            gl.store(h_ptr + _h_row(slot, I, IS, TOPK, BK) * BK + n0 + rows, hv)
            sync_threads()
            gl.atomic_add(cnt_ptr + slot, 1, sem="release", scope="gpu")
    ts = gl.arange(0, TS, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    ready = gl.zeros([TS], gl.int32, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    for it in range(n_up, n_up + n_down):                              # down
        slot, n0 = nxt
        nxt = _item(items_ptr, pid, it + 1, L)
        acc_a = gl.zeros([BN, BK], gl.float32, layout=tile)
        acc_b = gl.zeros([BN, BK], gl.float32, layout=tile)
        for q in range(TOPK + SHARED):
            sl = _slot(q, TOPK, SHARED)
            local, e = _local(ids, tk, sl, first, E, TOPK)
            if local:
                if _pick(ready, ts, sl) == 0:
                    ready = _refresh(ready, ts, sl, hs2, h_ptr, cnt_ptr, I, IS, TOPK, BN, BK,
                                     num_warps)
                r0 = _h_row(sl, I, IS, TOPK, BK)
                for t in range(_k_steps(sl, I, IS, TOPK, BK)):
                    s = j % STAGES
                    v = gl.expand_dims(hs.index(r0 + t).load(kcol), 0)
                    mbarrier.wait(ready_bar.index(s), (j // STAGES) & 1)
                    a = ring.index(2 * s).load(tile).to(gl.float32)
                    b = ring.index(2 * s + 1).load(tile).to(gl.float32)
                    mbarrier.arrive(empty.index(s), count=1)
                    acc_a += a * v
                    acc_b += b * v
                    j += 1
        ya = gl.sum(acc_a, axis=1)
        yb = gl.sum(acc_b, axis=1)
        gl.store(out_ptr + n0 + rows, ya.to(out_ptr.dtype.element_ty))
        gl.store(out_ptr + n0 + BN + rows, yb.to(out_ptr.dtype.element_ty))
    # the last program to finish resets the counters (every wait has passed)
    sync_threads()
    done = cnt_ptr + TOPK + 1
    if gl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == G - 1:
        for q in range(TOPK + 1):
            gl.store(cnt_ptr + q, 0)
        gl.store(done, 0)
@gluon.jit
def moe_row_kernel(
    x_ptr, ids_ptr, wts_ptr, first, E, I, D, IS,
    dg, du, dd, dgs, dus, dds,             # TMA descriptors: gate, up [E*I, D], down [E*D, I],
                                           # shared gate, up [Is, D], shared down [D, Is]
    items_ptr, counts_ptr, G, L,           # the plan: items [G, L, 4], counts [G, 3]
    h_ptr, out_ptr, cnt_ptr,
    TOPK: gl.constexpr, TK: gl.constexpr, TS: gl.constexpr, SHARED: gl.constexpr,
    XR: gl.constexpr,
    HR: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = 0,
):
    dtype: gl.constexpr = dg.dtype
    ring = gl.allocate_shared_memory(dtype, [2 * STAGES, BN, BK], dg.layout)
    # x and h as rows of BK: stored as [R, BK], read a row at a time through a view with a
    # one-dimensional layout
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    rows1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    xs2 = gl.allocate_shared_memory(dtype, [XR, BK], plain)
    hs2 = gl.allocate_shared_memory(gl.float32, [HR, BK], plain)
    xs = reinterpret(xs2, dtype, [XR, BK], rows1)
    hs = reinterpret(hs2, gl.float32, [HR, BK], rows1)
    mbar: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    args = (ring, ready, empty, xs, xs2, hs, hs2, items_ptr, counts_ptr, ids_ptr, wts_ptr,
            first, E, I, D, IS, dg, du, dd, dgs, dus, dds, x_ptr, h_ptr, out_ptr, cnt_ptr, G, L)
    gl.warp_specialize([(_consumer, (args, TOPK, TK, TS, SHARED, BN, BK, STAGES, PDL,
                                     num_warps)),
                        (_producer, (args, TOPK, TK, SHARED, BN, BK, STAGES, PDL))],
                       [1], [PRODUCER_REGS])
