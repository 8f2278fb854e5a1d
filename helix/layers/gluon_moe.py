"""The MoE of ONE token on Hopper as one persistent, warp-specialised Gluon launch: routed and
shared experts, gate/up and down (the device code and its design: gluon_moe_kernel.py).

    moe_row(x [1, D], gate, up [E, I, D], down [E, D, I], weights [1, k], ids [1, k], first,
            shared=None | (gate_s [Is, D], up_s [Is, D], down_s [D, Is])) -> [1, D]

moe_decode's contract at T = 1; moe_decode takes it where `unsupported` says nothing and
`available` holds (module flag ENABLED: benches switch it).

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
from helix.triton_util import pow2

BN = 8                       # rows of a box: a gate/up item's features, half a down item's
BK = 256                     # K elements of a box (512 bytes; unswizzled: CUDA-core reads)
STAGES = 8                   # ring stages of four boxes: 128 KB of weights in flight an SM
PRODUCER_REGS = 40           # the producer warp's registers (setmaxnreg)
MAXNREG = 128                # registers a thread at launch: half the register file stays free
                             # for the next kernel's programs (alone: as fast as the compiler's
                             # 255, bench_moe_row)
NUM_WARPS = 4                # the consumer partition
FIELDS = 4                   # int32 fields of an item (gluon_moe_kernel.ITEM_FIELDS)
ENABLED = True


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


def shape_fits(dim: int, inter: int, shared_width: int = 0) -> bool:
    """The launch's shape rule (16-bit weights): D whole K steps of BK, every expert width (the
    routed I, the shared shard's) whole features blocks of BN (rows 16-byte aligned with it)."""
    return dim % BK == 0 and all(w % BN == 0 for w in (inter, shared_width))


def unsupported(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                shared=None) -> str | None:
    """Why this call cannot run the one-row launch (None: it can)."""
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    if x.shape[0] != 1:
        return f"{x.shape[0]} rows (the launch takes one)"
    if x.dtype not in (torch.bfloat16, torch.float16) or gate.dtype != x.dtype:
        return f"dtype {x.dtype} / {gate.dtype} (16-bit weights and rows)"
    E, inter, dim = gate.shape
    ws = [gate, up, down] + (list(shared) if shared is not None else [])
    if any(not w.is_contiguous() or w.dtype != x.dtype or w.data_ptr() % 16 for w in ws):
        return "weights not contiguous, 16-byte aligned and of the rows' dtype"
    widths = [inter] + ([shared[0].shape[0]] if shared is not None else [])
    if not shape_fits(dim, *widths):
        return f"dims D {dim}, I {widths} (D a multiple of {BK}, widths of {BN})"
    if E * max(inter, dim) >= 2**31:
        return "TMA coordinates past int32"
    return None


def moe_row(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            weights: torch.Tensor, ids: torch.Tensor, first: int, shared=None) -> torch.Tensor:
    """moe_decode's contract at T = 1 (module doc), on the Gluon launch."""
    from helix.layers.gluon_moe_kernel import moe_row_kernel
    why = unsupported(x, gate, up, down, shared)
    if why:
        raise ValueError(f"gluon one-row MoE: {why}; use moe_decode's Triton kernels")
    E, inter, dim = gate.shape
    topk = ids.shape[-1]
    ws = shared[0].shape[0] if shared is not None else 0
    p = plan(topk, inter, ws, dim, sm_count_of(x.device), BN)
    items, counts = _tables(p, topk, x.device)
    descs = _descriptors(gate, up, down, shared)
    h = torch.empty((p.h_rows * BK,), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    counters = triton_util.arrival_counters(x.device, 2)
    triton_util.run_kernel(
        moe_row_kernel, (p.programs,), x.reshape(-1), ids.reshape(-1), weights.reshape(-1),
        first, E, inter, dim, ws, *descs, items, counts, p.programs, p.max_items, h, out,
        counters, TOPK=topk, TK=max(2, pow2(topk)), SHARED=int(ws > 0), XR=pow2(2 * k_steps(dim)),
        HR=pow2(p.h_rows), BN=BN, BK=BK, STAGES=STAGES, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=NUM_WARPS, **({"maxnreg": MAXNREG} if MAXNREG else {}))
    return out


def _descriptors(gate, up, down, shared):
    """TMA descriptors of [BN, BK] boxes: gate, up as [E * I, D], down as [E * D, I], the
    shared shard's three (the routed ones again where there is none: never read)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)

    def desc(m):
        m = m.reshape(-1, m.shape[-1])
        return TensorDescriptor(m, list(m.shape), list(m.stride()), [BN, BK], layout)

    routed = [desc(gate), desc(up), desc(down)]
    return routed + ([desc(w) for w in shared] if shared is not None else routed)


_STATUS: dict = {}


def available(device: torch.device) -> bool:
    """sm_90, Gluon importable, and the launch matched the torch reference on a small case with
    shared experts (once per device, outside CUDA-graph capture: during a capture before the
    check it answers False)."""
    return _status(device)[0]


def why_unavailable(device: torch.device) -> str:
    return _status(device)[1]


def _status(device: torch.device) -> tuple[bool, str]:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device in _STATUS:
        return _STATUS[device]
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "not a CUDA device"
    if torch.cuda.is_current_stream_capturing():
        return False, "not checked yet (a CUDA graph is being captured)"
    if torch.cuda.get_device_capability(device) != (9, 0):
        res = False, f"compute capability {torch.cuda.get_device_capability(device)} (sm_90)"
    else:
        try:
            res = self_check(device)
        except Exception as e:  # noqa: BLE001 - a compile or launch error means "not available"
            res = False, f"{type(e).__name__}: {str(e)[:2000]}"
    _STATUS[device] = res
    return res


def reference(x, gate, up, down, weights, ids, first, shared=None) -> torch.Tensor:
    """fp32 torch: the routed experts of x's one row, weighted, plus the shared MLP."""
    import torch.nn.functional as F
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


def self_check(device: torch.device, seed: int = 0) -> tuple[bool, str]:
    """A small case (8 experts, I 256, D 256, top-3, one of them not on this rank, shared width
    512) against `reference`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(device, torch.bfloat16)

    E, inter, dim, first = 8, 256, 256, 4
    gate, up, down = rand(E, inter, dim), rand(E, inter, dim), rand(E, dim, inter)
    shared = (rand(512, dim), rand(512, dim), rand(dim, 512))
    x = rand(1, dim) * 20
    ids = torch.tensor([[9, 2, 6]], dtype=torch.int32, device=device)   # 2: not local
    weights = torch.tensor([[0.5, 0.3, 0.2]], device=device)
    out = moe_row(x, gate, up, down, weights, ids, first, shared)
    ref = reference(x, gate, up, down, weights, ids, first, shared)
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    ok = err <= 2e-2 * max(scale, 1e-3)
    return ok, "" if ok else f"self-check mismatch: max |err| {err:.3g} at scale {scale:.3g}"
