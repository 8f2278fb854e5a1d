"""The host cost of `Scheduler.schedule` per step at N running decode rows, with the prefix cache
and without, in one process (no model: the scheduler alone, as every rank runs it each step).

    python profiling/bench_scheduler.py --rows 64 --steps 2000 --repeats 8

Each request holds a 1,000-token prompt and decodes one token a step, so with the cache a block
completes every page-size steps per request. Prints the median microseconds a step per mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def step_us(cache: bool, rows: int, steps: int, page: int = 16) -> float:
    from helix.kv.ownership import KVSharding
    from helix.runtime.request import Request
    from helix.runtime.sampling import SamplingParams
    from helix.runtime.scheduler import Scheduler
    s = Scheduler(10 ** 6, KVSharding(1, 1, page), max_batch=rows, max_prefill_tokens=10 ** 6,
                  prefix_caching=cache)
    params = SamplingParams(max_new_tokens=10 ** 6, ignore_eos=True)
    for i in range(rows):
        s.add(Request(i, [i + 1] * 1000, params, 10 ** 7))
    for c in s.schedule().prefill:                      # every prompt in one step
        c.req.computed = c.start + len(c.ids)
        c.req.output.append(1)
    s.take_kv_ops()
    t = 0.0
    for i in range(steps + 1):                          # the first registers the prompts' blocks
        if i == 1:
            t = time.perf_counter()
        for r in s.schedule().decode:                   # the engine's bookkeeping, no device
            r.computed = r.num_tokens
            r.output.append(2)
        s.take_kv_ops()
    return (time.perf_counter() - t) / steps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args(argv)
    if min(args.rows, args.steps, args.repeats) < 1:
        print("bench_scheduler: --rows, --steps and --repeats must be >= 1", file=sys.stderr)
        return 2
    times = {False: [], True: []}
    for _ in range(args.repeats):                       # interleaved: drift hits both
        for cache in (False, True):
            times[cache].append(step_us(cache, args.rows, args.steps))
    for cache in (False, True):
        print(f"prefix cache {'on ' if cache else 'off'}: "
              f"{statistics.median(times[cache]):.1f} us a step (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
