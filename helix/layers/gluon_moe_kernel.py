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

from helix.gluon_util import grid_wait, pdl_wait, sync_threads, tma_load

ITEM_FIELDS = gl.constexpr(8)    # kind, slot, n0, k0, tiles, chunk, -, - (gluon_moe.FIELDS)


@gluon.jit
def _item(items_ptr, pid, it, L):
    base = items_ptr + (pid * L + it) * ITEM_FIELDS
    return (gl.load(base), gl.load(base + 1), gl.load(base + 2), gl.load(base + 3),
            gl.load(base + 4), gl.load(base + 5))


@gluon.jit
def _local(ids_ptr, slot, first, E, TOPK: gl.constexpr):
    """(whether slot's expert is on this rank, its local index): a routed slot reads its id
    (the router's output: only after the wait for it); the shared slot (TOPK) is local, 0."""
    routed = slot < TOPK
    q = gl.load(ids_ptr + gl.minimum(slot, TOPK - 1), mask=routed, other=0).to(gl.int32) - first
    return (routed & (q >= 0) & (q < E)) | (slot == TOPK), gl.where(routed, q, 0)


@gluon.jit
def _producer(args, TOPK: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, PDL: gl.constexpr):
    (ring, ready, empty, items_ptr, ids_ptr, first, E, I, D, dg, du, dd, dgs, dus, dds,
     x_ptr, h_ptr, stride_h, wts_ptr, y_ptr, stride_y, out_ptr, cnt_ptr, chunk_slot_ptr,
     C, NB, G, L, IS) = args
    pid = gl.program_id(0)
    stage_bytes: gl.constexpr = 2 * BN * BK * 2
    j = 0
    for it in range(L):
        kind, slot, n0, k0, tiles, chunk = _item(items_ptr, pid, it, L)
        if slot < TOPK:
            grid_wait(PDL)                # the router's ids (a no-op after the first)
        local, e = _local(ids_ptr, slot, first, E, TOPK)
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
def _consumer(args, TOPK: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    (ring, ready, empty, items_ptr, ids_ptr, first, E, I, D, dg, du, dd, dgs, dus, dds,
     x_ptr, h_ptr, stride_h, wts_ptr, y_ptr, stride_y, out_ptr, cnt_ptr, chunk_slot_ptr,
     C, NB, G, L, IS) = args
    pid = gl.program_id(0)
    # a [BN, BK] tile: 8 contiguous K elements (16 bytes) a thread, 16 threads along a row
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    kcol: gl.constexpr = gl.SliceLayout(0, tile)
    frow: gl.constexpr = gl.SliceLayout(1, tile)
    cols = gl.arange(0, BK, layout=kcol)
    rows = gl.arange(0, BN, layout=frow)
    pdl_wait(PDL)                         # x (and the ids) are the previous kernel's output
    j = 0
    for it in range(L):
        kind, slot, n0, k0, tiles, chunk = _item(items_ptr, pid, it, L)
        local, e = _local(ids_ptr, slot, first, E, TOPK)
        if (kind == 0) & local:
            acc_a = gl.zeros([BN, BK], gl.float32, layout=tile)
            acc_b = gl.zeros([BN, BK], gl.float32, layout=tile)
            for t in range(tiles):
                s = j % STAGES
                v = gl.load(x_ptr + k0 + t * BK + cols).to(gl.float32)
                mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                a = ring.index(2 * s).load(tile).to(gl.float32)
                b = ring.index(2 * s + 1).load(tile).to(gl.float32)
                mbarrier.arrive(empty.index(s), count=1)
                acc_a += a * gl.expand_dims(v, 0)
                acc_b += b * gl.expand_dims(v, 0)
                j += 1
            g = gl.sum(acc_a, axis=1)
            u = gl.sum(acc_b, axis=1)
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
                if slot < TOPK:
                    w = gl.load(wts_ptr + slot).to(gl.float32)
                else:
                    w = 1.0
                acc_a = gl.zeros([BN, BK], gl.float32, layout=tile)
                acc_b = gl.zeros([BN, BK], gl.float32, layout=tile)
                for t in range(tiles):
                    s = j % STAGES
                    k = k0 + t * BK + cols
                    v = gl.load(h_ptr + slot * stride_h + k, mask=k < width, other=0.0,
                                cache_modifier=".cg").to(gl.float32)
                    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                    a = ring.index(2 * s).load(tile).to(gl.float32)
                    b = ring.index(2 * s + 1).load(tile).to(gl.float32)
                    mbarrier.arrive(empty.index(s), count=1)
                    acc_a += a * gl.expand_dims(v, 0)
                    acc_b += b * gl.expand_dims(v, 0)
                    j += 1
                y_row = y_ptr + chunk * stride_y + n0 + rows
                gl.store(y_row, gl.sum(acc_a, axis=1) * w)
                gl.store(y_row + BN, gl.sum(acc_b, axis=1) * w)
            # every chunk of the feature block counts in (non-local ones too); the last sums
            sync_threads()
            if gl.atomic_add(cnt_ptr + TOPK + 1 + nb, 1, sem="acq_rel", scope="gpu") == C - 1:
                _combine(ids_ptr, first, E, y_ptr, stride_y, out_ptr, chunk_slot_ptr, n0, C,
                         TOPK, BN, num_warps)
                gl.store(cnt_ptr + TOPK + 1 + nb, 0)
    # the last program to finish resets the slot counters (every wait on them has passed)
    sync_threads()
    done = cnt_ptr + TOPK + 1 + NB
    if gl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == G - 1:
        for q in range(TOPK + 1):
            gl.store(cnt_ptr + q, 0)
        gl.store(done, 0)


@gluon.jit
def _combine(ids_ptr, first, E, y_ptr, stride_y, out_ptr, chunk_slot_ptr, n0, C,
             TOPK: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """out[n0 : n0 + 2 BN] = the sum of y over the chunks of local slots, in chunk order."""
    lay: gl.constexpr = gl.BlockedLayout([2], [32], [num_warps], [0])
    n = n0 + gl.arange(0, 2 * BN, layout=lay)
    acc = gl.zeros([2 * BN], gl.float32, layout=lay)
    for c in range(C):
        local, e = _local(ids_ptr, gl.load(chunk_slot_ptr + c), first, E, TOPK)
        if local:
            acc += gl.load(y_ptr + c * stride_y + n, cache_modifier=".cg")
    gl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty))


