"""Decode step time: eager vs captured graphs vs graphs with breaks, on a few full-width layers.

For each model and batch: B requests with a --context-token prompt are prefilled, then decode
steps are timed in three modes: eager (no graphs), graphed (whole step captured), graphed with
the "attention" break (attention eager inside the graph), and without overlap (each step read
back before the next is prepared). Recorded per mode: `wall_ms_per_step`, the wall time of
--steps consecutive LLM.step() calls divided by their number (what a user sees per token: host
scheduling, metadata, upload, replay, sampling, read-back; with overlap the host part of step
N + 1 runs while step N is on the GPU); `step_ms`, the median of those calls; `replay_ms`, the
median GPU time of upload + replay alone (CUDA events); and from the torch profiler the sum of
the step's kernel times (`kernel_ms`, the floor a perfect launcher reaches), its copies, the
kernel count and the top kernels; `floor_ms`, the step's roofline floor (helix.perf.cost) at
the copy / read / matmul rates measured once at the start of the run (in `meta.rates`), and
`floor_ratio` = wall_ms_per_step / floor_ms. Rank 0 is measured; with --kvp/--tpa > 1 the other
ranks run as spawned workers.

    python profiling/bench_graphs.py --models llama-3.1-8b,deepseek-v3 --layers 4 \
        --batches 1,4,16 --out profiling/results/graphs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.perf.cost import step_cost
from helix.perf.rates import Rates, measure

MODES = {"eager": dict(cuda_graphs=False), "graphed": dict(cuda_graphs=True),
         "graphed_attention_break": dict(cuda_graphs=True, graph_breaks=("attention",)),
         "graphed_no_overlap": dict(cuda_graphs=True, overlap=False),
         "eager_no_overlap": dict(cuda_graphs=False, overlap=False)}
DEFAULT_MODES = "eager,graphed,graphed_attention_break,graphed_no_overlap"


def kernel_profile(llm: LLM, steps: int, top: int = 12) -> dict:
    """Per decode step, from the torch profiler (rank 0): the sum of CUDA kernel durations
    (`kernel_ms`, the floor a perfect launcher reaches), of memcpy/memset durations
    (`copy_ms`), the kernel count, and the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    kern, copies, count, rows = 0.0, 0.0, 0, []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.self_device_time_total / steps
        if e.key.startswith(("Memcpy", "Memset")):
            copies += us
        else:
            kern += us
            count += e.count
            rows.append((us, e.count / steps, e.key))
    rows.sort(reverse=True)
    return {"kernel_ms": kern / 1e3, "copy_ms": copies / 1e3, "kernels_per_step": count / steps,
            "top_kernels": [{"us": round(us, 2), "per_step": round(c, 2), "name": k[:120]}
                            for us, c, k in rows[:top]]}


def replay_ms(llm: LLM, steps: int) -> float | None:
    """Median GPU time of the staged upload + graph replay, from CUDA events around it
    (synchronising: overlap is off while this is measured)."""
    graphs = llm.engine.graphs
    if graphs is None:
        return None
    times, run = [], graphs.run

    def timed(*a, **k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = run(*a, **k)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        return out

    graphs.run = timed
    try:
        for _ in range(steps):
            llm.step()
    finally:
        del graphs.run                      # back to the class's method
    return statistics.median(times)


def bench(model: str, layout: Layout, mode: str, batch: int, args, rates: Rates) -> dict:
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
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        walls = [llm.step().seconds * 1e3 for _ in range(args.steps)]
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / args.steps
        rep = replay_ms(llm, args.steps)
        prof = kernel_profile(llm, args.steps)
        breaks = sorted(llm.engine.graphs.needed_breaks) if llm.engine.graphs else []
        cost = step_cost(llm.cfg, layout, batch, args.context, 2, rt.page_size)
    floor = 1e3 * cost.floor_s(rates.hbm_bps, rates.matmul_flops)
    return {"model": model, "layers": args.layers, "layout": layout.as_dict(), "mode": mode,
            "breaks": breaks, "batch": batch, "context": args.context, "backend": args.backend,
            "overlap": rt.resolved_overlap, "step_ms": statistics.median(walls),
            "wall_ms_per_step": wall, "replay_ms": rep, "floor_ms": floor,
            "floor_ratio": wall / floor, **prof}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.1-8b,deepseek-v3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kvp", type=int, default=1)
    ap.add_argument("--tpa", type=int, default=1)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    layout = Layout(kvp=args.kvp, tpa=args.tpa)
    rates = measure("cuda", "bfloat16")
    print(f"# rates: {rates.as_record()}", flush=True)
    records = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            rows = {}
            for mode in args.modes.split(","):
                rec = bench(model, layout, mode, batch, args, rates)
                rows[mode] = rec
                records.append(rec)
                print(json.dumps(rec), flush=True)
            if "eager" in rows and "graphed" in rows:
                g, e = rows["graphed"], rows["eager"]
                print(f"# {model} b={batch}: eager {e['wall_ms_per_step']:.3f} ms, graphed "
                      f"{g['wall_ms_per_step']:.3f} ms "
                      f"({e['wall_ms_per_step'] / g['wall_ms_per_step']:.2f}x), "
                      f"graphed / kernels {g['wall_ms_per_step'] / g['kernel_ms']:.3f}x, replay "
                      f"{g['replay_ms']:.3f} ms, kernels {g['kernel_ms']:.3f} ms, floor "
                      f"{g['floor_ms']:.3f} ms ({g['floor_ratio']:.2f}x)", flush=True)
    meta = {"device": torch.cuda.get_device_name(0), "gpus": layout.world_size,
            "rates": rates.as_record(),
            "torch": torch.__version__, "args": vars(args),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() or None}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
