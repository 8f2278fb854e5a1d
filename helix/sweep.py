"""YAML latency sweeps: decode step time over models x layouts x batches x contexts.

    name: llama70b-4gpu           # a label, copied into every record
    model: llama-3.1-70b          # or `models: [a, b]`; presets, YAML files or checkpoint dirs
    layers: 4                     # first n layers (0: all)
    device: cuda                  # cpu | cuda (default: cuda when present)
    dtype: bfloat16               # default: bfloat16 on cuda, float32 on cpu
    kv_cache_dtype: fp8           # KV pool storage: auto (dtype) | fp8 (e4m3)
    quantization: fp8             # weights: auto (the checkpoint's) | fp8 (block fp8) | none
    layouts:                      # Layout fields; every layout must hold for every model
      - {kvp: 1, tpa: 4}
      - {kvp: 4, tpa: 1, kv_interleave: 16}
    batches: [1, 8, 32]
    contexts: [32768, 131072]     # prompt tokens per request (the KV each decode step reads)
    prefill: synthetic            # synthetic: the context's KV is taken as written (no prefill,
                                  # arbitrary values, read at full cost); real: run the prompt
    max_batch_tokens: 33554432    # skip points whose batch x context exceeds this (KV memory)
    decode_steps: 16              # timed steps (median and p90 reported)
    warmup_steps: 3
    cuda_graphs: true
    attention_backend: triton
    page_size: 64
    hopb: 2                       # only when RuntimeConfig has a hopb field (HOP-B micro-batches)

Every key is checked before anything runs; a mistake is one line naming the key and the fix.

Each point's record says what ran, read from the engine rather than from the request:
`cuda_graphs` is true only when the step replayed a captured graph (false on CPU and in the
eager fallback), `attention_backend` is the backend the engine resolved, `graph_breaks` the
regions that ran eagerly. Step times are the intervals between consecutive returns of
`LLM.step()` (the driver's broadcast to the other ranks included, so they add up to the wall
time); `engine_ms_median` is the rank-0 engine's own time per call, which leaves that broadcast
out (what records before this field called the step). `floor_ms` is the roofline floor of the
point (helix.perf.cost) at the rates measured once per sweep (helix.perf.rates: on CUDA the
GPU's copy, read and matmul rates; on CPU a quick CPU measurement), `floor_ratio` = step / floor.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
import yaml

from helix.config import Layout, RuntimeConfig
from helix.errors import ConfigError
from helix.kv.ownership import KVSharding
from helix.layers import fp8
from helix.perf.cost import step_cost
from helix.perf.records import record_key
from helix.perf.rates import Rates, measure

_KEYS = {"name", "model", "models", "layers", "device", "dtype", "layouts", "batches", "contexts",
         "decode_steps", "warmup_steps", "cuda_graphs", "attention_backend", "page_size", "seed",
         "prefill", "max_batch_tokens", "kv_cache_dtype", "quantization"}
# HOP-B depth, once the runtime has it
_OPTIONAL_RUNTIME = {"hopb"} & {f.name for f in dataclasses.fields(RuntimeConfig)}
_KEYS |= _OPTIONAL_RUNTIME
_LAYOUT_KEYS = {"kvp", "tpa", "tpf", "ep", "kv_interleave"}


@dataclass(frozen=True)
class Sweep:
    name: str
    models: tuple[str, ...]
    layouts: tuple[Layout, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    runtime: dict = field(default_factory=dict)   # RuntimeConfig fields shared by every run
    decode_steps: int = 16
    warmup_steps: int = 3
    prefill: str = "synthetic"
    max_batch_tokens: int = 0     # 0: no limit


def _ints(spec: dict, key: str, path: str) -> tuple[int, ...]:
    v = spec.get(key)
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and x > 0 for x in v):
        raise ConfigError(f"{path}: '{key}' must be a non-empty list of positive integers, "
                          f"e.g. {key}: [1, 8]")
    return tuple(v)


def load_sweep(path: str) -> Sweep:
    try:
        with open(path) as f:
            spec = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read sweep file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{at}: invalid YAML ({problem})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a sweep is a mapping of keys ({', '.join(sorted(_KEYS))})")
    unknown = set(spec) - _KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                          f"allowed: {', '.join(sorted(_KEYS))}")
    models = spec.get("models", [spec["model"]] if "model" in spec else None)
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        raise ConfigError(f"{path}: give 'model: NAME' or 'models: [NAME, ...]'")
    layouts = spec.get("layouts", [{}])
    if not isinstance(layouts, list) or not all(isinstance(x, dict) for x in layouts):
        raise ConfigError(f"{path}: 'layouts' must be a list of mappings, "
                          f"e.g. - {{kvp: 2, tpa: 1}}")
    for lay in layouts:
        bad = set(lay) - _LAYOUT_KEYS
        if bad:
            raise ConfigError(f"{path}: unknown layout key(s) {', '.join(sorted(map(str, bad)))}; "
                              f"allowed: {', '.join(sorted(_LAYOUT_KEYS))}")
    for key in ("layers", "page_size", "seed", "max_batch_tokens"):
        if key in spec and (not isinstance(spec[key], int) or isinstance(spec[key], bool)
                            or spec[key] < 0):
            raise ConfigError(f"{path}: '{key}' must be a non-negative integer, got {spec[key]!r}")
    if not isinstance(spec.get("cuda_graphs", True), bool):
        raise ConfigError(f"{path}: 'cuda_graphs' must be true or false")
    device = spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    runtime = dict(device=device,
                   dtype=spec.get("dtype") or ("bfloat16" if device == "cuda" else "float32"),
                   kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                   quantization=spec.get("quantization", "auto"),
                   layers=spec.get("layers", 0), cuda_graphs=spec.get("cuda_graphs", True),
                   attention_backend=spec.get("attention_backend", "auto"),
                   page_size=spec.get("page_size", 16), seed=spec.get("seed", 0),
                   prefix_caching=False,   # every point prefills its own prompts
                   **{k: spec[k] for k in _OPTIONAL_RUNTIME if k in spec})
    RuntimeConfig(**runtime)                        # validates device, dtype, backend, sizes
    prefill = spec.get("prefill", "synthetic")
    if prefill not in ("synthetic", "real"):
        raise ConfigError(f"{path}: 'prefill' must be synthetic or real, got {prefill!r}")
    steps, warm = spec.get("decode_steps", 16), spec.get("warmup_steps", 3)
    if not isinstance(steps, int) or steps < 1 or not isinstance(warm, int) or warm < 0:
        raise ConfigError(f"{path}: decode_steps must be >= 1 and warmup_steps >= 0 (integers)")
    return Sweep(name=str(spec.get("name", path)), models=tuple(models),
                 layouts=tuple(Layout(**lay) for lay in layouts),
                 batches=_ints(spec, "batches", path) if "batches" in spec else (1,),
                 contexts=_ints(spec, "contexts", path) if "contexts" in spec else (128,),
                 runtime=runtime, decode_steps=steps, warmup_steps=warm, prefill=prefill,
                 max_batch_tokens=spec.get("max_batch_tokens", 0))


def check(sweep: Sweep) -> None:
    """Every layout against every model, before any process starts."""
    from helix.loader import read_model_config
    for model in sweep.models:
        cfg, _ = read_model_config(model, sweep.runtime["layers"])
        for lay in sweep.layouts:
            lay.validate(cfg)


def points(sweep: Sweep) -> list[tuple[int, int]]:
    """(batch, context) of every point within the token budget."""
    return [(b, c) for b in sweep.batches for c in sweep.contexts
            if not sweep.max_batch_tokens or b * c <= sweep.max_batch_tokens]


def planned_points(sweep: Sweep,
                   done: frozenset = frozenset()) -> list[tuple[str, Layout, int, int]]:
    """(model, layout, batch, context) of every point still to run, in run order; `done` holds
    `record_key`s of points already recorded (resume)."""
    out = []
    for model in sweep.models:
        for layout in sweep.layouts:
            for b, c in points(sweep):
                key = record_key({"sweep": sweep.name, "model": model, "layout": layout.as_dict(),
                                  "batch": b, "context": c})
                if key not in done:
                    out.append((model, layout, b, c))
    return out


def _pool_pages(sweep: Sweep, layout: Layout) -> int:
    """KV pages per rank that hold every request of the largest batch x context point."""
    steps = sweep.warmup_steps + sweep.decode_steps
    sharding = KVSharding(layout.kvp, layout.kv_interleave, sweep.runtime.get("page_size", 16))
    return max(b * sharding.max_pages(c + steps + 2) for b, c in points(sweep))


def open_llm(sweep: Sweep, model: str, layout: Layout):
    """One engine for every point of (model, layout): sized for the largest batch and context
    (its KV pool for the largest batch x context point), graphs captured once per batch bucket."""
    from helix.runtime.llm import LLM
    pts = points(sweep)
    steps = sweep.warmup_steps + sweep.decode_steps
    max_batch = max(b for b, _ in pts)
    max_context = max(c for _, c in pts) + steps + 2
    rt = RuntimeConfig(max_batch=max_batch, max_context=max_context,
                       num_pages=_pool_pages(sweep, layout),
                       graph_buckets=tuple(sorted({b for b, _ in pts})), **sweep.runtime)
    return LLM(model, layout, rt)


def what_ran(llm, batch: int) -> dict:
    """What the engine really did for a step of `batch` rows (rank 0's engine; every rank
    builds the same)."""
    eng = llm.engine
    graphs = eng.graphs
    replayed = (graphs is not None and graphs.runner.use_graphs
                and graphs.ladder.choose(batch) is not None)
    return {"cuda_graphs": bool(replayed),
            "graph_breaks": sorted(graphs.needed_breaks) if replayed else [],
            "attention_backend": eng.backend.name, "overlap": bool(eng.overlap)}


def floor_fields(llm, layout: Layout, batch: int, context: int, step_ms: float,
                 rates: Rates | None) -> dict:
    """The point's roofline floor at the sweep's measured rates, and step / floor."""
    if rates is None:
        return {"floor_ms": None, "floor_ratio": None, "rates": None}
    rt = llm.runtime
    es = rt.torch_dtype.itemsize
    cost = step_cost(llm.cfg, layout, batch, context, es, rt.page_size,
                     kv_bytes=rt.torch_kv_dtype.itemsize,
                     weight_es=fp8.element_bytes(fp8.resolve(rt.quantization,
                                                             llm.cfg.quantization), es))
    floor = 1e3 * cost.floor_s(rates.hbm_bps, rates.matmul_flops)
    return {"floor_ms": floor, "floor_ratio": step_ms / floor if floor > 0 else None,
            "rates": rates.as_record()}


def run_point(sweep: Sweep, llm, model: str, layout: Layout, batch: int, context: int,
              rates: Rates | None = None, sampling: dict | None = None) -> dict:
    """Decode latency of `batch` requests holding `context` tokens each, on an open engine.
    sampling: SamplingParams fields for every request (default: greedy)."""
    from helix.runtime.sampling import SamplingParams
    steps = sweep.warmup_steps + sweep.decode_steps
    rt = llm.runtime
    g = torch.Generator().manual_seed(0)
    kv_before = llm.kv_tokens_per_rank()
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True, **(sampling or {}))
    synthetic = sweep.prefill == "synthetic"
    for _ in range(batch):
        prompt = torch.randint(0, llm.cfg.vocab_size, (1 if synthetic else context,), generator=g)
        llm.add_request(prompt.tolist(), params, synthetic_prefix=context - 1 if synthetic else 0)
    t0 = time.perf_counter()
    llm.step()                                  # prefill (synthetic: a first decode step)
    stamps = [time.perf_counter()]
    engine_s = []
    for _ in range(steps):
        engine_s.append(llm.step().seconds)
        stamps.append(time.perf_counter())
    while llm.has_unfinished():                 # overlap: the last tokens are read back late
        llm.step()
    kv = [a - b for a, b in zip(llm.kv_tokens_per_rank(), kv_before)]
    times = sorted([b - a for a, b in zip(stamps, stamps[1:])][sweep.warmup_steps:])
    timed = stamps[-1] - stamps[sweep.warmup_steps]
    median = statistics.median(times)
    step_ms = 1e3 * median
    world = layout.world_size
    return {"sweep": sweep.name, "model": model, "layout": layout.as_dict(), "world_size": world,
            "batch": batch, "context": context, "device": rt.device, "dtype": rt.dtype,
            "kv_cache_dtype": rt.kv_cache_dtype, "quantization": rt.quantization,
            "layers": rt.layers, **what_ran(llm, batch), "prefill": sweep.prefill,
            "first_step_ms": 1e3 * (stamps[0] - t0), "step_ms_median": step_ms,
            "step_ms_p90": 1e3 * times[int(0.9 * (len(times) - 1))],
            "step_ms_mean": 1e3 * timed / len(times),
            "engine_ms_median": 1e3 * statistics.median(engine_s[sweep.warmup_steps:]),
            "tokens_per_s": batch / median, "tokens_per_s_per_user": 1 / median,
            "tokens_per_s_per_gpu": batch / median / world,
            **floor_fields(llm, layout, batch, context, step_ms, rates),
            "kv_tokens_per_rank": kv}


def run_sweep(sweep: Sweep, on_record=None, rates: Rates | None = None,
              done: frozenset = frozenset(), measure_rates: bool = True) -> list[dict]:
    """Run every point not in `done` (record keys); one engine per (model, layout) that has a
    point left. `rates`: the ceilings for the floors (measured here when None and
    measure_rates)."""
    check(sweep)
    records = []
    todo = planned_points(sweep, done)
    if not todo:
        return records
    if rates is None and measure_rates:
        rates = measure(sweep.runtime["device"], sweep.runtime["dtype"])
    for model in sweep.models:
        for layout in sweep.layouts:
            points = [(b, c) for m, lay, b, c in todo if m == model and lay == layout]
            if not points:
                continue
            with open_llm(sweep, model, layout) as llm:
                for batch, context in points:
                    rec = run_point(sweep, llm, model, layout, batch, context, rates)
                    records.append(rec)
                    if on_record:
                        on_record(rec)
            del llm                 # the next layout's KV pool must not meet this one's
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return records
