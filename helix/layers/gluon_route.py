"""Device code of the MoE router inside the one-row Gluon MoE launch (gluon_moe_kernel, ROUTE):
the post-attention residual add and RMS norm, the router logits, and the top-k choice of one
token, so that the router is not a launch of its own.

In every program:
1. `route_rows`, in the consumer partition, first: the program's router rows (experts pid,
   pid + G, ...) are loaded BEFORE the wait for the previous kernel (no kernel of a step writes
   them), then x and the residual after it. h = residual + x (rounded to h's dtype), y =
   rms_norm(h) * norm weight: every program forms y itself (8 KB of reads) into its
   shared-memory x rows; program 0 also stores h (the next layer's residual) and y. Then its
   experts' logits y . W_e (y in the weight's dtype, fp32 sums, rounded to the weight's dtype
   where it is 16-bit, like F.linear) into a workspace, and a count on the route counter
   (release). The consumer goes on with the shared experts' gate/up items, which need no
   routing, while the choice is made.
2. `choose`, a partition of its own (one warp): waits until every program has counted
   (acquire), reads all logits (L2, .cg) and makes the choice (`select`: every program makes
   the same choice from the same values, so none waits for another's). It publishes the ids
   and weights in shared memory and arrives on the `routed` barrier, which the producer waits
   on before its routed tiles and the consumer before its routed items; program 0 also stores
   them.

The rule is helix.layers.triton_router._select_rows' at one row, line for line (its docstring
says why each step is as it is): softmax ranks the logits, sigmoid ranks score + bias and
weighs by the score, V2 keeps the groups with the best expert, V3 the best two's sum, ties go
to the lowest id, k rounds of "max, then the lowest id holding it". The [1, groups, experts a
group] tile sits in the one warp, so each reduction is the warp's shuffles.

No deadlock: the wait is for the other programs' logits, which each computes before any wait
(every program is resident: gluon_moe's plan has at most one an SM).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from helix.gluon_util import exp_f32, grid_wait, pdl_wait, sync_threads

BIG = gl.constexpr(1 << 30)   # "no expert": above every id


@gluon.jit
def _max3(x):
    """[1, A, B] -> [1, 1, 1]: the maximum."""
    return gl.max(gl.max(x, axis=2, keep_dims=True), axis=1, keep_dims=True)


@gluon.jit
def _min3(x):
    return gl.min(gl.min(x, axis=2, keep_dims=True), axis=1, keep_dims=True)


@gluon.jit
def _sum3(x):
    return gl.sum(gl.sum(x, axis=2, keep_dims=True), axis=1, keep_dims=True)


@gluon.jit
def _along(n: gl.constexpr, axis: gl.constexpr, L3: gl.constexpr):
    """arange(n) as a [1, n, 1] (axis 1) or [1, 1, n] (axis 2) tensor of layout L3."""
    if axis == 1:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        return gl.expand_dims(gl.expand_dims(v, 0), 2)
    else:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        return gl.expand_dims(gl.expand_dims(v, 0), 1)


@gluon.jit
def select(lg_ptr, bias_ptr, EG, NG, scaling,
           K: gl.constexpr, TK: gl.constexpr, SIGMOID: gl.constexpr, GROUP_RULE: gl.constexpr,
           TOPK_GROUP: gl.constexpr, NORM: gl.constexpr, HAS_BIAS: gl.constexpr,
           BG: gl.constexpr, BEG: gl.constexpr, L3: gl.constexpr):
    """The top-K of the logits [NG * EG] (fp32, written by other programs: read through L2)
    -> (weights [1, 1, TK] fp32, ids [1, 1, TK] int32; 0 past K). GROUP_RULE: 0 none,
    1 a group's best score (V2), 2 the sum of its best two (V3)."""
    g = _along(BG, 1, L3)                                                     # [1, BG, 1]
    j = _along(BEG, 2, L3)                                                    # [1, 1, BEG]
    valid = (g < NG) & (j < EG)
    eid = gl.where(valid, g * EG + j, BIG)
    logit = gl.load(lg_ptr + gl.where(valid, eid, 0), mask=valid, other=float("-inf"),
                    cache_modifier=".cg")
    if SIGMOID:
        score = gl.div_rn(1.0, 1.0 + exp_f32(-gl.where(valid, logit, 0.0)))
        key = score
        if HAS_BIAS:
            key = score + gl.load(bias_ptr + gl.where(valid, eid, 0), mask=valid,
                                  other=0.0).to(gl.float32)
    else:
        p = gl.where(valid, exp_f32(logit - _max3(logit)), 0.0)
        score = gl.div_rn(p, _sum3(p))
        key = logit                              # softmax is monotonic: rank the logits
    key = gl.where(valid, key, float("-inf"))

    if GROUP_RULE > 0:
        gs = gl.max(key, axis=2, keep_dims=True)                              # [1, BG, 1]
        if GROUP_RULE == 2:                      # + the second best (a tie counts twice)
            first = gl.min(gl.where(valid & (key == gs), j, BEG), axis=2, keep_dims=True)
            gs = gs + gl.max(gl.where(j == first, float("-inf"), key), axis=2,
                             keep_dims=True)
        gvalid = g < NG
        keep = g < 0
        for _ in gl.static_range(TOPK_GROUP):
            avail = gvalid & ~keep
            gm = gl.max(gl.where(avail, gs, float("-inf")), axis=1, keep_dims=True)
            gi = gl.min(gl.where(avail & (gs == gm), g, BG), axis=1, keep_dims=True)
            keep = keep | (g == gi)
        key = gl.where(keep, key, float("-inf"))

    kk = _along(TK, 2, L3)                                                    # [1, 1, TK]
    taken = eid < 0
    w_out = gl.zeros([1, 1, TK], gl.float32, layout=L3)
    id_out = gl.zeros([1, 1, TK], gl.int32, layout=L3)
    for i in gl.static_range(K):
        avail = valid & ~taken
        m = _max3(gl.where(avail, key, float("-inf")))
        idx = _min3(gl.where(avail & (key == m), eid, BIG))                   # lowest id
        hit = eid == idx
        wi = _sum3(gl.where(hit, score, 0.0))
        taken = taken | hit
        w_out = gl.where(kk == i, wi, w_out)
        id_out = gl.where(kk == i, idx, id_out)
    if NORM:
        tot = gl.sum(w_out, axis=2, keep_dims=True)
        if SIGMOID:
            tot = tot + 1e-20
        w_out = gl.div_rn(w_out, tot)
    return w_out * scaling, id_out


