"""Device code of the one-row MoE launch for Hopper (sm_90), in Gluon: the routed experts' and
the shared experts' gate/up AND down of one token in ONE persistent launch. The host side
(the work plan, descriptors, availability, the launch) is gluon_moe.py, which says why.

One program (CTA) per SM walks its list of work items (gluon_moe.plan), its gate/up items
first, then its down items:
- gate/up (phase A): BN features [n0, n0 + BN) of one slot (a routed pair j < TOPK, or the
  shared experts, slot TOPK) over all of D: h = w_slot * silu(x Wg^T) * (x Wu^T), fp32, into
  the slot's rows of the h buffer (rows of BK; the shared slot first, then the routed slots).
- down (phase B): 2 BN output features [n0, n0 + 2 BN) over EVERY local slot and all of its K:
  out[n0 : n0 + 2 BN] = sum over slots of h_slot Wd_slot[n0 : n0 + 2 BN]^T, stored once: an item
  owns its outputs, so nothing is combined afterwards.
Between the phases one barrier: each program counts itself in (release) after its gate/up
items; a program with down items waits (acquire) until all have, then copies the whole h
buffer (every slot's weighted h, ~48 KB fp32) into its shared memory once.

Two partitions:
- producer (1 warp): TMA loads of the items' weight tiles into a ring of STAGES stages of four
  [BN, BK] boxes (gate and up rows at two K steps; or the two halves of the down rows at two K
  steps). Weights depend on no kernel, so it streams ahead of every dependency: the shared
  experts' tiles even before the wait for the previous kernel (the router, whose ids the
  routed tiles need), and the down tiles while its consumer waits at the barrier. The bytes in
  flight (the ring) cost no registers, and the weight stream does not stop between the phases.
- consumer (4 warps, the default partition): per stage, the four boxes from shared memory
  times the activation rows (x, or h) in fp32 FMA, summed per feature at the item's end.

SCALED (fp8 weights, helix.layers.fp8: w = w8 * scale[n // 128, k // 128]): the boxes hold
e4m3 bytes (the ring twice as deep for the same bytes in flight) and each box's activation row
is multiplied by the box's block scales first: a box's BN rows lie in one 128-block of features
(BN divides 128), its BK columns in BK / 128 blocks (`_scale_row`: a scalar load a block, made
before the stage's wait), so the FMAs are those of the 16-bit kernel.

ROUTE (gluon_moe.moe_row_routed): the router's launch rides in this one. x is then the attention
output; the consumer forms the normed rows and its programs' logits first (gluon_route.
route_rows), and a third partition (one warp, gluon_route.choose) makes the top-k choice once
every program's logits are in, while the consumer already streams the shared experts' gate/up.
The producer holds the routed tiles back until that choice (the `routed` barrier in shared
memory), not until the previous kernel.

No deadlock: the barrier waits only for gate/up work, which every program does first without
waiting; every program is resident once the next kernel may launch (each calls
launch_dependents after its wait), and the plan has at most one program per SM. The counters
(helix.triton_util.arrival_counters: phase, done, and ROUTE's route counter) are reset by the
last program to finish.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from helix.gluon_util import (globaltimer, grid_wait, pdl_wait, reinterpret, sync_threads,
                              tma_load)
from helix.layers.gluon_route import choose, route_rows

ITEM_FIELDS = gl.constexpr(4)    # kind, slot, n0, - (gluon_moe.FIELDS)
# TRACE: each program's stamps (globaltimer ns) into trace [G, 8], in gluon_moe.STAMPS' order


@gluon.jit
def _stamp(trace_ptr, i: gl.constexpr, TRACE: gl.constexpr):
    if TRACE:
        gl.store(trace_ptr + gl.program_id(0) * 8 + i, globaltimer())


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
    """Stages of a slot's down K (2 BK a stage)."""
    return gl.cdiv(gl.where(slot < TOPK, I, IS), 2 * BK)


@gluon.jit
def _rows(width, BK: gl.constexpr):
    """Rows (of BK) a slot of `width` holds in the h buffer: its down stages' two K steps each
    (gluon_moe.plan's h_rows, the host's side of the rule)."""
    return 2 * gl.cdiv(width, 2 * BK)


