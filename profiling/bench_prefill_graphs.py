"""Time to first token of short prompts: prefill steps replayed as graphs against eager ones.

For each prompt length L and batch B, B requests of L random tokens are added at once and the
engine steps until each has its first token; TTFT is the wall time from the first add_request to
the step that returns the last first token (overlap off: a step returns its own tokens, after
its device work). Prompts of B x L tokens above --max-prefill-tokens take several steps. One
engine runs both modes, alternating per repetition, so weights, KV pool and caches are shared:
"graphs" replays its prefill graphs (helix/runtime/prefill_graphs.py), "eager" sets them aside
for the call (what --no-prefill-graphs runs). Recorded per point: TTFT median / min / all per
mode, eager / graphs, the prefill steps, the graph (mode, bucket) of each step and its padding,
whether both modes gave the same first tokens; in meta: the capture time, the graphs captured,
the attention backend (its prefill attention is the graphs' eager break), device and versions.
The summary table is printed last.

    python profiling/bench_prefill_graphs.py --out profiling/results/prefill_graphs.json
    python profiling/bench_prefill_graphs.py --smoke --out /tmp/p.json     # CPU, tiny preset
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.graphs import token_buckets

SMOKE = dict(model="tiny-llama", layers=0, dtype="float32", lengths="8,20", batches="1,2",
             reps=2, warmup=1, max_prefill_tokens=32)


def ttft(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[int], list]:
    """(seconds to every prompt's first token, the first tokens, the prefill graph of each
    step or None)."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    eng = llm.engine
    t0 = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    keys = []
    while any(not llm.outputs.get(i) for i in ids):
        llm.step()
        keys.append(eng.prefill_graphs.last_key if eng.prefill_graphs and eng.last_graphed
                    else None)
    seconds = time.perf_counter() - t0
    while llm.has_unfinished():                   # nothing left in practice: max_new_tokens 1
        llm.step()
    return seconds, [llm.outputs[i][0] for i in ids], keys


def run_point(llm: LLM, length: int, batch: int, reps: int, warmup: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = llm.cfg.vocab_size
    prompts = [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]
    eng = llm.engine
    graphs = eng.prefill_graphs
    times = {"eager": [], "graphs": []}
    first, keys = {}, []
    for i in range(warmup + reps):
        for mode in ("eager", "graphs") if i % 2 == 0 else ("graphs", "eager"):
            eng.prefill_graphs = graphs if mode == "graphs" else None
            try:
                s, tokens, step_keys = ttft(llm, prompts)
            finally:
                eng.prefill_graphs = graphs
            first[mode] = tokens
            if mode == "graphs":
                keys = step_keys
            if i >= warmup:
                times[mode].append(1e3 * s)
    tokens = length * batch
    rec = {"length": length, "batch": batch, "tokens": tokens, "steps": len(keys),
           "graphs_per_step": [list(k) if k else None for k in keys],
           "same_tokens": first["eager"] == first["graphs"]}
    for mode, ts in times.items():
        rec[f"{mode}_ms"] = {"median": statistics.median(ts), "min": min(ts),
                             "all": [round(t, 4) for t in ts]}
    rec["speedup"] = rec["eager_ms"]["median"] / rec["graphs_ms"]["median"]
    held = sum(graphs.tokens(*k) for k in keys if k) if graphs else 0
    rec["padding"] = held / tokens - 1 if held else None
    return rec


def summary(records: list[dict]) -> str:
    lines = [f"{'L':>6} {'B':>3} {'tokens':>7} {'steps':>5} {'bucket per step':>24} "
             f"{'pad %':>6} {'eager ms':>9} {'graphs ms':>9} {'speedup':>7} same"]
    for r in records:
        graphs = ",".join(f"{k[1]}" if k else "eager" for k in r["graphs_per_step"])
        pad = "-" if r["padding"] is None else f"{100 * r['padding']:.1f}"
        lines.append(f"{r['length']:>6} {r['batch']:>3} {r['tokens']:>7} {r['steps']:>5} "
                     f"{graphs[:24]:>24} {pad:>6} {r['eager_ms']['median']:>9.3f} "
                     f"{r['graphs_ms']['median']:>9.3f} {r['speedup']:>7.2f} "
                     f"{'yes' if r['same_tokens'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=4, help="first n layers (0: all)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="512,700,1024,2048,3000,4096", help="prompt lengths")
    ap.add_argument("--batches", default="1,2,4,8", help="prompts added at once")
    ap.add_argument("--reps", type=int, default=10, help="timed TTFTs per point and mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed TTFTs per point and mode")
    ap.add_argument("--max-prefill-tokens", type=int, default=0, help="0: the runtime default")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON results")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny sizes")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    device = "cpu" if args.smoke else "cuda"
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    # graphs for every step up to the largest (the runtime's default ladder stops sooner)
    max_step = RuntimeConfig(device=device, max_prefill_tokens=args.max_prefill_tokens
                             ).resolved_max_prefill_tokens + max(batches)
    rt = RuntimeConfig(device=device, dtype=args.dtype, layers=args.layers,
                       max_batch=max(batches), max_context=max(lengths) + 16, overlap=False,
                       max_prefill_tokens=args.max_prefill_tokens, prefill_graphs=True,
                       prefill_graph_buckets=token_buckets(max_step),
                       attention_backend=args.attention_backend, seed=args.seed,
                       prefix_caching=False)     # eager and graphed runs prefill the same prompts
    t0 = time.perf_counter()
    records = []
    with LLM(args.model, Layout(), rt) as llm:
        graphs = llm.engine.prefill_graphs
        runners = graphs.runners.values()
        meta = {"model": args.model, "layers": args.layers, "dtype": args.dtype,
                "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
                "torch": torch.__version__, "attention_backend": llm.engine.backend.name,
                "max_prefill_tokens": rt.resolved_max_prefill_tokens,
                "start_s": time.perf_counter() - t0,
                "capture_s": sum(r.capture_seconds for r in runners),
                "graphs_captured": sum(len(r.graphs) for r in runners),
                "buckets": list(graphs.ladder), "breaks": sorted(graphs.needed_breaks),
                "replayed_as_graphs": all(r.use_graphs for r in runners)}
        print(json.dumps(meta), flush=True)
        for length in lengths:
            for batch in batches:
                records.append(run_point(llm, length, batch, args.reps, args.warmup, args.seed))
                print(json.dumps({k: v for k, v in records[-1].items()
                                  if k not in ("eager_ms", "graphs_ms")}), flush=True)
    meta["total_s"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "points": records}, f, indent=1)
    print(f"# {len(records)} points in {meta['total_s']:.0f} s, capture {meta['capture_s']:.1f} s "
          f"({meta['graphs_captured']} graphs), attention backend {meta['attention_backend']}")
    print(summary(records))


if __name__ == "__main__":
    main()