@gluon.jit
def _logit(y, w, ROUND: gl.constexpr):
    """y . w for a router row w (fp32 sums, y in w's dtype; rounded to it where ROUND, like
    F.linear's 16-bit output)."""
    acc = gl.sum(gl.sum(y.to(w.dtype).to(gl.float32) * w.to(gl.float32), axis=1), axis=0)
    if ROUND:
        acc = acc.to(w.dtype).to(gl.float32)
    return acc


@gluon.jit
def route_rows(rargs, xs2, G, BK: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    """The consumer's part (module doc, 1): y into xs2 (rows of BK), h and y stored by
    program 0, this program's logits, its count on the route counter."""
    (a_ptr, r_ptr, nw_ptr, rw_ptr, bias_ptr, lg_ptr, h_out, y_out, w_out, id_out, inv_d, eps,
     D, NE, EG, NG, scaling, cnt_ptr) = rargs
    ROUND: gl.constexpr = rw_ptr.dtype.element_ty != gl.float32
    pid = gl.program_id(0)
    R: gl.constexpr = xs2.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, lay)), 1)
    k = r * BK + gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, lay)), 0)
    km = k < D
    w0 = gl.load(rw_ptr + pid * D + k, mask=km & (pid < NE), other=0.0)   # before the wait
    pdl_wait(PDL)                          # x and the residual: the previous kernel's output
    h_dt: gl.constexpr = h_out.dtype.element_ty
    h = (gl.load(a_ptr + k, mask=km, other=0.0).to(gl.float32)
         + gl.load(r_ptr + k, mask=km, other=0.0).to(gl.float32)).to(h_dt)
    hf = h.to(gl.float32)
    rstd = gl.div_rn(1.0, gl.sqrt_rn(gl.sum(gl.sum(hf * hf, axis=1), axis=0) * inv_d + eps))
    xn = (hf * rstd).to(h_dt).to(gl.float32)
    y = (xn * gl.load(nw_ptr + k, mask=km, other=0.0).to(gl.float32)).to(y_out.dtype.element_ty)
    xs2.store(y)
    if pid == 0:
        gl.store(h_out + k, h, mask=km)
        gl.store(y_out + k, y, mask=km)
    # this program's logits: experts pid, pid + G, ... (the first row is already loaded)
    if pid < NE:
        gl.store(lg_ptr + pid, _logit(y, w0, ROUND))
    for e in range(pid + G, NE, G):
        gl.store(lg_ptr + e, _logit(y, gl.load(rw_ptr + e * D + k, mask=km, other=0.0), ROUND))
    sync_threads()
    gl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def choose(rargs, sel, G, TOPK: gl.constexpr, TK: gl.constexpr, RSPEC: gl.constexpr,
           PDL: gl.constexpr = 0):
    """The router partition (one warp; module doc, 2): once every program's logits are in
    (acquire), the choice into sel's shared buffers ([1, TK] ids, weights), then an arrival on
    its `routed` barrier. RSPEC = (SIGMOID, GROUP_RULE, TOPK_GROUP, NORM, HAS_BIAS, BG, BEG,
    L3), L3 a one-warp layout of [1, BG, BEG].

    With PDL_EARLY (bit 2) it first waits for the previous kernel: the route counter is shared
    with the SAME launch of the previous MoE layer, and early launches let a chain of kernels
    be resident ahead, so this launch's programs may run while that one's counter still holds
    its full count (not yet reset by its last program). Without PDL_EARLY the launch starts
    only once the kernel before it has passed its own wait, so every earlier kernel, the
    previous MoE launch included, has finished."""
    (a_ptr, r_ptr, nw_ptr, rw_ptr, bias_ptr, lg_ptr, h_out, y_out, w_out, id_out, inv_d, eps,
     D, NE, EG, NG, scaling, cnt_ptr) = rargs
    sel_ids, sel_wts, routed = sel
    L3: gl.constexpr = RSPEC[7]
    if PDL & 2:
        grid_wait(PDL)
    while gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < G:
        pass
    wts, ids = select(lg_ptr, bias_ptr, EG, NG, scaling, TOPK, TK, RSPEC[0], RSPEC[1],
                      RSPEC[2], RSPEC[3], RSPEC[4], RSPEC[5], RSPEC[6], L3)
    # [1, 1, TK] -> [1, TK] (a max over a copied axis: exact) into shared memory
    sel_ids.store(gl.max(ids, axis=1))
    sel_wts.store(gl.max(wts, axis=1))
    if gl.program_id(0) == 0:
        kk = _along(TK, 2, L3)
        gl.store(id_out + kk, ids.to(id_out.dtype.element_ty), mask=kk < TOPK)
        gl.store(w_out + kk, wts.to(w_out.dtype.element_ty), mask=kk < TOPK)
    sync_threads()
    mbarrier.arrive(routed, count=1)