@gluon.jit
def _h_row(slot, I, IS, TOPK: gl.constexpr, BK: gl.constexpr):
    """First row (of BK) of a slot in the h buffer: the shared slot at 0, routed j after it."""
    return gl.where(slot < TOPK, _rows(IS, BK) + slot * _rows(I, BK), 0)


@gluon.jit
def _claim(ready, empty, j, STAGES: gl.constexpr, stage_bytes: gl.constexpr):
    """Ring stage j for the producer: wait until its consumer released it (a fresh barrier
    passes), arm its ready barrier for stage_bytes -> (its index, the barrier)."""
    s = j % STAGES
    mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, stage_bytes)
    return s, bar


@gluon.jit
def _up_tiles(ring, ready, empty, dgate, dup, row, j, D, BK: gl.constexpr,
              STAGES: gl.constexpr, stage_bytes: gl.constexpr):
    """A gate/up item's stages: gate and up rows [row, row + BN) at two K steps of BK a stage
    (gate k, gate k + BK, up k, up k + BK; past D the boxes read 0)."""
    for t in range(gl.cdiv(D, 2 * BK)):
        s, bar = _claim(ready, empty, j, STAGES, stage_bytes)
        k = 2 * t * BK
        tma_load(dgate, [row, k], bar, ring.index(4 * s))
        tma_load(dgate, [row, k + BK], bar, ring.index(4 * s + 1))
        tma_load(dup, [row, k], bar, ring.index(4 * s + 2))
        tma_load(dup, [row, k + BK], bar, ring.index(4 * s + 3))
        j += 1
    return j


@gluon.jit
def _down_boxes(ring, s, bar, desc, row, k, BN: gl.constexpr, BK: gl.constexpr):
    """A down stage: rows [row, row + BN) and [row + BN, row + 2 BN) at K steps k, k + BK."""
    tma_load(desc, [row, k], bar, ring.index(4 * s))
    tma_load(desc, [row, k + BK], bar, ring.index(4 * s + 1))
    tma_load(desc, [row + BN, k], bar, ring.index(4 * s + 2))
    tma_load(desc, [row + BN, k + BK], bar, ring.index(4 * s + 3))


@gluon.jit
def _producer(args, sel, trace_ptr, TOPK: gl.constexpr, TK: gl.constexpr, SHARED: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
              ROUTE: gl.constexpr, TRACE: gl.constexpr):
    (ring, ready, empty, xs, xs2, hs, hs2, items_ptr, counts_ptr, ids_ptr, wts_ptr, first, E,
     I, D, IS, dg, du, dd, dgs, dus, dds, x_ptr, h_ptr, out_ptr, cnt_ptr, G, L) = args
    sel_ids, sel_wts, routed = sel
    pid = gl.program_id(0)
    stage_bytes: gl.constexpr = 4 * BN * BK * (dg.dtype.primitive_bitwidth // 8)
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
    if ROUTE:                         # the ids its consumer chose (gluon_route)
        mbarrier.wait(routed, 0)
        ids = gl.where(tk < TOPK, _row(sel_ids, TK).load(vec), -1)
    else:                             # the router kernel's ids
        grid_wait(PDL)
        ids = gl.load(ids_ptr + tk, mask=tk < TOPK, other=-1).to(gl.int32)
    _stamp(trace_ptr, 7, TRACE)                       # the ids known to the producer
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
                        s, bar = _claim(ready, empty, j, STAGES, stage_bytes)
                        k = 2 * t * BK
                        if sl < TOPK:
                            _down_boxes(ring, s, bar, dd, e * D + n0, k, BN, BK)
                        else:
                            _down_boxes(ring, s, bar, dds, n0, k, BN, BK)
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
def _stage_h(hs2, h_ptr, I, IS, TOPK: gl.constexpr, BK: gl.constexpr,
             num_warps: gl.constexpr):
    """The h buffer (rows of BK: the shared slot's, then each routed slot's) into shared
    memory, 0 past each slot's width (the TMA boxes past a weight's last column read 0 too,
    and 0 * garbage could be NaN). Written by other programs: read through L2 (.cg)."""
    R: gl.constexpr = hs2.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, lay)), 1)
    c = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, lay)), 0)
    rs = _rows(IS, BK)                                # the shared slot's rows
    rr = _rows(I, BK)                                 # a routed slot's rows
    routed = r >= rs
    k = gl.where(routed, ((r - rs) % rr) * BK, r * BK) + c         # K of the element
    ok = gl.where(routed, (k < I) & (r < rs + TOPK * rr), k < IS)
    hs2.store(gl.load(h_ptr + r * BK + c, mask=ok, other=0.0, cache_modifier=".cg"))