@gluon.jit
def moe_row_kernel(
    x_ptr, ids_ptr, wts_ptr, first, E, I, D, IS,
    dg, du, dd, dgs, dus, dds,             # TMA descriptors: gate, up [E*I, D], down [E*D, I],
                                           # shared gate, up [Is, D], shared down [D, Is]
    items_ptr, chunk_slot_ptr, C, NB, G, L,   # the plan: items [G, L, 8], each chunk's slot [C]
    h_ptr, stride_h, y_ptr, stride_y, out_ptr, cnt_ptr,
    TOPK: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr, PDL: gl.constexpr = 0,
):
    dtype: gl.constexpr = dg.dtype
    ring = gl.allocate_shared_memory(dtype, [2 * STAGES, BN, BK], dg.layout)
    mbar: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbar)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    args = (ring, ready, empty, items_ptr, ids_ptr, first, E, I, D, dg, du, dd, dgs, dus, dds,
            x_ptr, h_ptr, stride_h, wts_ptr, y_ptr, stride_y, out_ptr, cnt_ptr, chunk_slot_ptr,
            C, NB, G, L, IS)
    gl.warp_specialize([(_consumer, (args, TOPK, BN, BK, STAGES, PDL, num_warps)),
                        (_producer, (args, TOPK, BN, BK, STAGES, PDL))],
                       [1], [PRODUCER_REGS])
