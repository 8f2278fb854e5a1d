"""The MoE router in one Triton launch, CUDA-graph safe (no host sync, grids from shapes only).

    route_select_triton(logits [T, E] fp32, bias, spec)     -> (weights [T, k], ids [T, k])
    route_fused_triton(x [T, D], w_router [E, D], bias, spec) -> the same, logits included
    route_add_norm_triton(x, residual, norm_w, eps, w_router, bias, spec)
        -> (rms_norm(residual + x) * norm_w, residual + x, weights, ids): the norm before the
           router in the same launch

Per token row, from the router logits: scores (softmax, or sigmoid + e_score_correction_bias),
the group-limited choice (V2: a group's best score; V3: the sum of its top two; keep the
`topk_group` best groups), the top-k experts, and their weights gathered from the unbiased
scores (normalised when norm_topk_prob, times routed_scaling_factor). No sort: k rounds of
"max, then the lowest expert id holding it" over the row held in registers as [groups, per
group]. The torch reference (helix.layers.router.route_torch) applies the same rules:

  - ties: the lowest expert id (and group id) first. torch.topk's order among equal values is
    unspecified, so the reference ranks an order-preserving int64 key (value, -id) instead.
  - softmax routing ranks the logits (softmax is monotonic in them; ranking its rounded
    values could tie distinct logits), and the V2 group score is the group's best logit.
  - experts outside the kept groups rank -inf (never above a kept expert).

Rounding: softmax as exp(l - max) / sum and sigmoid as 1 / (1 + exp(-l)), exp to a few ulp
(fused_ops._exp_f32) and correctly rounded divisions, so weights agree with torch's within fp32
rounding; ids agree exactly unless two scores sit within an ulp (the sigmoid path).

route_fused_triton also computes the logits: programs split the experts, each streams its
experts' rows of the router weight for all T rows (x cast to the weight's dtype, fp32
accumulation, logits rounded to the weight's dtype like F.linear's output), writes them to a
workspace, and counts itself on an arrival counter; the last program to arrive selects every
row (the pattern and memory-ordering argument of triton_decode's fused merge). It replaces the
dtype cast, the GEMM and the selection kernels of a decode step's router with one launch; for
many rows (prefill) the GEMM + route_select_triton is the better pair (each program would
otherwise re-read the weights per row block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from helix.layers.fused_ops import _added, _exp_f32, _normed, _rstd
from helix.triton_util import (arrival_counters, last_to_arrive, pdl_sync, pow2, prefetch_l2,
                               prefetching, run_kernel)

BIG = tl.constexpr(1 << 30)   # "no expert": above every id


@dataclass(frozen=True)
class RouteSpec:
    """The routing rule of one model (static: a kernel specialisation)."""
    k: int                        # experts per token
    sigmoid: bool                 # scores: sigmoid (+ bias), else softmax
    groups: int                   # expert groups (1: none)
    topk_group: int               # groups kept per token
    group_rule: str               # "none" | "max" (DeepSeek-V2) | "top2" (DeepSeek-V3)
    norm: bool                    # renormalise the k weights
    scaling: float                # routed_scaling_factor

    @classmethod
    def of(cls, cfg) -> "RouteSpec":
        if cfg.scoring == "sigmoid":
            rule = "top2" if cfg.n_group > 1 else "none"
        else:
            rule = "max" if cfg.topk_method == "group_limited_greedy" else "none"
        return cls(k=cfg.experts_per_token, sigmoid=cfg.scoring == "sigmoid",
                   groups=cfg.n_group if rule != "none" else 1,
                   topk_group=cfg.topk_group if rule != "none" else 1, group_rule=rule,
                   norm=bool(cfg.norm_topk_prob), scaling=float(cfg.routed_scaling_factor))


@triton.jit
def _select_rows(lg_ptr, stride_lt, t0, T, bias_ptr, w_ptr, id_ptr, stride_wt, stride_it,
                 EG, G, scaling,
                 K: tl.constexpr, SIGMOID: tl.constexpr, GROUP_RULE: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 FROM_L2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows t0 .. t0 + BLOCK_T - 1 (< T) of the logits [T, G * EG] -> weights / ids [T, K].
    GROUP_RULE: 0 none, 1 group max (V2), 2 group top-2 sum (V3). FROM_L2: load the logits
    with ld.global.cg (written by other programs of this launch)."""
    rows = t0 + tl.arange(0, BLOCK_T)
    rmask = rows < T
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EG)
    valid_e = (g[:, None] < G) & (j[None, :] < EG)                           # [BG, BEG]
    eid2 = tl.where(valid_e, g[:, None] * EG + j[None, :], BIG)                 # [BG, BEG]
    eid = eid2[None, :, :]                                                   # [1, BG, BEG]
    valid = rmask[:, None, None] & valid_e[None, :, :]                       # [BT, BG, BEG]
    ptrs = lg_ptr + rows.to(tl.int64)[:, None, None] * stride_lt + tl.where(valid, eid, 0)
    if FROM_L2:
        logit = tl.load(ptrs, mask=valid, other=float("-inf"), cache_modifier=".cg")
    else:
        logit = tl.load(ptrs, mask=valid, other=float("-inf"))
    logit = logit.to(tl.float32)

    if SIGMOID:
        score = tl.div_rn(1.0, 1.0 + _exp_f32(-tl.where(valid, logit, 0.0)))
        key = score
        if HAS_BIAS:
            key = score + tl.load(bias_ptr + tl.where(valid_e, eid2, 0), mask=valid_e,
                                  other=0.0).to(tl.float32)[None, :, :]
    else:
        m = tl.max(tl.max(logit, axis=2), axis=1)                                 # [BT]
        m = tl.where(rmask, m, 0.0)
        p = tl.where(valid, _exp_f32(logit - m[:, None, None]), 0.0)
        s = tl.sum(tl.sum(p, axis=2), axis=1)
        score = tl.div_rn(p, tl.where(rmask, s, 1.0)[:, None, None])
        key = logit                           # softmax is monotonic: rank the logits
    key = tl.where(valid, key, float("-inf"))

    if GROUP_RULE > 0:
        gs = tl.max(key, axis=2)                                                  # [BT, BG]
        if GROUP_RULE == 2:                   # + the second best (a tie counts twice)
            jj = j[None, None, :]
            first = tl.min(tl.where(valid & (key == gs[:, :, None]), jj, BLOCK_EG), axis=2)
            gs = gs + tl.max(tl.where(jj == first[:, :, None], float("-inf"), key), axis=2)
        gvalid = (g < G)[None, :]
        keep = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            avail = gvalid & ~keep
            gm = tl.max(tl.where(avail, gs, float("-inf")), axis=1)
            gi = tl.min(tl.where(avail & (gs == gm[:, None]), g[None, :], BLOCK_G), axis=1)
            keep = keep | (g[None, :] == gi[:, None])
        key = tl.where(keep[:, :, None], key, float("-inf"))

    kk = tl.arange(0, BLOCK_K)[None, :]
    taken = tl.zeros([BLOCK_T, BLOCK_G, BLOCK_EG], dtype=tl.int1)
    w_out = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    id_out = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(K):
        avail = valid & ~taken
        m = tl.max(tl.max(tl.where(avail, key, float("-inf")), axis=2), axis=1)  # [BT]
        cand = tl.where(avail & (key == m[:, None, None]), eid, BIG)
        idx = tl.min(tl.min(cand, axis=2), axis=1)                                # lowest id
        hit = eid == idx[:, None, None]
        wi = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=2), axis=1)
        taken = taken | hit
        w_out = tl.where(kk == i, wi[:, None], w_out)
        id_out = tl.where(kk == i, idx[:, None], id_out)
    if NORM:
        tot = tl.sum(w_out, axis=1)
        if SIGMOID:
            tot = tot + 1e-20
        w_out = tl.div_rn(w_out, tl.where(rmask, tot, 1.0)[:, None])
    w_out = w_out * scaling
    omask = rmask[:, None] & (kk < K)
    r64 = rows.to(tl.int64)[:, None]
    tl.store(w_ptr + r64 * stride_wt + kk, w_out.to(w_ptr.dtype.element_ty), mask=omask)
    tl.store(id_ptr + r64 * stride_it + kk, id_out.to(tl.int64), mask=omask)


