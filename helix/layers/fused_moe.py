"""Fused mixture-of-experts for this rank's experts, CUDA-graph safe (no host synchronisation).

    fused_moe(x, gate, up, down, weights, ids, first) -> [T, D]
        = sum over pairs (t, j) with first <= ids[t, j] < first + E_local of
          weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),   e = ids[t, j] - first

Routing metadata (moe_routing) uses fixed-shape torch ops only: the N = T*k pairs are sorted by
local expert (pairs of other ranks' experts get the sentinel E_local and sort last), and
per-expert row bounds come from searchsorted over the sorted keys (no atomics). Every shape
depends on T, k, E_local, I, D alone, never on the routing values.

Two Triton kernels, each with programs over (local expert, output-feature tile, row split):
  1. _gate_up_kernel  grid (E, cdiv(I, BLOCK_N), M_SPLITS):
       h[r] = silu(x[tok(r)] Wg_e^T) * (x[tok(r)] Wu_e^T) for the sorted rows r of expert e,
       BLOCK_M rows at a time (tl.dot, masked padding rows) -> workspace h [N, I] (x.dtype).
  2. _down_kernel     grid (E + 1, cdiv(D, BLOCK_N), M_SPLITS):
       y[pair(r)] = weights[pair(r)] * h[r] Wd_e^T -> per-pair fp32 y [N, D]; the extra
       expert E writes zeros for the dropped pairs' rows. Then out = y.view(T, k, D).sum(1):
       deterministic, no atomics.
A program whose expert got no rows (or whose row split is past the expert's rows) returns
before touching a weight, so only experts that received tokens are read. Expert offsets into
the weight stacks are 64-bit (256 experts x 2048 x 7168 > 2^31 elements).

Decode batches (T*k <= moe_decode.MAX_PAIRS) take helix.layers.moe_decode instead: the same
contract in two weight-streaming launches, no sort. HELIX_MOE_KERNEL=v1|decode|auto (default
auto) or the `variant` argument picks; v1 is the sorted path above for every batch.

Float8 expert weights (the DeepSeek-V3 checkpoint format): gate, up [E, I, D] and down [E, D, I]
in torch.float8_e4m3fn with float32 block scales gate_s, up_s [E, cdiv(I, 128), cdiv(D, 128)]
and down_s [E, cdiv(D, 128), cdiv(I, 128)], passed as scales=(gate_s, up_s, down_s); the weight
is w[e, n, k] = w8[e, n, k] * s[e, n // 128, k // 128] (helix.layers.fp8.dequantize; the
last block of either axis may be partial). With scales the kernels are chosen as for 16-bit
stacks: decode batches (decode_kernels) take moe_decode with the scales (its module doc; with
`shared`, the shard in fp8 too and its block scales as shared_scales, where
moe_decode.shared_scales_fit(I)), the rest the v1 kernels (no `shared` there). Both
compile with SCALED: each fp8 weight tile is converted to x.dtype and its product scaled per
output feature in fp32, acc += dot(x_tile, w_tile) * s[e, n // 128, k0 // 128] (BLOCK_K divides
128, so a K tile never straddles two scale blocks). h stays in x.dtype; without scales the
kernels compile as before. In v1, fp32 activations (a checking dtype: ieee FMA products) compile
for sm_90 but spill there (the e4m3 -> fp32 tile conversion); bf16 / fp16 ones run on mma /
wgmma without spills.

fused_moe_torch is the plain-torch fallback (same signature, graph safe, reads every local
expert; it dequantizes fp8 experts one at a time) for devices without Triton.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from helix.layers import fp8
from helix.triton_util import HAS_TRITON, pow2, run_kernel, tl, triton

__all__ = ["fused_moe", "fused_moe_torch", "decode_kernels", "moe_routing", "moe_launch_config",
           "HAS_TRITON"]

VARIANT = os.environ.get("HELIX_MOE_KERNEL", "auto")
VARIANTS = ("v1", "decode", "auto")
# The decode kernels also stream the shared experts (moe_decode's `shared`); 0 turns that off
FOLD_SHARED = os.environ.get("HELIX_MOE_FOLD_SHARED", "1") not in ("0", "")


def decode_kernels(pairs: int, variant: str | None = None) -> bool:
    """Whether fused_moe runs moe_decode for T * k = pairs (and so can take `shared`)."""
    variant = variant or VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"MoE kernel variant {variant!r} not in {VARIANTS}")
    return HAS_TRITON and variant != "v1" and 0 < pairs <= moe_decode.MAX_PAIRS


def moe_routing(ids: torch.Tensor, first: int, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] global expert ids -> (order [N] int64, bounds [E + 2] int64); N = T*k,
    E = n_local.

    order: pair indices (t*k + j) sorted by local expert, stable; pairs of non-local experts
    (sentinel E) come last. Rows bounds[e]:bounds[e+1] of `order` belong to local expert e,
    rows bounds[E]:bounds[E+1] (= N) are the dropped pairs. Fixed shapes, no host sync."""
    local = ids.reshape(-1) - first                                          # [N]
    key = torch.where((local >= 0) & (local < n_local), local,
                      torch.full_like(local, n_local))                       # [N] in [0, E]
    sorted_key, order = torch.sort(key, stable=True)                         # [N], [N]
    # bounds[e] = #keys < e: a binary search per expert, no atomics (deterministic)
    edges = torch.arange(n_local + 2, dtype=key.dtype, device=key.device)    # [E + 2]
    bounds = torch.searchsorted(sorted_key, edges).to(torch.int64)           # [E + 2]
    return order, bounds


