"""Does a long MLA decode launch lose its rate when it runs back to back? (issue 16)

One shape of the Gluon MLA kernel (DeepSeek-V3 rank: 128 heads; default 64 x 512K, the shape
that misses 75 % of the matmul rate in timed runs) captured in a CUDA graph and replayed two
ways, each replay timed alone with its own CUDA events:
  - back to back: N replays enqueued with no gap (how bench_mla_gluon.py times, and how a
    decode server runs steps);
  - spaced: N replays, each after a host sleep of --gap seconds (the GPU idles and cools).
`nvidia-smi` logs the SM clock, power and temperature every 20 ms beside it (OUT.smi.csv), and
the record carries each replay's host start time, so the clocks can be read against the
launches.

    PYTHONPATH=. python profiling/bench_mla_sustained.py --out sustained.json \
        [--shapes 64x524288,8x524288] [--n 20] [--gap 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import gluon_mla  # noqa: E402
from profiling.bench_attention import random_pool  # noqa: E402
from profiling.bench_mla_gluon import DL, DR, SCALE  # noqa: E402
from profiling.roofline import matmul_rate  # noqa: E402


def captured(fn):
    """fn captured in a CUDA graph (warmed up eagerly first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def timed_replays(graph, n: int, gap: float) -> list[tuple[float, float]]:
    """(host start time, ms) of n replays; gap 0: enqueued back to back, else each after a
    synchronize and a sleep of gap seconds."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    starts = []
    for a, b in events:
        if gap:
            torch.cuda.synchronize()
            time.sleep(gap)
        starts.append(time.time())
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return [(s, a.elapsed_time(b)) for s, (a, b) in zip(starts, events)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="64x524288,8x524288")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--variant", default="seesaw")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--gap", type=float, default=0.5)
    args = p.parse_args(argv)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,"
                            "temperature.gpu", "--format=csv,noheader", "-lms", "20"],
                           stdout=open(args.out + ".smi.csv", "w"), stderr=subprocess.DEVNULL)
    try:
        mm = matmul_rate()
        time.sleep(2.0)
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        pool = random_pool((max(B * c for B, c in shapes) // 64, 64, DL + DR))
        recs = []
        for B, ctx in shapes:
            bt = torch.arange(B * ctx // 64, dtype=torch.int32, device="cuda").view(B, -1)
            lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            ql = torch.randn(B, args.heads, DL, device="cuda", dtype=torch.bfloat16)
            qr = torch.randn(B, args.heads, DR, device="cuda", dtype=torch.bfloat16)
            graph = captured(lambda: gluon_mla.mla_decode_gluon(ql, qr, pool, bt, lens, SCALE,
                                                                variant=args.variant))
            flops = 2 * B * args.heads * ctx * (DL + DR + DL)
            for mode, gap in (("spaced", args.gap), ("back-to-back", 0.0), ("spaced", args.gap)):
                time.sleep(2.0)
                runs = timed_replays(graph, args.n, gap)
                ms = sorted(t for _, t in runs)
                med = ms[len(ms) // 2]
                rec = dict(batch=B, context=ctx, heads=args.heads, variant=args.variant,
                           mode=mode, gap_s=gap, n=args.n, median_ms=med, min_ms=ms[0],
                           max_ms=ms[-1], matmul_TFLOPs=mm / 1e12,
                           matmul_fraction=flops / (med * 1e-3) / mm,
                           best_fraction=flops / (ms[0] * 1e-3) / mm, replays=runs)
                recs.append(rec)
                print(f"{B}x{ctx // 1024}K {mode:12}: median {med:.3f} ms "
                      f"({100 * rec['matmul_fraction']:.1f} % of matmul), min {ms[0]:.3f}, "
                      f"max {ms[-1]:.3f}", flush=True)
            del graph
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), matmul_TFLOPs=mm / 1e12,
                           args=vars(args), records=recs), f, indent=1)
    finally:
        smi.terminate()


if __name__ == "__main__":
    main()