@gluon.jit
def _consume(ring, ready, empty, j, va0, va1, vb0, vb1, acc_a, acc_b, tile: gl.constexpr,
             STAGES: gl.constexpr):
    """Ring stage j (boxes a0, a1 | b0, b1: rows of one group at two K steps, then the other
    group's): (acc_a + a0 va0 + a1 va1, acc_b + b0 vb0 + b1 vb1), fp32; the stage goes back to
    the producer once its boxes are in registers. va* / vb*: [1, BK] activation rows of the two
    K steps (loaded by the caller before the wait), for 16-bit weights the same two rows for
    both groups, for fp8 weights each times its box's block scales (`_scaled`)."""
    s = j % STAGES
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    a0 = ring.index(4 * s).load(tile).to(gl.float32)
    a1 = ring.index(4 * s + 1).load(tile).to(gl.float32)
    b0 = ring.index(4 * s + 2).load(tile).to(gl.float32)
    b1 = ring.index(4 * s + 3).load(tile).to(gl.float32)
    mbarrier.arrive(empty.index(s), count=1)
    return acc_a + a0 * va0 + a1 * va1, acc_b + b0 * vb0 + b1 * vb1


@gluon.jit
def _scale_row(base, kb, nb, kidx, BK: gl.constexpr):
    """[1, BK]: the block scales of a box's K columns (BK // 128 blocks from block kb of a
    scale row at `base` of nb blocks; 0 past the row, where the box reads 0 too)."""
    s = gl.zeros_like(kidx.to(gl.float32))
    for i in gl.static_range(BK // 128):
        si = gl.load(base + kb + i, mask=kb + i < nb, other=0.0)
        s = gl.where(kidx // 128 == i, si, s)
    return gl.expand_dims(s, 0)


@gluon.jit
def _scale_base(slot, e, n0, rows, nk, TOPK: gl.constexpr):
    """Offset of an item's scale row in its slot's grid: (the routed expert e's [rows, nk]
    grid, or the shared slot's single one) at the features' block n0 // 128."""
    return gl.where(slot < TOPK, e * rows, 0) * nk + (n0 // 128) * nk


@gluon.jit
def _up_item(args, scl, it, j, nxt, ids, wts, tk, TOPK: gl.constexpr, BN: gl.constexpr,
             BK: gl.constexpr, STAGES: gl.constexpr, SCALED: gl.constexpr,
             num_warps: gl.constexpr):
    """The consumer's gate/up item `it` (fields nxt): h = w * silu(x Wg^T) * (x Wu^T) over its
    BN features into the h buffer, where its slot's expert is local -> (ring position, the
    next item's fields). SCALED: fp8 weights, x times the gate's and the up's block scales of
    each box (a box's BN rows lie in one 128-block of features)."""
    (ring, ready, empty, xs, xs2, hs, hs2, items_ptr, counts_ptr, ids_ptr, wts_ptr, first, E,
     I, D, IS, dg, du, dd, dgs, dus, dds, x_ptr, h_ptr, out_ptr, cnt_ptr, G, L) = args
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    kcol: gl.constexpr = gl.SliceLayout(0, tile)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, tile))
    slot, n0 = nxt
    nxt = _item(items_ptr, gl.program_id(0), it + 1, L)   # its fields arrive under this item
    local, e = _local(ids, tk, slot, first, E, TOPK)
    if local:
        acc_g = gl.zeros([BN, BK], gl.float32, layout=tile)
        acc_u = gl.zeros([BN, BK], gl.float32, layout=tile)
        sg, su, sd, sgs, sus, sds = scl
        kidx = gl.arange(0, BK, layout=kcol)
        nk = gl.cdiv(D, 128)
        off = _scale_base(slot, e, n0, gl.cdiv(I, 128), nk, TOPK)
        g_row = gl.where(slot < TOPK, sg, sgs) + off        # SCALED: the item's scale rows
        u_row = gl.where(slot < TOPK, su, sus) + off
        for t in range(gl.cdiv(D, 2 * BK)):
            v0 = gl.expand_dims(xs.index(2 * t).load(kcol).to(gl.float32), 0)
            v1 = gl.expand_dims(xs.index(2 * t + 1).load(kcol).to(gl.float32), 0)
            if SCALED:                  # boxes at K steps k, k + BK: blocks kb.., kb + BK / 128..
                kb = t * (2 * BK // 128)
                g0 = _scale_row(g_row, kb, nk, kidx, BK)
                g1 = _scale_row(g_row, kb + BK // 128, nk, kidx, BK)
                u0 = _scale_row(u_row, kb, nk, kidx, BK)
                u1 = _scale_row(u_row, kb + BK // 128, nk, kidx, BK)
                acc_g, acc_u = _consume(ring, ready, empty, j, v0 * g0, v1 * g1, v0 * u0,
                                        v1 * u1, acc_g, acc_u, tile, STAGES)
            else:
                acc_g, acc_u = _consume(ring, ready, empty, j, v0, v1, v0, v1, acc_g, acc_u,
                                        tile, STAGES)
            j += 1
        g = gl.sum(acc_g, axis=1)
        u = gl.sum(acc_u, axis=1)
        w = gl.where(slot < TOPK, _pick(wts, tk, slot), 1.0)
        hv = w * (g / (1.0 + gl.exp(-g)) * u)                          # w * silu(g) * u
        gl.store(h_ptr + _h_row(slot, I, IS, TOPK, BK) * BK + n0 + rows, hv)
    return j, nxt


@gluon.jit
def _consumer(args, sel, rargs, scl, trace_ptr, TOPK: gl.constexpr, TK: gl.constexpr,
              SHARED: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              PDL: gl.constexpr, ROUTE: gl.constexpr, SCALED: gl.constexpr,
              TRACE: gl.constexpr, num_warps: gl.constexpr):
    (ring, ready, empty, xs, xs2, hs, hs2, items_ptr, counts_ptr, ids_ptr, wts_ptr, first, E,
     I, D, IS, dg, du, dd, dgs, dus, dds, x_ptr, h_ptr, out_ptr, cnt_ptr, G, L) = args
    sel_ids, sel_wts, routed = sel
    pid = gl.program_id(0)
    # a [BN, BK] box: 8 contiguous K elements (16 bytes) a thread, a warp along a row
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    kcol: gl.constexpr = gl.SliceLayout(0, tile)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, tile))
    kidx = gl.arange(0, BK, layout=kcol)
    sg, su, sd, sgs, sus, sds = scl
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    tk = gl.arange(0, TK, layout=vec)
    n_sh = gl.load(counts_ptr + 3 * pid)
    n_up = gl.load(counts_ptr + 3 * pid + 1)
    n_down = gl.load(counts_ptr + 3 * pid + 2)
    _stamp(trace_ptr, 0, TRACE)                       # start
    if ROUTE:                             # add + norm here, and this program's logits
        route_rows(rargs, xs2, G, BK, PDL, num_warps)
    else:                                 # x, the ids and weights: the previous kernel's output
        pdl_wait(PDL)
        _stage_x(xs2, x_ptr, D, BK, num_warps)
    sync_threads()
    _stamp(trace_ptr, 1, TRACE)                       # x (the normed rows) in shared memory
    j = 0
    nxt = _item(items_ptr, pid, 0, L)
    none = gl.full([TK], -1, gl.int32, layout=vec)
    for it in range(n_sh):                # phase A: gate/up, the shared experts' first
        j, nxt = _up_item(args, scl, it, j, nxt, none, none.to(gl.float32), tk, TOPK, BN, BK,
                          STAGES, SCALED, num_warps)
    _stamp(trace_ptr, 2, TRACE)                       # the shared experts' gate/up done
    if ROUTE:                             # the router partition's choice
        mbarrier.wait(routed, 0)
        ids = gl.where(tk < TOPK, _row(sel_ids, TK).load(vec), -1)
        wts = _row(sel_wts, TK).load(vec)
    else:
        ids = gl.load(ids_ptr + tk, mask=tk < TOPK, other=-1).to(gl.int32)
        wts = gl.load(wts_ptr + tk, mask=tk < TOPK, other=0.0).to(gl.float32)
    _stamp(trace_ptr, 3, TRACE)                       # the ids known to the consumer
    for it in range(n_sh, n_up):
        j, nxt = _up_item(args, scl, it, j, nxt, ids, wts, tk, TOPK, BN, BK, STAGES, SCALED,
                          num_warps)
    # the barrier between the phases: count in (release), wait for all (acquire)
    sync_threads()
    _stamp(trace_ptr, 4, TRACE)                       # every gate/up item done
    gl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    if n_down > 0:
        while gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < G:
            pass
        _stage_h(hs2, h_ptr, I, IS, TOPK, BK, num_warps)
        sync_threads()
    _stamp(trace_ptr, 5, TRACE)                       # past the barrier, h staged
    for it in range(n_up, n_up + n_down):                              # phase B: down
        slot, n0 = nxt
        nxt = _item(items_ptr, pid, it + 1, L)
        acc_a = gl.zeros([BN, BK], gl.float32, layout=tile)
        acc_b = gl.zeros([BN, BK], gl.float32, layout=tile)
        for q in range(TOPK + SHARED):
            sl = _slot(q, TOPK, SHARED)
            local, e = _local(ids, tk, sl, first, E, TOPK)
            if local:
                r0 = _h_row(sl, I, IS, TOPK, BK)
                # SCALED: the slot's down scale row at the outputs' block (2 BN rows: one block)
                nk = gl.cdiv(gl.where(sl < TOPK, I, IS), 128)
                d_row = gl.where(sl < TOPK, sd, sds) + _scale_base(sl, e, n0, gl.cdiv(D, 128),
                                                                   nk, TOPK)
                for t in range(_k_steps(sl, I, IS, TOPK, BK)):
                    va = gl.expand_dims(hs.index(r0 + 2 * t).load(kcol), 0)
                    vb = gl.expand_dims(hs.index(r0 + 2 * t + 1).load(kcol), 0)
                    if SCALED:
                        kb = t * (2 * BK // 128)
                        va = va * _scale_row(d_row, kb, nk, kidx, BK)
                        vb = vb * _scale_row(d_row, kb + BK // 128, nk, kidx, BK)
                    acc_a, acc_b = _consume(ring, ready, empty, j, va, vb, va, vb, acc_a,
                                            acc_b, tile, STAGES)
                    j += 1
        ty = out_ptr.dtype.element_ty
        gl.store(out_ptr + n0 + rows, gl.sum(acc_a, axis=1).to(ty))
        gl.store(out_ptr + n0 + BN + rows, gl.sum(acc_b, axis=1).to(ty))
    # the last program to finish resets the counters (every wait has passed)
    sync_threads()
    _stamp(trace_ptr, 6, TRACE)                       # every down item done
    if gl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
        gl.store(cnt_ptr, 0)
        gl.store(cnt_ptr + 1, 0)
        if ROUTE:
            gl.store(cnt_ptr + 2, 0)


@gluon.jit
def _row(sel, TK: gl.constexpr):
    """Row 0 of a [1, TK] shared buffer as a one-dimensional view."""
    rows1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    return reinterpret(sel, sel.dtype, [1, TK], rows1).index(0)


@gluon.jit
def moe_row_kernel(
    x_ptr, ids_ptr, wts_ptr, first, E, I, D, IS,
    dg, du, dd, dgs, dus, dds,             # TMA descriptors: gate, up [E*I, D], down [E*D, I],
                                           # shared gate, up [Is, D], shared down [D, Is]
    sg, su, sd, sgs, sus, sds,             # SCALED (fp8 weights): their block scales, fp32,
                                           # contiguous: gate, up [E, cdiv(I, 128), cdiv(D, 128)],
                                           # down [E, cdiv(D, 128), cdiv(I, 128)], the shared
                                           # [cdiv(Is, 128), cdiv(D, 128)] twice and
                                           # [cdiv(D, 128), cdiv(Is, 128)]
    items_ptr, counts_ptr, G, L,           # the plan: items [G, L, 4], counts [G, 3]
    h_ptr, out_ptr, cnt_ptr,               # cnt: phase, done, route counters
    trace_ptr,                             # TRACE: int64 [G, 8] stamps
    # ROUTE (gluon_route; x_ptr is the attention output, ids / wts outputs): the residual, the
    # norm weight, the router weight [NE, D] and bias, the logits workspace [NE] fp32, the
    # new residual and normed rows [D], 1 / D, eps, NE, experts a group, groups, the scaling
    r_ptr, nw_ptr, rw_ptr, bias_ptr, lg_ptr, h_out, y_out, inv_d, eps, NE, EG, NG, scaling,
    TOPK: gl.constexpr, TK: gl.constexpr, SHARED: gl.constexpr, XR: gl.constexpr,
    HR: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, ROUTE: gl.constexpr = 0,
    RSPEC: gl.constexpr = None, ROUTER_REGS: gl.constexpr = 0, PDL: gl.constexpr = 0,
    SCALED: gl.constexpr = 0, TRACE: gl.constexpr = 0,
):
    ring = gl.allocate_shared_memory(dg.dtype, [4 * STAGES, BN, BK], dg.layout)
    dtype: gl.constexpr = x_ptr.dtype.element_ty          # the rows' (fp8 weights: 16-bit rows)
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
    routed = gl.allocate_shared_memory(gl.int64, [1], mbar)    # ROUTE: the choice is made
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(routed, count=1)
    sel = (gl.allocate_shared_memory(gl.int32, [1, TK], plain),      # the chosen ids
           gl.allocate_shared_memory(gl.float32, [1, TK], plain),    # and weights
           routed)
    args = (ring, ready, empty, xs, xs2, hs, hs2, items_ptr, counts_ptr, ids_ptr, wts_ptr,
            first, E, I, D, IS, dg, du, dd, dgs, dus, dds, x_ptr, h_ptr, out_ptr, cnt_ptr, G, L)
    scl = (sg, su, sd, sgs, sus, sds)
    rargs = (x_ptr, r_ptr, nw_ptr, rw_ptr, bias_ptr, lg_ptr, h_out, y_out, wts_ptr, ids_ptr,
             inv_d, eps, D, NE, EG, NG, scaling, cnt_ptr + 2)
    # the partition lists are written out in both branches: a tuple holding constexprs loses
    # them when bound to a name first (triton 3.6)
    if ROUTE:                 # a third partition, one warp: the choice (gluon_route.choose)
        gl.warp_specialize(
            [(_consumer, (args, sel, rargs, scl, trace_ptr, TOPK, TK, SHARED, BN, BK, STAGES,
                          PDL, ROUTE, SCALED, TRACE, num_warps)),
             (_producer, (args, sel, trace_ptr, TOPK, TK, SHARED, BN, BK, STAGES, PDL, ROUTE,
                          TRACE)),
             (choose, (rargs, sel, G, TOPK, TK, RSPEC, PDL))],
            [1, 1], [PRODUCER_REGS, ROUTER_REGS])
    else:
        gl.warp_specialize(
            [(_consumer, (args, sel, rargs, scl, trace_ptr, TOPK, TK, SHARED, BN, BK, STAGES,
                          PDL, ROUTE, SCALED, TRACE, num_warps)),
             (_producer, (args, sel, trace_ptr, TOPK, TK, SHARED, BN, BK, STAGES, PDL, ROUTE,
                          TRACE))],
            [1], [PRODUCER_REGS])
