"""Decode step time: eager vs captured graphs vs graphs with breaks, on a few full-width layers.

For each model and batch: B requests with a --context-token prompt are prefilled, then decode
steps are timed in three modes: eager (no graphs), graphed (whole step captured), graphed with
the "attention" break (attention eager inside the graph). Recorded per mode: the median wall
time of a step (LLM.step: scheduling, metadata, replay, sampling), the median GPU time of the
graph replay alone (CUDA events), and the sum of the step's kernel times from the torch profiler
(the floor a perfect launcher reaches). Rank 0 is measured; with --kvp/--tpa > 1 the other ranks
run as spawned workers.

    python profiling/bench_graphs.py --models llama-3.1-8b,deepseek-v3 --layers 4 \
        --batches 1,4,16 --out profiling/results/graphs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams

MODES = {"eager": dict(cuda_graphs=False), "graphed": dict(cuda_graphs=True),
         "graphed_attention_break": dict(cuda_graphs=True, graph_breaks=("attention",))}


def kernel_ms_per_step(llm: LLM, steps: int) -> float:
    """Sum of CUDA kernel durations per decode step (torch profiler, rank 0)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / 1e3 / steps


def replay_ms(llm: LLM, steps: int) -> float | None:
    """Median GPU time of the graph replay alone, from CUDA events around the runner."""
    graphs = llm.engine.graphs
    if graphs is None:
        return None
    times, run = [], graphs.runner.run

    def timed(*a, **k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = run(*a, **k)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        return out

    graphs.runner.run = timed
    try:
        for _ in range(steps):
            llm.step()
    finally:
        graphs.runner.run = run
    return statistics.median(times)


def bench(model: str, layout: Layout, mode: str, batch: int, args) -> dict:
    n_steps = args.warmup + 3 * args.steps + 2
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", layers=args.layers, max_batch=batch,
                       max_context=args.context + n_steps + 8, graph_buckets=(batch,),
                       attention_backend=args.backend, **MODES[mode])
    g = torch.Generator().manual_seed(0)
    with LLM(model, layout, rt) as llm:
        vocab = llm.cfg.vocab_size
        for _ in range(batch):
            llm.add_request(torch.randint(0, vocab, (args.context,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=n_steps, ignore_eos=True))
        llm.step()                                    # prefill
        for _ in range(args.warmup):
            llm.step()
        walls = [llm.step().seconds * 1e3 for _ in range(args.steps)]
        rep = replay_ms(llm, args.steps)
        kern = kernel_ms_per_step(llm, args.steps)
        breaks = sorted(llm.engine.graphs.needed_breaks) if llm.engine.graphs else []
    return {"model": model, "layers": args.layers, "layout": layout.as_dict(), "mode": mode,
            "breaks": breaks, "batch": batch, "context": args.context, "backend": args.backend,
            "step_ms": statistics.median(walls), "replay_ms": rep, "kernel_ms": kern}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.1-8b,deepseek-v3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kvp", type=int, default=1)
    ap.add_argument("--tpa", type=int, default=1)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    layout = Layout(kvp=args.kvp, tpa=args.tpa)
    records = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            rows = {}
            for mode in args.modes.split(","):
                rec = bench(model, layout, mode, batch, args)
                rows[mode] = rec
                records.append(rec)
                print(json.dumps(rec), flush=True)
            if "eager" in rows and "graphed" in rows:
                g, e = rows["graphed"], rows["eager"]
                print(f"# {model} b={batch}: eager {e['step_ms']:.2f} ms, graphed {g['step_ms']:.2f} ms "
                      f"({e['step_ms'] / g['step_ms']:.1f}x), replay {g['replay_ms']:.3f} ms vs kernels "
                      f"{g['kernel_ms']:.3f} ms ({g['replay_ms'] / g['kernel_ms']:.2f}x)", flush=True)
    meta = {"device": torch.cuda.get_device_name(0), "gpus": layout.world_size,
            "torch": torch.__version__, "args": vars(args),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() or None}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
