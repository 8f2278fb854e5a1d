"""The analytical decode-step model behind `helix plan`: step time, throughput and KV capacity of
a model in a layout on a hardware file, and the ranking of every valid layout of N GPUs.

Step time of the busiest rank (helix.perf.cost gives each phase's bytes, FLOPs, kernels and
collectives):

    phase   = kernels * kernel_us + max(bytes / read rate, FLOPs / matmul rate)
              (attention: GQA reads at gqa_attention_efficiency of the read rate, absorbed MLA
              computes at mla_attention_efficiency of the matmul rate, fp8 experts stream at
              fp8_expert_efficiency of it: the measured kernels)
    comm    = every collective at latency + hops + wire bytes / bus bandwidth, exposed, except
              the KVP all-to-all under HOP-B (below)
    step    = graph_step_factor * sum over phases (phase + exposed comm)

HOP-B with M micro-batches: attention and its exchange run per micro-batch of B/M requests.
The bytes and FLOPs of attention do not change, its kernels run M times; the exchange of
micro-batch i (c = one all-to-all of 1/M of the buffer) hides under the attention of
micro-batch i + 1, so exposed = c + (M - 1) * max(0, c - attention / M): only the last
exchange is always exposed. M = 1 is the plain step.

Capacity: (hbm_gib - reserve_gib) minus the rank's weights, divided by the KV bytes one request
needs on the busiest rank (its pages there, `KVSharding.max_pages`, times page size times KV
bytes per position over all layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helix.config import Layout, ModelConfig
from helix.errors import ConfigError
from helix.kv.ownership import KVSharding
from helix.perf.cost import StepCost, step_cost
from helix.perf.hardware import Hardware

GIB = 2**30


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    hopb: int
    batch: int
    context: int
    step_ms: float            # predicted decode step (graphed)
    kernel_ms: float          # sum of the phases' kernel time (no collectives)
    comm_ms: float            # exposed collective time
    floor_ms: float           # roofline floor at the hardware's rates (no overheads)
    weight_gib: float         # weights per GPU
    kv_gib: float             # KV of this batch x context on the busiest GPU
    max_batch: int            # most requests of this context that fit
    max_context: int          # longest context that fits at this batch (0: none)
    phases_ms: dict = field(default_factory=dict)

    weights_fit: bool = True  # the weights alone leave room for KV

    @property
    def fits(self) -> bool:
        return self.batch <= self.max_batch

    @property
    def tokens_per_s_user(self) -> float:
        return 1e3 / self.step_ms

    @property
    def tokens_per_s_gpu(self) -> float:
        return self.batch * 1e3 / self.step_ms / self.layout.world_size

    def as_dict(self) -> dict:
        return {"layout": self.layout.as_dict(), "hopb": self.hopb, "batch": self.batch,
                "context": self.context, "step_ms": self.step_ms, "kernel_ms": self.kernel_ms,
                "comm_ms": self.comm_ms, "floor_ms": self.floor_ms,
                "tokens_per_s_user": self.tokens_per_s_user,
                "tokens_per_s_gpu": self.tokens_per_s_gpu, "weight_gib": self.weight_gib,
                "kv_gib": self.kv_gib, "max_batch": self.max_batch,
                "max_context": self.max_context, "fits": self.fits,
                "weights_fit": self.weights_fit, "phases_ms": self.phases_ms}


def _phase_s(cfg: ModelConfig, phase, hw: Hardware, runs: int = 1, fp8: bool = False) -> float:
    """Kernel time of one occurrence of `phase`, its kernels launched `runs` times; fp8: the
    weights in fp8 (the experts' launches convert twice the elements a byte)."""
    read, mm = hw.read_bps, hw.flops
    if phase.name == "moe" and fp8:
        read *= hw.fp8_expert_efficiency
    if phase.name == "attention":
        if cfg.is_mla:
            mm *= hw.mla_attention_efficiency
        else:
            read *= hw.gqa_attention_efficiency
    return runs * phase.kernels * hw.kernel_us * 1e-6 + phase.roofline_s(read, mm)


def _comm_s(phase, hw: Hardware, attention_s: float, hopb: int) -> float:
    """Exposed collective seconds of one occurrence of `phase`."""
    total = 0.0
    for c in phase.comms:
        if c.kind == "all_to_all" and hopb > 1:
            one = hw.collective_s(c.kind, c.ranks, c.nbytes / hopb)
            total += one + (hopb - 1) * max(0.0, one - attention_s / hopb)
        else:
            total += hw.collective_s(c.kind, c.ranks, c.nbytes)
    return total


def kv_bytes_per_request(cost: StepCost, layout: Layout, context: int, page_size: int) -> float:
    """KV bytes one request of `context` positions takes on the busiest rank (whole pages)."""
    pages = KVSharding(layout.kvp, layout.kv_interleave, page_size).max_pages(context)
    return pages * page_size * cost.kv_bytes_per_position


def _max_context(cost: StepCost, layout: Layout, batch: int, free: float, page_size: int,
                 limit: int) -> int:
    """Longest context (<= limit) whose KV for `batch` requests fits in `free` bytes."""
    def fits(t):
        return batch * kv_bytes_per_request(cost, layout, t, page_size) <= free
    if not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def predict(cfg: ModelConfig, layout: Layout, batch: int, context: int, hw: Hardware,
            hopb: int = 1, dtype_bytes: int = 2, page_size: int = 64,
            context_limit: int = 1 << 24, kv_bytes: int | None = None,
            weight_es: float | None = None) -> Prediction:
    """Predicted graphed decode step of `batch` requests of `context` tokens (see module doc);
    kv_bytes: bytes of a cached KV element (None: dtype_bytes); weight_es: of a projection's or
    expert's weight element (None: dtype_bytes; fp8 weights: helix.layers.fp8.element_bytes)."""
    layout.validate(cfg)
    if hopb < 1 or batch < hopb:
        raise ConfigError(f"hopb={hopb} needs at least {hopb} requests in the batch (got {batch})")
    cost = step_cost(cfg, layout, batch, context, dtype_bytes, page_size, kv_bytes, weight_es)
    kern = comm = 0.0
    phases = {}
    fp8 = cost.meta["weight_bytes"] < dtype_bytes
    for p in cost.phases:
        runs = hopb if p.name == "attention" else 1
        t = _phase_s(cfg, p, hw, runs, fp8)
        c = _comm_s(p, hw, t, hopb)
        kern += p.count * t
        comm += p.count * c
        phases[p.name] = 1e3 * p.count * (t + c)
    step = hw.graph_step_factor * (kern + comm)
    free = hw.usable_bytes - cost.weight_bytes
    per_req = kv_bytes_per_request(cost, layout, context, page_size)
    max_batch = int(free // per_req) if free > 0 and per_req > 0 else 0
    return Prediction(layout=layout, hopb=hopb, batch=batch, context=context, step_ms=1e3 * step,
                      kernel_ms=1e3 * kern, comm_ms=1e3 * comm,
                      floor_ms=1e3 * cost.floor_s(hw.read_bps, hw.flops),
                      weight_gib=cost.weight_bytes / GIB, kv_gib=batch * per_req / GIB,
                      max_batch=max_batch,
                      max_context=_max_context(cost, layout, batch, free, page_size, context_limit)
                      if free > 0 else 0, phases_ms=phases, weights_fit=free > 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: ModelConfig, gpus: int, page_size: int = 64) -> list[Layout]:
    """Every layout of `gpus` ranks the model accepts: kvp x tpa = N (Helix layouts interleave
    KV by whole pages), and for MoE every tpf x ep = N."""
    out = []
    for kvp in _divisors(gpus):
        for ep in (_divisors(gpus) if cfg.is_moe else [1]):
            try:
                lay = Layout(kvp=kvp, tpa=gpus // kvp, ep=ep,
                             kv_interleave=page_size if kvp > 1 else 1)
                lay.validate(cfg)
            except ConfigError:
                continue
            out.append(lay)
    return out


def plan(cfg: ModelConfig, gpus: int, batch: int, context: int, hw: Hardware,
         hopbs: tuple[int, ...] = (1, 2, 4), dtype_bytes: int = 2,
         page_size: int = 64, kv_bytes: int | None = None,
         weight_es: float | None = None) -> list[Prediction]:
    """Predictions for every valid layout (x HOP-B depth where it has an exchange to hide and
    the batch splits), ranked: layouts that fit first, then by predicted step time.

    MoE layouts that differ only in tpf x ep predict alike here (the expected experts a rank
    reads do not depend on the split), so of those only the largest ep is kept."""
    layouts = candidate_layouts(cfg, gpus, page_size)
    if not layouts:
        raise ConfigError(f"no layout of {gpus} GPUs is valid for this model: use a GPU count "
                          f"that divides its {cfg.num_heads} query heads")
    rows: dict[tuple, Prediction] = {}
    for lay in sorted(layouts, key=lambda x: -x.ep):
        for m in (hopbs if lay.kvp > 1 else (1,)):
            if batch < m:
                continue
            p = predict(cfg, lay, batch, context, hw, m, dtype_bytes, page_size,
                        kv_bytes=kv_bytes, weight_es=weight_es)
            key = (lay.kvp, lay.tpa, m, round(p.step_ms, 9), round(p.weight_gib, 9))
            rows.setdefault(key, p)
    return sorted(rows.values(), key=lambda r: (not r.fits, r.step_ms))
