"""Host work of one decode step: the engine's whole step (scheduling, KV metadata, staging,
readback, retiring) with the graph replay stubbed, so what is timed is what the host does per
step at a batch of B running requests. On a GPU machine that host time sets the step time
whenever it exceeds the device's; here it can be measured on any CPU.

    python profiling/bench_host_step.py --batch 32 --out host_step.json

Runs the `tiny-llama` preset on the CPU with graphs on (the same bucketed path as CUDA, eager);
the decode graph's replay returns the bucket's first logits without running the model.
Reports the median of `--repeats` runs of `--steps` steps, and per phase (schedule, prepare,
graph inputs, resolve) the time inside the step.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time


def measure(batch: int, steps: int, repeats: int) -> dict:
    from helix import LLM, Layout, RuntimeConfig, SamplingParams
    llm = LLM("tiny-llama", Layout(), RuntimeConfig(max_batch=batch, max_context=steps * repeats
                                                    + 256))
    eng = llm.engine
    real, first = eng.graphs.runner.replay, {}

    def replay(bucket):                     # the model's work stubbed: host work only
        if bucket not in first:
            first[bucket] = real(bucket)
        return first[bucket]
    eng.graphs.runner.replay = replay
    phases: dict[str, float] = {}

    def timed(obj, name, label):
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapper)

    params = SamplingParams(max_new_tokens=steps * repeats + 8, ignore_eos=True)
    for i in range(batch):
        llm.add_request([(7 * i + j) % 200 + 1 for j in range(128)], params)
    for _ in range(4):                      # prefill and the first decode steps
        llm.step()
    for obj, name, label in ((eng.scheduler, "schedule", "schedule"),
                             (eng.kv, "prepare", "prepare"), (eng.graphs, "run", "graph inputs"),
                             (eng, "_resolve", "resolve")):
        timed(obj, name, label)
    times = []
    for _ in range(repeats):
        phases.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        times.append((time.perf_counter() - t0) / steps)
    llm.close()
    return {"batch": batch, "steps": steps, "repeats": repeats,
            "host_ms_per_step": 1e3 * statistics.median(times),
            "host_ms_runs": [1e3 * t for t in times],
            "phase_ms_last_run": {k: 1e3 * v / steps for k, v in phases.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rec = measure(args.batch, args.steps, args.repeats)
    print(json.dumps(rec))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
