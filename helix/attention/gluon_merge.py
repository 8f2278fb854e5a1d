"""The split merge of a Gluon MLA decode inside its own launch (gluon_mla_few_kernel, MERGE):
no reduce_splits launch after it.

The programs of one (sequence, head block) are its splits. Where the whole grid is resident at
once (gluon_mla.merge_in_launch: at most one program an SM, as many programs as SMs), each
split program, once its partial O and LSE are written, counts itself in on the group's
counter (release) and waits until every split of the group has (acquire). Then it merges a
slice of the group's outputs: W = BLOCK_H * 512 / splits of the flattened [heads, 512] block,
reading every split's partials of that slice and their LSEs (through L2: other programs wrote
them). The merge is triton_splits.lse_weights' rule (an empty split, LSE -inf, weighs 0 and its
partials are not read). A second count per program releases the group; the last of the
2 x splits arrivals resets the counter, so the shared counters are zero after every launch
(helix.triton_util.arrival_counters).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from helix.gluon_util import sync_threads


@gluon.jit
def merge_slice(margs, b, hb, split, num_splits, HEADS, BLOCK_H: gl.constexpr,
                D: gl.constexpr, S: gl.constexpr, W: gl.constexpr, num_warps: gl.constexpr):
    """This split's slice of the (b, hb) group's merged O [heads, D] and LSE (module doc).
    margs = (o_ws, lse_ws, o, lse, counters, workspace strides (b, h, split), (b, h), output
    strides (b, h), (b, h)); S = num_splits (a power of two), W = BLOCK_H * D / S."""
    (ows_ptr, lws_ptr, o_ptr, lse_ptr, cnt_ptr, stride_wb, stride_wh, stride_ws, stride_lwb,
     stride_lwh, stride_ob, stride_oh, stride_lb, stride_lh) = margs
    grp = cnt_ptr + b * gl.num_programs(0) + hb
    sync_threads()                                      # this program's partials are written
    gl.atomic_add(grp, 1, sem="release", scope="gpu")
    while gl.atomic_add(grp, 0, sem="acquire", scope="gpu") < num_splits:
        pass
    lay: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    s = gl.expand_dims(gl.arange(0, S, layout=gl.SliceLayout(1, lay)), 1)          # [S, 1]
    fv = split * W + gl.arange(0, W, layout=gl.SliceLayout(0, lay))
    head = hb * BLOCK_H + fv // D                                                  # [W]
    dim = fv % D
    hmask = head < HEADS
    h2 = gl.expand_dims(head.to(gl.int64), 0)
    ok = gl.expand_dims(hmask, 0) & (s < num_splits)
    lse = gl.load(lws_ptr + b * stride_lwb + h2 * stride_lwh + s, mask=ok, other=float("-inf"),
                  cache_modifier=".cg")                                            # [S, W]
    m = gl.max(lse, axis=0)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    w = gl.exp(lse - gl.expand_dims(m_safe, 0))                       # empty splits: 0
    total = gl.sum(w, axis=0)
    w = w / gl.expand_dims(gl.where(total > 0, total, 1.0), 0)        # all empty: O = 0
    part = gl.load(ows_ptr + b * stride_wb + h2 * stride_wh + s * stride_ws
                   + gl.expand_dims(dim, 0), mask=ok & (lse > float("-inf")), other=0.0,
                   cache_modifier=".cg")
    out = gl.sum(w * part.to(gl.float32), axis=0)                                  # [W]
    gl.store(o_ptr + b * stride_ob + head.to(gl.int64) * stride_oh + dim,
             out.to(o_ptr.dtype.element_ty), mask=hmask)
    out_lse = gl.where(total > 0, m_safe + gl.log(gl.where(total > 0, total, 1.0)),
                       float("-inf"))
    gl.store(lse_ptr + b * stride_lb + head.to(gl.int64) * stride_lh, out_lse,
             mask=hmask & (dim == 0))
    # release the group: the last of its 2 x num_splits arrivals resets the counter
    sync_threads()
    if gl.atomic_add(grp, 1, sem="acq_rel", scope="gpu") == 2 * num_splits - 1:
        gl.store(grp, 0)


@gluon.jit
def empty_split(margs, b, hb, split, HEADS, BLOCK_H: gl.constexpr, num_warps: gl.constexpr):
    """A split with no token writes LSE -inf for its heads (the merge weighs it 0)."""
    (ows_ptr, lws_ptr, o_ptr, lse_ptr, cnt_ptr, stride_wb, stride_wh, stride_ws, stride_lwb,
     stride_lwh, stride_ob, stride_oh, stride_lb, stride_lh) = margs
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=vec)
    gl.store(lws_ptr + b * stride_lwb + heads.to(gl.int64) * stride_lwh + split,
             gl.full([BLOCK_H], float("-inf"), gl.float32, layout=vec), mask=heads < HEADS)
