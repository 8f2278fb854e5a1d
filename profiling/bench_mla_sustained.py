"""Does a long MLA decode launch lose its rate when it runs back to back? (issue 16)

Shapes of the Gluon MLA kernel (DeepSeek-V3 rank: 128 heads; 64 x 512K is the shape that
misses 75 % of the matmul rate in bench_mla_gluon.py's timed runs) captured in a CUDA graph and
replayed two ways, each replay timed alone with its own CUDA events:
  - back to back: replays enqueued with no gap for at least --busy seconds (how a decode server
    runs steps); the median of the second half is the steady state;
  - spaced: N replays, each after a host sleep of --gap seconds (the GPU idles between them).
The bf16 matmul rate (8192^3 GEMMs) is measured both ways too, so each regime has its own
ceiling: bench_mla_gluon.py divides a 10-replay run of the kernel (170 ms at 64 x 512K: long
enough for the clock to fall) by a short burst of GEMMs (at the full clock).
`nvidia-smi` logs the SM clock, power and temperature every 20 ms beside it (OUT.smi.csv), and
each replay's host enqueue time is in the record.

    PYTHONPATH=. python profiling/bench_mla_sustained.py --out sustained.json \
        [--shapes 64x524288,8x524288] [--variants seesaw,seesaw+c2] [--n 20] [--gap 0.5] \
        [--busy 0.4]
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

from profiling.bench_attention import random_pool  # noqa: E402
from profiling.bench_mla_gluon import DL, DR, SCALE, gluon_call  # noqa: E402


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


def timed_replays(run, n: int, gap: float) -> list[tuple[float, float]]:
    """(host enqueue time, ms) of n calls of run; gap 0: enqueued back to back, else each
    after a synchronize and a sleep of gap seconds."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    starts = []
    for a, b in events:
        if gap:
            torch.cuda.synchronize()
            time.sleep(gap)
        starts.append(time.time())
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return [(s, a.elapsed_time(b)) for s, (a, b) in zip(starts, events)]


def regimes(run, flops: float, n: int, gap: float, busy: float) -> dict:
    """Median ms and FLOP/s of run spaced (n calls, gap s apart) and back to back (at least
    `busy` seconds of calls; the median of the second half), plus every call's time."""
    one = timed_replays(run, 3, gap)[-1][1]
    count = max(n, int(busy * 1e3 / max(one, 1e-3)) + 1)
    out = {}
    for mode, calls, g in (("spaced", n, gap), ("back-to-back", count, 0.0)):
        time.sleep(1.0)
        runs = timed_replays(run, calls, g)
        ms = sorted(t for _, t in (runs[len(runs) // 2:] if g == 0.0 else runs))
        med = ms[len(ms) // 2]
        out[mode] = dict(median_ms=med, rate=flops / (med * 1e-3), calls=calls, replays=runs)
    return out


def matmul_regimes(args, n: int = 8192) -> dict:
    """regimes() of an n^3 bf16 GEMM on random data."""
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return regimes(lambda: x @ y, 2 * n**3, args.n, args.gap, args.busy)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="64x524288,8x524288")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--variants", default="seesaw",
                   help="kernel specs as bench_mla_gluon.py takes them: seesaw, few, seesaw/8 "
                        "(forced splits), seesaw+c2 (head blocks in 2-CTA clusters)")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--gap", type=float, default=0.5)
    p.add_argument("--busy", type=float, default=0.4)
    args = p.parse_args(argv)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,"
                            "temperature.gpu", "--format=csv,noheader", "-lms", "20"],
                           stdout=open(args.out + ".smi.csv", "w"), stderr=subprocess.DEVNULL)
    try:
        mm = matmul_regimes(args)
        print("bf16 matmul: " + ", ".join(f"{k} {v['rate'] / 1e12:.0f} TFLOP/s"
                                          for k, v in mm.items()), flush=True)
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        pool = random_pool((max(B * c for B, c in shapes) // 64, 64, DL + DR))
        recs = []
        for B, ctx in shapes:
            bt = torch.arange(B * ctx // 64, dtype=torch.int32, device="cuda").view(B, -1)
            lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            ql = torch.randn(B, args.heads, DL, device="cuda", dtype=torch.bfloat16)
            qr = torch.randn(B, args.heads, DR, device="cuda", dtype=torch.bfloat16)
            flops = 2 * B * args.heads * ctx * (DL + DR + DL)
            for spec in args.variants.split(","):
                graph = captured(lambda spec=spec: gluon_call(spec, ql, qr, pool, bt, lens,
                                                              SCALE))
                got = regimes(graph.replay, flops, args.n, args.gap, args.busy)
                rec = dict(batch=B, context=ctx, heads=args.heads, variant=spec)
                for mode, r in got.items():
                    rec[mode] = dict(r, matmul_rate=mm[mode]["rate"],
                                     matmul_fraction=r["rate"] / mm[mode]["rate"],
                                     fraction_of_spaced_matmul=r["rate"] / mm["spaced"]["rate"])
                recs.append(rec)
                print(f"{B}x{ctx // 1024}K {spec}: " + "; ".join(
                    f"{m} {r['median_ms']:.3f} ms = {100 * r['matmul_fraction']:.1f} % of that "
                    f"regime's matmul ({100 * r['fraction_of_spaced_matmul']:.1f} % of the "
                    "spaced)" for m, r in rec.items() if isinstance(r, dict)), flush=True)
                del graph
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), args=vars(args),
                           matmul={k: {kk: vv for kk, vv in v.items()}
                                   for k, v in mm.items()}, records=recs), f, indent=1)
    finally:
        smi.terminate()


if __name__ == "__main__":
    main()