@triton.jit(do_not_specialize=["T"])
def _route_select_kernel(lg_ptr, stride_lt, T, bias_ptr, w_ptr, id_ptr, stride_wt, stride_it,
                         EG, G, scaling,
                         K: tl.constexpr, SIGMOID: tl.constexpr, GROUP_RULE: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_sync(PDL)
    _select_rows(lg_ptr, stride_lt, tl.program_id(0) * BLOCK_T, T, bias_ptr, w_ptr, id_ptr,
                 stride_wt, stride_it, EG, G, scaling, K, SIGMOID, GROUP_RULE, TOPK_GROUP,
                 NORM, HAS_BIAS, False, BLOCK_T, BLOCK_G, BLOCK_EG, BLOCK_K)


@triton.jit(do_not_specialize=["T"])
def _route_fused_kernel(x_ptr, wr_ptr, lg_ptr, cnt_ptr, bias_ptr, w_ptr, id_ptr,
                        r_ptr, nw_ptr, y_ptr, h_ptr,
                        T, D, E, EG, G, scaling, inv_d, eps,
                        stride_xt, stride_re, stride_lt, stride_wt, stride_it, stride_rt,
                        K: tl.constexpr, SIGMOID: tl.constexpr, GROUP_RULE: tl.constexpr,
                        TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                        ROUND_LOGITS: tl.constexpr, ADD_NORM: tl.constexpr,
                        BLOCK_T: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program p: logits[:, p*BLOCK_E : (p+1)*BLOCK_E] = x W^T for all T (<= BLOCK_T) rows;
    the last program to finish routes every row. ADD_NORM: the router's input is
    rms_norm(residual + x) * norm weight, which every program forms itself (a first pass for
    each row's sum of squares); program 0 also stores it (y [T, D]) and the new residual
    (h [T, D], contiguous) for the experts and the next layer. ONE_TILE (D <= BLOCK_D): the
    program's router rows are loaded in one go BEFORE the PDL wait (no kernel of a step writes
    them) and the rows x / residual once, for the norm and the products alike."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    wdt = wr_ptr.dtype.element_ty
    w_rows = wr_ptr + e.to(tl.int64)[:, None] * stride_re                   # [BE, 1]
    if ONE_TILE:
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        wt = tl.load(w_rows + dd[None, :], mask=emask[:, None] & dmask[None, :], other=0.0)
    elif prefetching(PDL):                    # the router weight: L2 may fetch it early
        prefetch_l2(wr_ptr + e.to(tl.int64) * stride_re, D * (wdt.primitive_bitwidth // 8),
                    emask)
    pdl_sync(PDL)
    rows = tl.arange(0, BLOCK_T)
    rmask = rows < T
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt                 # [BT, 1]
    r_rows = r_ptr + rows.to(tl.int64)[:, None] * stride_rt
    o_rows = rows.to(tl.int64)[:, None] * D                                 # y / h rows
    h_dt = h_ptr.dtype.element_ty
    y_dt = y_ptr.dtype.element_ty
    if ONE_TILE:
        m = rmask[:, None] & dmask[None, :]
        if ADD_NORM:
            h = _added(x_rows, r_rows, dd, m, h_dt)
            v = h.to(tl.float32)
            xt = _normed(h, _rstd(tl.sum(v * v, axis=1), inv_d, eps), nw_ptr, dd, dmask, h_dt,
                         y_dt)
            if tl.program_id(0) == 0:
                tl.store(h_ptr + o_rows + dd[None, :], h, mask=m)
                tl.store(y_ptr + o_rows + dd[None, :], xt, mask=m)
        else:
            xt = tl.load(x_rows + dd[None, :], mask=m, other=0.0)
        xt = xt.to(wdt).to(tl.float32)                                           # [BT, BD]
        acc = tl.sum(xt[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    else:
        acc = _logits_chunked(x_rows, w_rows, r_rows, o_rows, rmask, emask, nw_ptr, y_ptr,
                              h_ptr, D, inv_d, eps, ADD_NORM, BLOCK_T, BLOCK_E, BLOCK_D)
    if ROUND_LOGITS:                          # F.linear in a 16-bit dtype rounds its output
        acc = acc.to(wdt).to(tl.float32)
    tl.store(lg_ptr + rows.to(tl.int64)[:, None] * stride_lt + e[None, :], acc,
             mask=rmask[:, None] & emask[None, :])
    # the last program to arrive routes, reading the workspace through L2 (.cg); the result
    # does not depend on which program routes (deterministic)
    if last_to_arrive(cnt_ptr, tl.num_programs(0)):
        _select_rows(lg_ptr, stride_lt, 0, T, bias_ptr, w_ptr, id_ptr, stride_wt, stride_it,
                     EG, G, scaling, K, SIGMOID, GROUP_RULE, TOPK_GROUP, NORM, HAS_BIAS,
                     True, BLOCK_T, BLOCK_G, BLOCK_EG, BLOCK_K)
        tl.store(cnt_ptr, 0)


@triton.jit
def _logits_chunked(x_rows, w_rows, r_rows, o_rows, rmask, emask, nw_ptr, y_ptr, h_ptr,
                    D, inv_d, eps, ADD_NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """_route_fused_kernel's logits [BT, BE] fp32 over D in BLOCK_D chunks (ADD_NORM: a first
    pass for the rows' sums of squares)."""
    wdt = w_rows.dtype.element_ty
    h_dt = h_ptr.dtype.element_ty
    y_dt = y_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_T], dtype=tl.float32)
    if ADD_NORM:
        ss = tl.zeros([BLOCK_T], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            v = _added(x_rows, r_rows, dd, rmask[:, None] & (dd < D)[None, :],
                       h_dt).to(tl.float32)
            ss += tl.sum(v * v, axis=1)
        rstd = _rstd(ss, inv_d, eps)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dmask = dd < D
        wt = tl.load(w_rows + dd[None, :], mask=emask[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)                                   # [BE, BD]
        m = rmask[:, None] & dmask[None, :]
        if ADD_NORM:
            h = _added(x_rows, r_rows, dd, m, h_dt)
            xt = _normed(h, rstd, nw_ptr, dd, dmask, h_dt, y_dt)
            if tl.program_id(0) == 0:
                tl.store(h_ptr + o_rows + dd[None, :], h, mask=m)
                tl.store(y_ptr + o_rows + dd[None, :], xt, mask=m)
        else:
            xt = tl.load(x_rows + dd[None, :], mask=m, other=0.0)
        xt = xt.to(wdt).to(tl.float32)                                           # [BT, BD]
        acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
    return acc


_RULES = {"none": 0, "max": 1, "top2": 2}
ONE_TILE = True               # module flag, read per call (benches switch it): D in one tile
MAX_FUSED_ROWS = 8            # route_fused_triton: at most this many rows (decode buckets)
# The largest [BLOCK_T, BLOCK_E, BLOCK_D] tile the ONE_TILE path takes (module flag, benches
# switch it); past 8192 elements the launch uses 8 warps (registers per thread as at 8192).
# DeepSeek-V2-Lite at 8 rows (8 x 2048): one tile instead of two passes of two 1024-wide chunks;
# on the H200 the whole 8 x 1K step went 5.541 -> 5.481 ms, batch 1 unchanged (same process,
# profiling/results/step_small/router16k_dsv2_009a278_h200.*).
ONE_TILE_ELEMENTS = 16384


def _select_meta(spec: RouteSpec, E: int, block_t: int) -> tuple[dict, int, int]:
    G = spec.groups
    if E % G:
        raise ValueError(f"{E} experts do not split into {G} groups")
    EG = E // G
    meta = dict(K=spec.k, SIGMOID=spec.sigmoid, GROUP_RULE=_RULES[spec.group_rule],
                TOPK_GROUP=spec.topk_group, NORM=spec.norm, BLOCK_T=block_t,
                BLOCK_G=pow2(G), BLOCK_EG=pow2(EG), BLOCK_K=pow2(spec.k))
    return meta, EG, G


def _outputs(T: int, k: int, dtype, device):
    return (torch.empty((T, k), dtype=dtype, device=device),
            torch.empty((T, k), dtype=torch.int64, device=device))


def select_block_t(T: int, E: int) -> int:
    """Rows per selection program: a few rows per program keep the [rows, E] tiles small."""
    return max(1, min(pow2(T), 4096 // pow2(E), 8))


def route_select_triton(logits: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec,
                        out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] out_dtype, ids [T, k] int64)."""
    T, E = logits.shape
    assert logits.stride(1) == 1
    w, ids = _outputs(T, spec.k, out_dtype, logits.device)
    if T == 0:
        return w, ids
    meta, EG, G = _select_meta(spec, E, select_block_t(T, E))
    run_kernel(_route_select_kernel, (triton.cdiv(T, meta["BLOCK_T"]),),
               logits, logits.stride(0), T, bias if bias is not None else logits, w, ids,
               w.stride(0), ids.stride(0), EG, G, spec.scaling, HAS_BIAS=bias is not None,
               num_warps=4, **meta)
    return w, ids


def fused_launch_config(T: int, E: int, D: int) -> dict:
    """Experts per program so ~64-128 programs stream the router weight (E x D); all of D in
    one tile [BLOCK_T, BLOCK_E, BLOCK_D] where that is <= ONE_TILE_ELEMENTS (the kernel's
    ONE_TILE path: DeepSeek-V2-Lite at 1-8 rows, Qwen3 at 1-2), else chunks of <= 8K elements
    (1024 wide or less)."""
    block_e = max(1, min(16, pow2(E) // 64))
    block_t = pow2(T)
    tile = pow2(D) * block_t * block_e
    one = ONE_TILE and tile <= ONE_TILE_ELEMENTS
    block_d = pow2(D) if one else max(64, min(1024, pow2(D), 8192 // (block_t * block_e)))
    return dict(BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_D=block_d,
                num_warps=8 if one and tile > 8192 else 4)


def _route_fused(x, weight, bias, spec, config, w, ids, add_norm=None):
    """The fused launch; add_norm = (residual, norm weight, eps, y, h) or None."""
    T, D = x.shape
    E = weight.shape[0]
    assert T <= MAX_FUSED_ROWS and weight.stride(1) == 1 and x.stride(1) == 1
    if T == 0:
        return
    cfg = fused_launch_config(T, E, D)
    cfg.update(config or {})
    meta, EG, G = _select_meta(spec, E, cfg["BLOCK_T"])
    meta.update(cfg)
    logits = torch.empty((T, E), dtype=torch.float32, device=x.device)
    counter = arrival_counters(x.device, 1)
    r, nw, eps, y, h = add_norm if add_norm is not None else (x, x, 0.0, x, x)
    run_kernel(_route_fused_kernel, (triton.cdiv(E, meta["BLOCK_E"]),),
               x, weight, logits, counter, bias if bias is not None else logits, w, ids,
               r, nw, y, h, T, D, E, EG, G, spec.scaling, 1.0 / D, float(eps),
               x.stride(0), weight.stride(0), logits.stride(0), w.stride(0), ids.stride(0),
               r.stride(0), HAS_BIAS=bias is not None, ROUND_LOGITS=weight.dtype != torch.float32,
               ADD_NORM=add_norm is not None, ONE_TILE=D <= meta["BLOCK_D"], **meta)


def route_fused_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       spec: RouteSpec, config: dict | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (T <= MAX_FUSED_ROWS), weight [E, D] -> (weights [T, k] x.dtype, ids [T, k])."""
    w, ids = _outputs(x.shape[0], spec.k, x.dtype, x.device)
    _route_fused(x, weight, bias, spec, config, w, ids)
    return w, ids


def route_add_norm_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                          eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
                          spec: RouteSpec, config: dict | None = None):
    """The residual add and RMS norm before the router, in the router's launch: x, residual
    [T, D] (T <= MAX_FUSED_ROWS, unit feature stride) -> (y = rms_norm(residual + x) * norm_w
    [T, D], h = residual + x [T, D], weights [T, k] in y's dtype, ids [T, k]): the values of
    fused_ops.add_rms_norm, then route_fused_triton(y)."""
    assert residual.shape == x.shape and residual.stride(1) == 1 and norm_w.stride(0) == 1
    h_dtype = torch.promote_types(residual.dtype, x.dtype)
    h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
    y = torch.empty(x.shape, dtype=torch.promote_types(h_dtype, norm_w.dtype), device=x.device)
    w, ids = _outputs(x.shape[0], spec.k, y.dtype, x.device)
    _route_fused(x, weight, bias, spec, config, w, ids, (residual, norm_w, eps, y, h))
    return y, h, w, ids
