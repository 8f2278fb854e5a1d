"""The MoE of ONE token on Hopper as one persistent, warp-specialised Gluon launch: routed and
shared experts, gate/up and down (the device code and its design: gluon_moe_kernel.py).

    moe_row(x [1, D], gate, up [E, I, D], down [E, D, I], weights [1, k], ids [1, k], first,
            shared=None | (gate_s [Is, D], up_s [Is, D], down_s [D, Is])) -> [1, D]

moe_decode's contract at T = 1; moe_decode takes it where `unsupported` says nothing and
`available` holds (module flag ENABLED: benches switch it). fp8 experts (block scales,
helix.layers.fp8) too: moe_row(..., scales=(gate_s, up_s, down_s), shared_scales=) (module flag
FP8; `available(device, scaled=True)` runs the fp8 self-check).

    moe_row_routed(a, residual, norm_w, eps, router_w, bias, spec, gate, up, down, first,
                   shared) -> (out, h, y, weights, ids)

the same launch with the router's (triton_router.route_add_norm_triton) inside it: the
post-attention add + norm, the logits, the top-k choice (gluon_route). MoE.add_norm_forward
takes it at one row where `route_unsupported` says nothing (module flag ROUTED).

Why: at one row the two Triton launches (moe_decode) stream 138 MB a DeepSeek-V2-Lite layer at
79 % (gate/up) and 62 % (down) of the copy rate. Each launch ramps up, drains, and waits for the
kernel before it; a persistent Triton kernel holding both halves was slower still, since its
~250 registers a thread left one program an SM with one item's loads in flight
(profiling/results/step_small.md). Here a 1-warp producer keeps STAGES x 16 KB of weight tiles
in flight per SM through TMA, whatever the consumer is waiting for.

The plan (`plan`, from shapes only, so one CUDA graph serves every routing): gate/up items of BN
features of one slot, down items of 2 BN output features over every slot; the gate/up items
balanced on their own (the barrier between the phases waits for the last), then each down item
to the program with the least work (in stages of 4 x BN x BK weights); at most one program an
SM (the barrier needs every program resident).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import torch

from helix import triton_util
from helix.attention.triton_splits import sm_count_of
from helix.layers import fp8
from helix.triton_util import pow2

BN = 8                       # rows of a box: a gate/up item's features, half a down item's
BK = 256                     # K elements of a box (512 bytes; unswizzled: CUDA-core reads)
STAGES = 8                   # ring stages of four boxes: 128 KB of weights in flight an SM
STAGES_FP8 = 16              # fp8 weights: boxes of 256 bytes, the same 128 KB in flight
PRODUCER_REGS = 40           # the producer warp's registers (setmaxnreg)
ROUTER_REGS = 80             # the router warp's (gluon_route.choose: up to 8 experts a thread)
MAXNREG = 128                # registers a thread at launch: half the register file stays free
                             # for the next kernel's programs (alone: as fast as the compiler's
                             # 255, bench_moe_row)
NUM_WARPS = 4                # the consumer partition
NUM_WARPS_FP8 = 4            # ... with fp8 weights (twice the elements a byte to convert and
                             # multiply: the consumer, not the ring, bounds the stream; 8
                             # warps measured 1-2 % slower a step, fp8_row.md)
FIELDS = 4                   # int32 fields of an item (gluon_moe_kernel.ITEM_FIELDS)
ENABLED = True
FP8 = True                   # fp8 experts (block scales) take the launch too (benches switch it)
ROUTED = True                # the router in the launch (moe_row_routed) where MoE can (benches)
TRACE = False                # benches: each launch's phase stamps (STAMPS, ns of the global
TRACES: list = []            # timer), int64 [programs, 8] a launch, appended per launch call
STAMPS = ("start", "x", "shared", "ids", "up", "down_start", "end", "producer_ids")


@dataclasses.dataclass(frozen=True)
class Plan:
    items: tuple            # per program: ((kind, slot, n0), ...), gate/up (kind 0) first
    h_rows: int             # rows of BK in the h buffer

    @property
    def programs(self) -> int:
        return len(self.items)

    @property
    def max_items(self) -> int:
        return max(len(p) for p in self.items)

    def counts(self, topk: int) -> list[tuple[int, int, int]]:
        """Per program: (its leading shared gate/up items, gate/up items, down items)."""
        out = []
        for lst in self.items:
            up = [it for it in lst if it[0] == 0]
            lead = next((i for i, it in enumerate(up) if it[1] != topk), len(up))
            out.append((lead, len(up), len(lst) - len(up)))
        return out


def k_steps(width: int) -> int:
    """Stages over a K of `width` (2 BK of K a stage): a gate/up item's over D, a slot's in a
    down item."""
    return -(-width // (2 * BK))


@functools.lru_cache(maxsize=64)
def plan(topk: int, inter: int, shared_width: int, dim: int, sm_count: int, bn: int = BN) -> Plan:
    """Items of one launch (module doc); slot topk is the shared experts (width shared_width,
    0: none); bn: BN (benches vary the module's). Work in ring stages: a gate/up item
    k_steps(D), a down item the sum of every slot's k_steps(width). Every down item waits for
    the last gate/up item of the launch (the barrier between the phases), so the gate/up items
    are balanced first, on their own (each to the program with the least gate/up work so far),
    then each down item goes to the program with the least work in all. A program's list holds
    its gate/up items (the shared ones first: the producer loads them before the wait for the
    router), then its down items."""
    slots = ([topk] if shared_width else []) + list(range(topk))
    width = {s: shared_width if s == topk else inter for s in slots}
    up = [(0, s, n0) for s in slots for n0 in range(0, width[s], bn)]
    down = [(1, 0, n0) for n0 in range(0, dim, 2 * bn)]
    cost = {0: k_steps(dim), 1: sum(k_steps(width[s]) for s in slots)}
    programs = min(sm_count, len(up) + len(down))
    lists = [[] for _ in range(programs)]
    loads = [0] * programs
    for phase in (up, down):
        heap = [(loads[p], p) for p in range(programs)]
        heapq.heapify(heap)
        for it in phase:
            load, p = heapq.heappop(heap)
            lists[p].append(it)
            loads[p] = load + cost[it[0]]
            heapq.heappush(heap, (loads[p], p))
    h_rows = 2 * k_steps(shared_width) + topk * 2 * k_steps(inter)
    return Plan(items=tuple(tuple(x) for x in lists), h_rows=h_rows)


_TABLES: dict = {}


def _tables(p: Plan, topk: int, device: torch.device):
    """(items [G, L, FIELDS] int32, counts [G, 3] int32) on `device`, kept for the process (a
    captured graph holds their addresses)."""
    key = (p, topk, device)
    if key not in _TABLES:
        items = torch.zeros((p.programs, p.max_items, FIELDS), dtype=torch.int32)
        for g, lst in enumerate(p.items):
            if lst:
                items[g, :len(lst), :3] = torch.tensor(lst, dtype=torch.int32)
        counts = torch.tensor(p.counts(topk), dtype=torch.int32)
        _TABLES[key] = (items.to(device), counts.to(device))
    return _TABLES[key]


SMEM_LIMIT = 232448          # bytes of shared memory a block may use on sm_90
SMEM_SLACK = 1024            # barriers, the router's choice, alignment (compiled: < 600 bytes)


def smem_bytes(topk: int, inter: int, shared_width: int, dim: int, weight_bytes: int,
               row_bytes: int, stages: int | None = None) -> int:
    """Shared memory of a launch: the ring (`stages` of four boxes; None: the full ring, 128 KB
    either weight width), x as rows of BK and the h buffer (fp32) as rows of BK, both rounded up
    to a power of two rows (the kernel's XR / HR: shared-memory shapes are powers of two), plus
    SMEM_SLACK. DeepSeek-V3's layer (D 7168, top-8, I 2048) needs ~279 KB with the full ring:
    its h buffer is 72 rows, allocated as 128."""
    if stages is None:
        stages = _full_ring(weight_bytes)
    h_rows = 2 * k_steps(shared_width) + topk * 2 * k_steps(inter)
    return (4 * stages * BN * BK * weight_bytes + pow2(2 * k_steps(dim)) * BK * row_bytes
            + pow2(h_rows) * BK * 4 + SMEM_SLACK)


def _full_ring(weight_bytes: int) -> int:
    """Stages of the full ring (128 KB in flight) for weights of weight_bytes an element."""
    return STAGES_FP8 if weight_bytes == 1 else STAGES


def ring_stages(topk: int, inter: int, shared_width: int, dim: int, weight_bytes: int,
                row_bytes: int = 2) -> int:
    """Stages of the weight ring a layer's launch takes: the full ring (STAGES, STAGES_FP8 for
    fp8) where it fits beside x and the h buffer, else 3/4 or 1/2 of it (64 KB in flight an SM:
    DeepSeek-V3's layer), else 0 (does not fit). The ring at 4 of 8 stages cost DeepSeek-V2-Lite's
    step ~1 % (profiling/results/moe_row/moerow_stages_dsv2_aafda7d.json), less than the
    two-launch path it replaces."""
    return _ring_stages(topk, inter, shared_width, dim, weight_bytes, row_bytes,
                        _full_ring(weight_bytes))


@functools.lru_cache(maxsize=64)
def _ring_stages(topk, inter, shared_width, dim, weight_bytes, row_bytes, full) -> int:
    """ring_stages for a full ring of `full` stages (a key of the cache: benches set STAGES)."""
    for stages in (full, full * 3 // 4, full // 2):
        if smem_bytes(topk, inter, shared_width, dim, weight_bytes, row_bytes,
                      stages) <= SMEM_LIMIT:
            return stages
    return 0


def layer_unfit(topk: int, dim: int, inter: int, shared_width: int, weight_bytes: int,
                row_bytes: int = 2) -> str | None:
    """Why a MoE layer's shapes do not fit the launch (None: they do; the planner's rule too):
    D whole K steps of BK, every expert width (the routed I, the shared shard's, 0: none) whole
    feature blocks of BN and whole 16 bytes (a down row's TMA stride), the shared memory
    (smem_bytes) within SMEM_LIMIT with at least half the ring (ring_stages)."""
    widths = [inter] + ([shared_width] if shared_width else [])
    if dim % BK or any(w % BN or w * weight_bytes % 16 for w in widths):
        return (f"dims D {dim}, I {widths} (D a multiple of {BK}, widths of {BN} and of 16 "
                f"bytes)")
    if not ring_stages(topk, inter, shared_width, dim, weight_bytes, row_bytes):
        need = smem_bytes(topk, inter, shared_width, dim, weight_bytes, row_bytes,
                          _full_ring(weight_bytes) // 2)
        return (f"{need} bytes of shared memory for D {dim}, top-{topk}, widths {widths} "
                f"with half the ring (limit {SMEM_LIMIT})")
    return None


def unsupported(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                shared=None, scales=None, shared_scales=None, *, topk: int) -> str | None:
    """Why this call cannot run the one-row launch (None: it can) for a row routed to `topk`
    experts. Weights in the rows' 16-bit dtype, or block fp8 (helix.layers.fp8) with their
    scales: `scales` (gate_s, up_s, down_s) [E, cdiv(n, 128), cdiv(k, 128)] and, with shared
    experts, `shared_scales` of theirs."""
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    if x.shape[0] != 1:
        return f"{x.shape[0]} rows (the launch takes one)"
    scaled = fp8.is_fp8(gate)
    wdtype = fp8.DTYPE if scaled else x.dtype
    if x.dtype not in (torch.bfloat16, torch.float16) or gate.dtype != wdtype:
        return f"dtype {x.dtype} / {gate.dtype} (16-bit rows; weights of their dtype or fp8)"
    E, inter, dim = gate.shape
    ws = [gate, up, down] + (list(shared) if shared is not None else [])
    if any(not w.is_contiguous() or w.dtype != wdtype or w.data_ptr() % 16 for w in ws):
        return "weights not contiguous, 16-byte aligned and of one dtype"
    if scaled:
        why = _scales_unsupported(gate, up, down, shared, scales, shared_scales)
        if why:
            return why
    elif scales is not None or shared_scales is not None:
        return "block scales with 16-bit weights"
    why = layer_unfit(topk, dim, inter, shared[0].shape[0] if shared is not None else 0,
                      gate.element_size(), x.element_size())
    if why:
        return why
    if E * max(inter, dim) >= 2**31:
        return "TMA coordinates past int32"
    return None


def _scales_unsupported(gate, up, down, shared, scales, shared_scales) -> str | None:
    """Why fp8 weights' scales do not fit the launch (None: they do): fp32, contiguous (the
    kernel indexes their grids from the shapes), of the weights' block grids."""
    grids = list(zip((gate, up, down), scales or ()))
    if scales is None or len(scales) != 3:
        return "fp8 experts without their block scales (gate_s, up_s, down_s)"
    if shared is not None:
        if shared_scales is None or len(shared_scales) != 3:
            return "fp8 shared experts without their block scales"
        grids += [(w[None], s[None]) for w, s in zip(shared, shared_scales)]
    for w, s in grids:
        want = (w.shape[0], fp8.blocks(w.shape[1]), fp8.blocks(w.shape[2]))
        if s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
            return f"block scales {s.dtype} {tuple(s.shape)}: want contiguous float32 {want}"
    return None


def moe_row(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            weights: torch.Tensor, ids: torch.Tensor, first: int, shared=None, scales=None,
            shared_scales=None) -> torch.Tensor:
    """moe_decode's contract at T = 1 (module doc), on the Gluon launch; fp8 weights with their
    block scales (`unsupported`)."""
    why = unsupported(x, gate, up, down, shared, scales, shared_scales, topk=ids.shape[-1])
    if why:
        raise ValueError(f"gluon one-row MoE: {why}; use moe_decode's Triton kernels")
    out = torch.empty_like(x)
    _launch(x, gate, up, down, weights, ids, first, shared, out, ids.shape[-1],
            scales=_all_scales(scales, shared_scales))
    return out


def _all_scales(scales, shared_scales):
    """The kernel's six scale grids (routed gate, up, down, then the shared experts'; the
    routed ones again where there are none: never read), or None for 16-bit weights."""
    if scales is None:
        return None
    return tuple(scales) + tuple(shared_scales if shared_scales is not None else scales)


def moe_row_routed(a: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                   router_w: torch.Tensor, bias: torch.Tensor | None, spec, gate: torch.Tensor,
                   up: torch.Tensor, down: torch.Tensor, first: int, shared=None, scales=None,
                   shared_scales=None):
    """The router's launch and moe_row's in one (gluon_route): from the attention output a and
    the residual [1, D] -> (out [1, D] this rank's MoE, h = residual + a [1, D] the next
    residual, y = rms_norm(h) * norm_w [1, D], weights [1, k], ids [1, k] int64): the values of
    triton_router.route_add_norm_triton then moe_row. spec: triton_router.RouteSpec; fp8
    weights with their block scales as for moe_row."""
    why = (unsupported(a, gate, up, down, shared, scales, shared_scales, topk=spec.k)
           or route_unsupported(a, residual, norm_w, router_w, bias, spec))
    if why:
        raise ValueError(f"gluon one-row MoE with its router: {why}; use the router kernel "
                         "and moe_decode")
    h, y, out = torch.empty_like(a), torch.empty_like(a), torch.empty_like(a)
    weights = torch.empty((1, spec.k), dtype=a.dtype, device=a.device)
    ids = torch.empty((1, spec.k), dtype=torch.int64, device=a.device)
    route = (residual, norm_w, eps, router_w, bias, spec, h, y)
    _launch(a, gate, up, down, weights, ids, first, shared, out, spec.k, route,
            _all_scales(scales, shared_scales))
    return out, h, y, weights, ids


MAX_ROUTE_TILE = 1024         # experts in the router's [groups, experts a group] choice tile


def route_fits(num_experts: int, groups: int) -> bool:
    """The routing shape rule: whole groups, the [groups, experts a group] tile (powers of
    two) at most MAX_ROUTE_TILE."""
    return (num_experts % groups == 0
            and pow2(groups) * pow2(num_experts // groups) <= MAX_ROUTE_TILE)


def route_unsupported(a, residual, norm_w, router_w, bias, spec) -> str | None:
    """Why the router cannot ride in the launch (None: it can): the rows, the residual and the
    norm weight in the experts' dtype (so h and y are), a contiguous router weight [NE, D] in
    fp32 or that dtype, a contiguous fp32 bias, the choice tile at most MAX_ROUTE_TILE."""
    NE = router_w.shape[0]
    if residual.shape != a.shape or norm_w.shape != a.shape[-1:]:
        return (f"residual {tuple(residual.shape)} / norm weight {tuple(norm_w.shape)} for "
                f"rows {tuple(a.shape)}")
    if residual.dtype != a.dtype or norm_w.dtype != a.dtype:
        return "residual or norm weight not of the rows' dtype"
    if not all(t.is_contiguous() for t in (a, residual, norm_w, router_w)):
        return "rows, residual, norm or router weight not contiguous"
    if router_w.dtype not in (torch.float32, a.dtype) or router_w.shape[1] != a.shape[-1]:
        return f"router weight {router_w.dtype} {tuple(router_w.shape)}"
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return "router bias not contiguous fp32"
    if not route_fits(NE, spec.groups):
        return f"{NE} experts in {spec.groups} groups"
    if NE * a.shape[-1] >= 2**31:
        return "router offsets past int32"
    return None


def _route_meta(spec, NE: int, has_bias: bool) -> dict:
    """The launch's ROUTE constexprs: RSPEC (gluon_route.choose's tuple) with its choice tile's
    layout, one warp over [1, groups, experts a group]."""
    from triton.experimental.gluon import language as gl
    from helix.layers.triton_router import _RULES
    bg, beg = pow2(spec.groups), pow2(NE // spec.groups)
    te = min(32, beg)
    layout = gl.BlockedLayout([1, 1, max(1, beg // 32)], [1, 32 // te, te], [1, 1, 1],
                              [2, 1, 0])
    return dict(ROUTE=1, ROUTER_REGS=ROUTER_REGS,
                RSPEC=(int(spec.sigmoid), _RULES[spec.group_rule], spec.topk_group,
                       int(spec.norm), int(has_bias), bg, beg, layout))


def _launch(x, gate, up, down, weights, ids, first, shared, out, topk, route=None, scales=None):
    """One moe_row_kernel launch; route: (residual, norm_w, eps, router_w, bias, spec, h, y)
    with x the attention output and weights / ids outputs, or None (x the normed rows, weights
    / ids the router's); scales: fp8 weights' six block-scale grids (_all_scales) or None."""
    from helix.layers.gluon_moe_kernel import moe_row_kernel
    E, inter, dim = gate.shape
    ws = shared[0].shape[0] if shared is not None else 0
    p = plan(topk, inter, ws, dim, sm_count_of(x.device), BN)
    items, counts = _tables(p, topk, x.device)
    descs = _descriptors(gate, up, down, shared)
    h = torch.empty((p.h_rows * BK,), dtype=torch.float32, device=x.device)
    meta = {}
    if route is None:
        rargs = (x, x, x, h, x, x, x, 1.0, 0.0, 1, 1, 1, 1.0)
    else:
        residual, norm_w, eps, router_w, bias, spec, h_new, y = route
        NE = router_w.shape[0]
        logits = torch.empty((NE,), dtype=torch.float32, device=x.device)
        rargs = (residual.reshape(-1), norm_w, router_w, bias if bias is not None else logits,
                 logits, h_new.reshape(-1), y.reshape(-1), 1.0 / dim, float(eps), NE,
                 NE // spec.groups, spec.groups, spec.scaling)
        meta = _route_meta(spec, NE, bias is not None)
    counters = triton_util.arrival_counters(x.device, 3)
    stages = ring_stages(topk, inter, ws, dim, gate.element_size(), x.element_size())
    if TRACE:       # every program writes every stamp; in a capture: the graph's buffer
        TRACES.append(torch.empty((p.programs, 8), dtype=torch.int64, device=x.device))
    triton_util.run_kernel(
        moe_row_kernel, (p.programs,), x.reshape(-1), ids.reshape(-1), weights.reshape(-1),
        first, E, inter, dim, ws, *descs, *(scales or (x,) * 6), items, counts, p.programs,
        p.max_items, h, out,
        counters, TRACES[-1] if TRACE else counters, *rargs, TOPK=topk, TK=max(2, pow2(topk)),
        SHARED=int(ws > 0),
        XR=pow2(2 * k_steps(dim)), HR=pow2(p.h_rows), BN=BN, BK=BK,
        STAGES=stages,
        SCALED=int(scales is not None), TRACE=int(TRACE),
        PRODUCER_REGS=PRODUCER_REGS, num_warps=NUM_WARPS if scales is None else NUM_WARPS_FP8,
        **({"maxnreg": MAXNREG} if MAXNREG else {}), **meta)


def _descriptors(gate, up, down, shared):
    """TMA descriptors of [BN, BK] boxes: gate, up as [E * I, D], down as [E * D, I], the
    shared shard's three (the routed ones again where there is none: never read)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * gate.element_size(),
                                  rank=2)

    def desc(m):
        m = m.reshape(-1, m.shape[-1])
        return TensorDescriptor(m, list(m.shape), list(m.stride()), [BN, BK], layout)

    routed = [desc(gate), desc(up), desc(down)]
    return routed + ([desc(w) for w in shared] if shared is not None else routed)


_STATUS: dict = {}


def available(device: torch.device, scaled: bool = False) -> bool:
    """sm_90, Gluon importable, and the launch matched the torch reference on a small case with
    shared experts (once per device and weight format, 16-bit or, `scaled`, block fp8; outside
    CUDA-graph capture: during a capture before the check it answers False)."""
    return _status(device, scaled)[0]


def why_unavailable(device: torch.device, scaled: bool = False) -> str:
    return _status(device, scaled)[1]


def _status(device: torch.device, scaled: bool = False) -> tuple[bool, str]:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, scaled)
    if key in _STATUS:
        return _STATUS[key]
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "not a CUDA device"
    if torch.cuda.is_current_stream_capturing():
        return False, "not checked yet (a CUDA graph is being captured)"
    if torch.cuda.get_device_capability(device) != (9, 0):
        res = False, f"compute capability {torch.cuda.get_device_capability(device)} (sm_90)"
    else:
        try:
            res = self_check(device, scaled=scaled)
        except Exception as e:  # noqa: BLE001 - a compile or launch error means "not available"
            res = False, f"{type(e).__name__}: {str(e)[:2000]}"
    _STATUS[key] = res
    return res


def reference(x, gate, up, down, weights, ids, first, shared=None, scales=None,
              shared_scales=None) -> torch.Tensor:
    """fp32 torch: the routed experts of x's one row, weighted, plus the shared MLP (fp8
    weights: dequantized by their block scales)."""
    import torch.nn.functional as F
    if scales is not None:
        gate, up, down = (fp8.dequantize(w, s, torch.float32) for w, s in zip((gate, up, down),
                                                                             scales))
        if shared is not None:
            shared = tuple(fp8.dequantize(w, s, torch.float32)
                           for w, s in zip(shared, shared_scales))
    xf = x.float()
    out = torch.zeros_like(xf)
    for j, gid in enumerate(ids.reshape(-1).tolist()):
        e = gid - first
        if 0 <= e < gate.shape[0]:
            h = F.silu(xf @ gate[e].float().t()) * (xf @ up[e].float().t())
            out += weights.reshape(-1)[j].float() * (h @ down[e].float().t())
    if shared is not None:
        gs, us, ds = (w.float() for w in shared)
        out += (F.silu(xf @ gs.t()) * (xf @ us.t())) @ ds.t()
    return out


def self_check(device: torch.device, seed: int = 0, scaled: bool = False) -> tuple[bool, str]:
    """A small case (8 experts, I 256, D 256, top-3, one of them not on this rank, shared width
    512) against `reference`; then the same layer with its router (12 experts, softmax) against
    torch's add + norm, route_torch and `reference`. scaled: the weights in block fp8
    (fp8.quantize), with their scales."""
    import torch.nn.functional as F

    from helix.layers.router import route_torch
    from helix.layers.triton_router import RouteSpec
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(device, torch.bfloat16)

    def close(out, ref, what):
        err = (out.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        ok = err <= 2e-2 * max(scale, 1e-3)
        return ok, "" if ok else f"self-check {what}: max |err| {err:.3g} at scale {scale:.3g}"

    E, inter, dim, first = 8, 256, 256, 4
    gate, up, down = rand(E, inter, dim), rand(E, inter, dim), rand(E, dim, inter)
    shared = (rand(512, dim), rand(512, dim), rand(dim, 512))
    sc = {}
    if scaled:
        q = [fp8.quantize(w) for w in (gate, up, down)]
        qs = [fp8.quantize(w) for w in shared]
        gate, up, down = (b.weight for b in q)
        shared = tuple(b.weight for b in qs)
        sc = dict(scales=tuple(b.scale for b in q), shared_scales=tuple(b.scale for b in qs))
    x = rand(1, dim) * 20
    ids = torch.tensor([[9, 2, 6]], dtype=torch.int32, device=device)   # 2: not local
    weights = torch.tensor([[0.5, 0.3, 0.2]], device=device)
    out = moe_row(x, gate, up, down, weights, ids, first, shared, **sc)
    ok, why = close(out, reference(x, gate, up, down, weights, ids, first, shared, **sc),
                    "mismatch")
    if not ok:
        return ok, why
    spec = RouteSpec(k=3, sigmoid=False, groups=1, topk_group=1, group_rule="none",
                     norm=True, scaling=1.0)
    router = rand(12, dim).float() * 20
    a, res, norm_w = rand(1, dim) * 20, rand(1, dim) * 20, 1.0 + rand(dim)
    out, h, y, w, ids = moe_row_routed(a, res, norm_w, 1e-6, router, None, spec, gate, up, down,
                                       first, shared, **sc)
    y_ref = F.rms_norm((a.float() + res.float()).to(a.dtype).float(), (dim,), eps=1e-6)
    y_ref = (y_ref.to(a.dtype).float() * norm_w.float())
    w_ref, ids_ref = route_torch(y.float() @ router.t(), None, spec)
    if not (torch.equal(ids, ids_ref) and torch.allclose(w.float(), w_ref, rtol=1e-2)):
        return False, f"self-check routing: ids {ids.tolist()} for {ids_ref.tolist()}"
    ok, why = close(y, y_ref, "norm")
    return (ok, why) if not ok else close(out, reference(y, gate, up, down, w, ids, first,
                                                         shared, **sc), "routed mismatch")
