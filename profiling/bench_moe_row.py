"""One token's MoE alone on the GPU: gluon_moe's one launch in its variants (module knobs)
against moe_decode's two Triton launches, in the same process.

    python profiling/bench_moe_row.py [--shape dsv2lite|qwen3] [--configs JSON] [--fp8]
        [--trace] [--out f.json]

Each case captures CALLS calls in one CUDA graph, each with its own routing (6 or 8 distinct
experts of all E), replays it REPS times and reports us a call and the rate of the weight bytes
the call reads (the hit experts and the shared experts) against the copy rate measured here.
Configs: a JSON list of dicts of gluon_moe knobs (STAGES, BN, MAXNREG, NUM_WARPS,
PRODUCER_REGS, and for --fp8 STAGES_FP8, NUM_WARPS_FP8); {"two": true} is
moe_decode's two launches. --fp8: the experts in block fp8 (helix.layers.fp8.quantize), the
bytes counted at one a weight plus the scales read. Every variant is checked against the fp32
reference before it is timed.

--trace: after the timings, the launch with its router (moe_row_routed, softmax top-k over all
E) and then without, each run TRACE_RUNS times with gluon_moe.TRACE: the median over runs of
each phase stamp (gluon_moe.STAMPS) across the programs, in us from the first program's start
(median and max over programs), so the launch's time splits into routing, gate/up, the barrier,
down and the tail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.layers import gluon_moe as gm  # noqa: E402
from helix.layers import moe_decode as md  # noqa: E402

SHAPES = {"dsv2lite": (64, 6, 1408, 2816, 2048), "qwen3": (128, 8, 1536, 0, 4096)}
KNOBS = ("STAGES", "BN", "MAXNREG", "NUM_WARPS", "PRODUCER_REGS", "STAGES_FP8", "NUM_WARPS_FP8")
CALLS, REPS = 16, 10
TRACE_RUNS = 20


def build(shape: str, fp8: bool = False):
    """(x, gate, up, down, shared, scales), the routings, the bytes a call reads."""
    E, k, inter, ws, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)

    def rand(*s):
        return (torch.randn(*s, generator=gen) * 0.02).to("cuda", torch.bfloat16)

    gate, up, down = rand(E, inter, dim), rand(E, inter, dim), rand(E, dim, inter)
    shared = (rand(ws, dim), rand(ws, dim), rand(dim, ws)) if ws else None
    x = rand(1, dim) * 50
    routes = []
    for _ in range(CALLS):
        ids = torch.randperm(E, generator=gen)[:k].view(1, k).int().cuda()
        w = torch.rand(1, k, generator=gen).cuda()
        routes.append((ids, w / w.sum()))
    nbytes = 2 * (3 * k * inter * dim + 3 * ws * dim)
    scales = None
    if fp8:
        from helix.layers import fp8 as f8
        q = [f8.quantize(w) for w in (gate, up, down)]
        gate, up, down = (b.weight for b in q)
        scales = {"scales": tuple(b.scale for b in q)}
        if shared is not None:
            qs = [f8.quantize(w) for w in shared]
            shared = tuple(b.weight for b in qs)
            scales["shared_scales"] = tuple(b.scale for b in qs)
        nbytes = nbytes // 2 + 4 * 3 * (k * f8.blocks(inter) * f8.blocks(dim)
                                         + f8.blocks(ws) * f8.blocks(dim))
    return (x, gate, up, down, shared, scales), routes, nbytes


def run_case(cfg: dict, tensors, routes, nbytes: int, rate: float) -> dict:
    x, gate, up, down, shared, scales = tensors
    sc = scales or {}
    saved = {n: getattr(gm, n) for n in KNOBS}
    gm.ENABLED = not cfg.get("two", False)
    for n in KNOBS:
        if n in cfg:
            setattr(gm, n, cfg[n])
    try:
        ids, w = routes[0]
        out = md.moe_decode(x, gate, up, down, w, ids, 0, shared=shared, **sc)
        ref = gm.reference(x, gate, up, down, w, ids, 0, shared, **sc)
        err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
        for ids, w in routes:                       # warm up / compile outside the capture
            md.moe_decode(x, gate, up, down, w, ids, 0, shared=shared, **sc)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for ids, w in routes:
                md.moe_decode(x, gate, up, down, w, ids, 0, shared=shared, **sc)
        g.replay()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(REPS):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        us = s.elapsed_time(e) * 1e3 / (REPS * CALLS)
        return dict(config=cfg, us=round(us, 2), rel_err=err, ok=err < 1e-2,
                    tb_s=round(nbytes / (us * 1e-6) / 1e12, 3),
                    of_copy=round(nbytes / (us * 1e-6) / 1e9 / rate, 3))
    except Exception as ex:  # noqa: BLE001 - a variant that fails is reported, not fatal
        return dict(config=cfg, error=f"{type(ex).__name__}: {str(ex)[:500]}")
    finally:
        for n, v in saved.items():
            setattr(gm, n, v)
        gm.ENABLED = True


def trace(tensors, routes, routed: bool) -> dict:
    """Phase stamps of the launch (module doc, --trace): {stamp: [median, max] us over the
    programs, each the median over TRACE_RUNS runs}."""
    from helix.layers.triton_router import RouteSpec
    x, gate, up, down, shared, scales = tensors
    sc = scales or {}
    E, dim = gate.shape[0], x.shape[-1]
    ids, w = routes[0]
    gen = torch.Generator().manual_seed(1)
    router = (torch.randn(E, dim, generator=gen) * 0.05).cuda()
    norm_w = torch.ones(dim, dtype=x.dtype, device="cuda")
    spec = RouteSpec(k=ids.shape[-1], sigmoid=False, groups=1, topk_group=1, group_rule="none",
                     norm=False, scaling=1.0)
    runs = []
    gm.TRACE = True
    try:
        for _ in range(TRACE_RUNS + 2):
            if routed:
                gm.moe_row_routed(x, x, norm_w, 1e-6, router, None, spec, gate, up, down, 0,
                                  shared, **sc)
            else:
                gm.moe_row(x, gate, up, down, w, ids, 0, shared, **sc)
            torch.cuda.synchronize()
            t = gm.TRACES.pop().double().cpu()
            runs.append((t - t[:, 0].min()) / 1e3)                  # us from the first start
    finally:
        gm.TRACE = False
    t = torch.stack(runs[2:])                                       # [runs, programs, 8]
    med, top = t.median(dim=1).values.median(dim=0).values, t.max(dim=1).values.median(dim=0).values
    return {name: [round(med[i].item(), 2), round(top[i].item(), 2)]
            for i, name in enumerate(gm.STAMPS)
            if routed or name not in ("ids", "producer_ids")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="dsv2lite", choices=sorted(SHAPES))
    ap.add_argument("--configs", default='[{"two": true}, {}]')
    ap.add_argument("--fp8", action="store_true", help="experts in block fp8")
    ap.add_argument("--trace", action="store_true", help="phase stamps of the launch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_row: needs a CUDA GPU")
    if not gm.available(torch.device("cuda"), scaled=args.fp8):
        raise SystemExit(f"bench_moe_row: "
                         f"{gm.why_unavailable(torch.device('cuda'), scaled=args.fp8)}")
    from helix.perf.rates import measure
    rate = measure("cuda", "bfloat16").copy_bps / 1e9        # read + write, GB/s
    tensors, routes, nbytes = build(args.shape, args.fp8)
    recs = []
    for cfg in json.loads(args.configs):
        rec = run_case(cfg, tensors, routes, nbytes, rate)
        rec.update(shape=args.shape, fp8=args.fp8, weight_mb=round(nbytes / 1e6, 1),
                   copy_gb_s=round(rate))
        recs.append(rec)
        print(json.dumps(rec), flush=True)
    if args.trace:
        for routed in (True, False):
            rec = dict(trace=trace(tensors, routes, routed), routed=routed, shape=args.shape,
                       fp8=args.fp8)
            recs.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(recs, f, indent=1)
    print(f"\n{args.shape}: {nbytes / 1e6:.1f} MB a call, copy {rate:.0f} GB/s")
    for r in recs:
        if "trace" in r:
            print(f"  trace{' routed' if r['routed'] else ''} (us from the first start, median /"
                  " max over programs): " + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}"
                                                      for k, v in r["trace"].items()))
            continue
        print(f"  {json.dumps(r['config']):60} " + (f"{r['us']:8.2f} us  {r['of_copy']:.2f} x copy"
                                                     f"  err {r['rel_err']:.1e}" if "us" in r
                                                     else r["error"]))


if __name__ == "__main__":
    main()