def _block_n(width: int, experts_hit: int, target: int = 256) -> int:
    """Output-feature tile: 64, or narrower (down to 16) while the programs of the experts that
    can be hit, experts_hit * cdiv(width, BLOCK_N), fall short of `target` (~2 per H200 SM)."""
    bn = min(64, max(16, pow2(width)))
    while bn > 16 and experts_hit * -(-width // bn) < target:
        bn //= 2
    return bn


def moe_launch_config(N: int, n_local: int, inter: int, dim: int, dtype: torch.dtype) -> dict:
    """Block sizes from static sizes only (graph safe): rows per block from the mean rows per
    expert, row splits so a heavily loaded expert (prefill) still spreads over programs, and
    narrower feature tiles when few experts can be hit (decode with a small I shard)."""
    n_local = max(1, n_local)
    block_m = min(64, max(16, pow2(-(-N // n_local))))
    m_splits = max(1, min(16, -(-N // (n_local * block_m))))
    hit = min(N, n_local)                     # at most this many experts have rows
    stages = 2 if dtype == torch.float32 else 3
    return dict(
        BLOCK_M=block_m, M_SPLITS=m_splits,
        up=dict(BLOCK_N=_block_n(inter, hit), BLOCK_K=min(64, max(16, pow2(dim))),
                num_warps=4, num_stages=stages),
        down=dict(BLOCK_N=_block_n(dim, hit), BLOCK_K=min(64, max(16, pow2(inter))),
                  num_warps=4, num_stages=stages))


if HAS_TRITON:
    from helix.layers import moe_decode

    @triton.jit
    def _gate_up_kernel(
        x_ptr, g_ptr, u_ptr, order_ptr, bounds_ptr, h_ptr, gs_ptr, us_ptr,
        D, I,
        stride_xt, stride_xd,                  # x [T, D]
        stride_ge, stride_gi, stride_gd,       # gate [E, I, D]
        stride_ue, stride_ui, stride_ud,       # up [E, I, D]
        stride_hr,                             # h [N, I], unit stride along I
        stride_gse, stride_gsi, stride_gsd,    # SCALED: gate_s [E, cdiv(I, 128), cdiv(D, 128)]
        stride_use, stride_usi, stride_usd,    # SCALED: up_s, the same shape
        TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, M_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        e = tl.program_id(0)
        start = tl.load(bounds_ptr + e)
        end = tl.load(bounds_ptr + e + 1)
        first_row = start + tl.program_id(2) * BLOCK_M
        if first_row >= end:                   # expert without tokens: no weight is read
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)          # [BN] features of I
        nmask = n < I
        e64 = e.to(tl.int64)
        g_base = g_ptr + e64 * stride_ge + n[None, :].to(tl.int64) * stride_gi   # [1, BN]
        u_base = u_ptr + e64 * stride_ue + n[None, :].to(tl.int64) * stride_ui
        if SCALED:                             # [BN] scale rows of the features' 128-blocks
            gs_base = gs_ptr + e64 * stride_gse + (n // 128) * stride_gsi
            us_base = us_ptr + e64 * stride_use + (n // 128) * stride_usi
        for m0 in range(first_row, end, BLOCK_M * M_SPLITS):
            r = m0 + tl.arange(0, BLOCK_M)                               # [BM] sorted rows
            rmask = r < end
            pair = tl.load(order_ptr + r, mask=rmask, other=0)
            tok = (pair // TOPK).to(tl.int64)
            x_rows = x_ptr + tok[:, None] * stride_xt                    # [BM, 1]
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < D
                xt = tl.load(x_rows + kk[None, :] * stride_xd,
                             mask=rmask[:, None] & kmask[None, :], other=0.0)   # [BM, BK]
                wmask = kmask[:, None] & nmask[None, :]
                wg = tl.load(g_base + kk[:, None] * stride_gd, mask=wmask, other=0.0)  # [BK, BN]
                wu = tl.load(u_base + kk[:, None] * stride_ud, mask=wmask, other=0.0)
                if SCALED:                     # fp8 tile -> x.dtype, product scaled per feature
                    sg = tl.load(gs_base + (k0 // 128) * stride_gsd, mask=nmask, other=0.0)
                    su = tl.load(us_base + (k0 // 128) * stride_usd, mask=nmask, other=0.0)
                    acc_g = acc_g + tl.dot(xt, wg.to(xt.dtype),
                                           input_precision=DOT_PRECISION) * sg[None, :]
                    acc_u = acc_u + tl.dot(xt, wu.to(xt.dtype),
                                           input_precision=DOT_PRECISION) * su[None, :]
                else:
                    xt = xt.to(wg.dtype)
                    acc_g = tl.dot(xt, wg, acc=acc_g, input_precision=DOT_PRECISION)
                    acc_u = tl.dot(xt, wu, acc=acc_u, input_precision=DOT_PRECISION)
            h = acc_g * tl.sigmoid(acc_g) * acc_u                        # silu(g) * u, fp32
            tl.store(h_ptr + r[:, None].to(tl.int64) * stride_hr + n[None, :],
                     h.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _down_kernel(
        h_ptr, d_ptr, w_ptr, order_ptr, bounds_ptr, y_ptr, ds_ptr,
        D, I, E,
        stride_hr,                             # h [N, I], unit stride along I
        stride_de, stride_dd, stride_di,       # down [E, D, I]
        stride_yr,                             # y [N, D] fp32 per pair, unit stride along D
        stride_dse, stride_dsd, stride_dsi,    # SCALED: down_s [E, cdiv(D, 128), cdiv(I, 128)]
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        M_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
    ):
        e = tl.program_id(0)                   # e == E: the dropped pairs, written as zeros
        start = tl.load(bounds_ptr + e)
        end = tl.load(bounds_ptr + e + 1)
        first_row = start + tl.program_id(2) * BLOCK_M
        if first_row >= end:                   # expert without tokens: no weight is read
            return
        keep = e < E
        k_end = I * keep.to(tl.int32)          # dropped pairs: no K loop, acc stays 0
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)          # [BN] features of D
        nmask = n < D
        d_base = d_ptr + e.to(tl.int64) * stride_de + n[None, :].to(tl.int64) * stride_dd
        if SCALED:                             # read only inside the K loop (e < E)
            ds_base = ds_ptr + e.to(tl.int64) * stride_dse + (n // 128) * stride_dsd   # [BN]
        for m0 in range(first_row, end, BLOCK_M * M_SPLITS):
            r = m0 + tl.arange(0, BLOCK_M)
            rmask = r < end
            pair = tl.load(order_ptr + r, mask=rmask, other=0)          # [BM] int64
            h_rows = h_ptr + r[:, None].to(tl.int64) * stride_hr        # [BM, 1]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, k_end, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < I
                hk = tl.load(h_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                             other=0.0)                                  # [BM, BK]
                wd = tl.load(d_base + kk[:, None] * stride_di,
                             mask=kmask[:, None] & nmask[None, :], other=0.0)   # [BK, BN]
                if SCALED:                     # fp8 tile -> h's dtype (x.dtype), scaled
                    sd = tl.load(ds_base + (k0 // 128) * stride_dsi, mask=nmask, other=0.0)
                    acc = acc + tl.dot(hk, wd.to(hk.dtype),
                                       input_precision=DOT_PRECISION) * sd[None, :]
                else:
                    acc = tl.dot(hk.to(wd.dtype), wd, acc=acc, input_precision=DOT_PRECISION)
            w = tl.load(w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)           # [BM]
            acc = tl.where(keep, acc * w[:, None], 0.0)
            tl.store(y_ptr + pair[:, None] * stride_yr + n[None, :], acc,
                     mask=rmask[:, None] & nmask[None, :])


def fused_moe(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor, first: int, variant: str | None = None,
              config: dict | None = None, shared=None, scales=None,
              shared_scales=None) -> torch.Tensor:
    """x [T, D]; gate, up [E, I, D]; down [E, D, I]; weights [T, k]; ids [T, k] global expert
    ids (int64) -> [T, D] in x.dtype: this rank's experts' weighted sum (fp32 accumulation).
    variant: None (VARIANT), "v1", "decode" or "auto"; config: moe_decode's tunables;
    shared: moe_decode's shared-expert shard, only where decode_kernels(T * k, variant).
    scales: None, or (gate_s, up_s, down_s) float32 128 x 128 block scales of float8_e4m3fn
    stacks (module doc): the same choice of kernels as 16-bit stacks. shared_scales: with
    scales and `shared`, the fp8 shard's block scales (moe_decode's; required there)."""
    T, D = x.shape
    E, I, _ = gate.shape
    k = ids.shape[1]
    N = T * k
    decode = decode_kernels(N, variant)                  # also validates the variant
    if scales is not None:
        scales = fp8.expert_scales(gate, up, down, scales)
    if decode and E:
        return moe_decode.moe_decode(x, gate, up, down, weights, ids, first, config, shared,
                                     scales=scales, shared_scales=shared_scales)
    if shared_scales is not None and shared is None:
        raise ValueError("fused_moe: shared_scales go with fp8 shared experts (shared=)")
    if shared is not None:
        raise ValueError("fused_moe: shared experts ride only on the decode kernels")
    if N == 0 or E == 0:
        return torch.zeros_like(x)
    order, bounds = moe_routing(ids, first, E)                       # [N], [E + 2]
    w_flat = weights.reshape(-1)                                     # [N]
    scaled = scales is not None
    wdtype = x.dtype if scaled else gate.dtype            # the dtype the products run in
    cfg = moe_launch_config(N, E, I, D, wdtype)
    bm, splits = cfg["BLOCK_M"], cfg["M_SPLITS"]
    precision = "ieee" if wdtype == torch.float32 else "tf32"
    c1, c2 = cfg["up"], cfg["down"]
    if scaled:                   # a K tile within one scale block: a power of two <= 128
        gs, us, ds = scales
        for c in (c1, c2):
            c["BLOCK_K"] = min(c["BLOCK_K"], fp8.BLOCK)
            assert fp8.BLOCK % c["BLOCK_K"] == 0, c
    else:                        # unused (SCALED=False): any tensor, zero strides
        gs = us = ds = gate
    s_strides = lambda s: s.stride() if scaled else (0, 0, 0)  # noqa: E731
    h = torch.empty((N, I), dtype=x.dtype, device=x.device)           # sorted rows
    run_kernel(
        _gate_up_kernel, (E, triton.cdiv(I, c1["BLOCK_N"]), splits),
        x, gate, up, order, bounds, h, gs, us, D, I,
        x.stride(0), x.stride(1), *gate.stride(), *up.stride(), h.stride(0),
        *s_strides(gs), *s_strides(us),
        TOPK=k, BLOCK_M=bm, M_SPLITS=splits, DOT_PRECISION=precision, SCALED=scaled, **c1)
    y = torch.empty((N, D), dtype=torch.float32, device=x.device)     # per pair (t*k + j)
    run_kernel(
        _down_kernel, (E + 1, triton.cdiv(D, c2["BLOCK_N"]), splits),
        h, down, w_flat, order, bounds, y, ds, D, I, E,
        h.stride(0), *down.stride(), y.stride(0), *s_strides(ds),
        BLOCK_M=bm, M_SPLITS=splits, DOT_PRECISION=precision, SCALED=scaled, **c2)
    return y.view(T, k, D).sum(1).to(x.dtype)                         # deterministic k-sum


def fused_moe_torch(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor, first: int,
                    scales=None) -> torch.Tensor:
    """Same contract as fused_moe in plain fixed-shape torch: every local expert runs on all T
    tokens with its per-token weight (0 where unrouted). Graph safe; reads all local experts.
    scales: as fused_moe's; each expert is dequantized to x.dtype (fp8.dequantize) in turn."""
    T, D = x.shape
    local = ids - first                                              # [T, k]
    w32 = weights.float()
    out = torch.zeros((T, D), dtype=torch.float32, device=x.device)
    if scales is not None:
        scales = fp8.expert_scales(gate, up, down, scales)
    for e in range(gate.shape[0]):
        w_e = torch.where(local == e, w32, torch.zeros_like(w32)).sum(-1)   # [T]
        g, u, d = gate[e], up[e], down[e]
        if scales is not None:
            g, u, d = (fp8.dequantize(w[e], s[e], x.dtype)
                       for w, s in zip((gate, up, down), scales))
        h = F.silu(x @ g.t()) * (x @ u.t())                                 # [T, I]
        out += (h @ d.t()).float() * w_e[:, None]
    return out.to(x.dtype)
