"""The Gluon MLA decode kernel (helix/attention/gluon_mla.py) on one H200, in ONE call:

1. compile both variants (seesaw, simple) for sm_90 and log registers / spills / shared memory /
   wgmma shapes, or the FULL compiler error (OUT/compile.log, OUT/compile.json);
2. correctness of each variant against a float32 torch computation on ragged shapes (16 / 64 /
   128 heads, kv_len 0, partial pages, page 16, forced and automatic splits, stale slots set to
   NaN, under a CUDA graph replay with new inputs), each variant in a subprocess with a timeout
   so a deadlocked kernel costs its timeout, not the run (OUT/check_<variant>.json);
3. for the variants that passed: CUDA-graph timings against triton_mla.mla_decode at
   batch 1 x 64K, 8 / 32 / 64 x 64K-512K (as memory allows) and 132 x 8K, TFLOP/s
   (2 B H ctx (576 + 512)) and the fraction of the bf16 matmul rate measured in the same run
   (OUT/timings.json, one record per (kernel, shape), written after each).

    PYTHONPATH=. timeout 440 python profiling/bench_mla_gluon.py --out $OUT/gluon

The summary table is printed last (and saved as OUT/summary.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import gluon_mla  # noqa: E402

H, DL, DR = 128, 512, 64
SCALE = 192 ** -0.5
TIMED = [(1, 65536), (8, 65536), (8, 131072), (8, 262144), (8, 524288), (32, 65536),
         (32, 131072), (32, 262144), (32, 524288), (64, 65536), (64, 131072), (64, 262144),
         (64, 524288), (132, 8192)]
# (batch, heads, lengths or None for "all = ctx", ctx, page, forced splits)
CHECKS = [
    (4, 128, [0, 1, 64, 1000], 1024, 64, None),
    (4, 16, [0, 129, 63, 700], 1024, 64, 3),
    (3, 64, [4096, 1, 2000], 4096, 64, None),
    (2, 128, [5000, 8192], 8192, 64, 1),
    (5, 128, [0, 0, 0, 0, 0], 512, 64, None),
    (3, 128, [17, 300, 1025], 2048, 16, 2),
    (2, 128, [65536, 40000], 65536, 64, None),
]


def split_spec(spec: str) -> tuple[str, int | None]:
    """A kernel spec: a variant ("seesaw"), maybe with forced splits ("seesaw/8") and head
    blocks launched in clusters ("seesaw+c2", "seesaw/8+c2") -> (variant, splits or None for
    the plan's)."""
    variant, _, n = spec.partition("+")[0].partition("/")
    return variant, int(n) if n else None


def cluster_of(spec: str) -> int:
    """The cluster size of a spec's head blocks ("+c2" -> 2; none: 1)."""
    c = spec.partition("+")[2]
    return int(c.removeprefix("c")) if c else 1


def gluon_call(spec, *case):
    """mla_decode_gluon(*case) as the spec says (gluon_mla.CLUSTER_HEADS set for the call)."""
    variant, splits = split_spec(spec)
    saved, gluon_mla.CLUSTER_HEADS = gluon_mla.CLUSTER_HEADS, cluster_of(spec)
    try:
        return gluon_mla.mla_decode_gluon(*case, num_splits=splits, variant=variant)
    finally:
        gluon_mla.CLUSTER_HEADS = saved


def ragged_case(batch, heads, lens, ctx, page, seed, device="cuda", poison=True):
    """Random q, a shuffled paged pool, block tables and lengths; slots past each length (and
    unused pages) hold NaN when poison is set: they must never reach O."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = -(-ctx // page)
    pages = batch * width + 3
    kv = torch.randn(pages, page, DL + DR, generator=gen).to(device, torch.bfloat16)
    bt = torch.randperm(pages, generator=gen)[:batch * width].view(batch, width).int()
    if poison:
        keep = torch.zeros(pages * page, dtype=torch.bool)
        for b, n in enumerate(lens):
            idx = torch.arange(n)
            keep[bt[b].long()[idx // page] * page + idx % page] = True
        kv.view(-1, DL + DR)[~keep.to(device)] = float("nan")
    q = torch.randn(batch, heads, DL + DR, generator=gen).to(device, torch.bfloat16)
    return (q[..., :DL], q[..., DL:], kv, bt.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


def compare(o, lse, ref_o, ref_lse) -> dict:
    """Errors against the float32 reference, and whether they are within bf16 tolerance."""
    fin = torch.isfinite(ref_lse)
    err_o = (o.float() - ref_o).abs().max().item() if o.numel() else 0.0
    err_l = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    empty_ok = bool((lse[~fin] == float("-inf")).all() and (o[~fin] == 0).all())
    ok = (err_o <= 1e-2 + 1e-2 * ref_o.abs().max().item() and err_l <= 1e-2 and empty_ok
          and not torch.isnan(o).any().item() and not torch.isnan(lse).any().item())
    return dict(ok=bool(ok), max_err_o=err_o, max_err_lse=err_l, empty_ok=empty_ok)


def run_checks(variant: str) -> list[dict]:
    """Every CHECKS case eagerly, then one case captured in a CUDA graph and replayed on new
    inputs copied into the captured buffers."""
    recs = []
    for i, (B, heads, lens, ctx, page, splits) in enumerate(CHECKS):
        case = ragged_case(B, heads, lens, ctx, page, seed=i)
        garbage = torch.full((64 << 20,), float("nan"), device="cuda")   # poison the allocator
        del garbage
        t = time.time()
        o, lse = gluon_mla.mla_decode_gluon(*case, SCALE, num_splits=splits, variant=variant)
        torch.cuda.synchronize()
        rec = dict(case=i, batch=B, heads=heads, lens=lens, page=page, splits=splits,
                   seconds=time.time() - t, **compare(o, lse, *gluon_mla.reference(*case, SCALE)))
        recs.append(rec)
        print(f"  check {variant} case {i} B{B} H{heads} page {page} lens {lens[:4]} splits "
              f"{splits}: {'PASS' if rec['ok'] else 'FAIL'} o err {rec['max_err_o']:.3g} "
              f"lse err {rec['max_err_lse']:.3g}", flush=True)
    recs.append(graph_check(variant))
    return recs


def graph_check(variant: str) -> dict:
    """Capture one call in a CUDA graph, then replay it on new q / lengths / block tables."""
    ql, qr, kv, bt, lens = ragged_case(4, 128, [3000, 0, 64, 1500], 4096, 64, seed=100)
    fn = lambda: gluon_mla.mla_decode_gluon(ql, qr, kv, bt, lens, SCALE,  # noqa: E731
                                            variant=variant)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = fn()
    new = ragged_case(4, 128, [100, 4096, 0, 2222], 4096, 64, seed=101, poison=False)
    for dst, src in zip((ql, qr, kv, bt, lens), new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    rec = dict(case="cuda-graph", **compare(o, lse, *gluon_mla.reference(*new, SCALE)))
    print(f"  check {variant} cuda-graph replay on new inputs: "
          f"{'PASS' if rec['ok'] else 'FAIL'} o err {rec['max_err_o']:.3g}", flush=True)
    return rec


def phase_check(args):
    try:
        recs = run_checks(args.variant)
    except Exception:  # noqa: BLE001 - report the failure in full
        recs = [dict(case="exception", ok=False, error=traceback.format_exc())]
        print(recs[0]["error"], flush=True)
    with open(os.path.join(args.out, f"check_{args.variant}.json"), "w") as f:
        json.dump(recs, f, indent=1)


def phase_time(args):
    from helix.attention.triton_mla import mla_decode
    from profiling.bench_attention import random_pool, reference
    from profiling.roofline import L2Flush, matmul_rate
    variants = [v for v in args.variants.split(",") if v]
    mm = matmul_rate()
    print(f"bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    free = torch.cuda.mem_get_info()[0]
    cap_tokens = int(min(args.mem_cap_gb * 1e9, 0.8 * free) // ((DL + DR) * 2))
    timed = ([tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
             if args.shapes else TIMED)
    shapes = [(B, c) for B, c in timed if B * c <= cap_tokens]
    pool_tokens = min(max([B * c for B, c in shapes] + [args.pool_tokens]), cap_tokens)
    pool = random_pool((pool_tokens // 64, 64, DL + DR))
    H = args.heads
    flush, recs = L2Flush(), []
    path = os.path.join(args.out, "timings.json")
    for B, ctx in shapes:
        bt = torch.arange(B * ctx // 64, dtype=torch.int32, device="cuda").view(B, ctx // 64)
        if args.shuffle_pages:           # pages drawn at random from the whole pool
            pick = torch.randperm(pool.shape[0], device="cuda")[:B * ctx // 64]
            bt = pick.to(torch.int32).view(B, ctx // 64)
            seq = {b: pool[bt[b].long()].view(ctx, 1, DL + DR) for b in {0, B - 1}}
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        ql = torch.randn(B, H, DL, device="cuda", dtype=torch.bfloat16)
        qr = torch.randn(B, H, DR, device="cuda", dtype=torch.bfloat16)
        if not args.shuffle_pages:
            seq = pool[:B * ctx // 64].view(B, ctx, 1, DL + DR)
        rows = sorted({0, B - 1})
        refs = {b: reference(torch.cat((ql[b], qr[b]), -1)[None], seq[b], seq[b][..., :DL],
                             SCALE) for b in rows}
        flops = 2 * B * H * ctx * (DL + DR + DL)
        kernels = [] if args.no_triton else [
            ("triton", lambda: mla_decode(ql, qr, pool, bt, lens, SCALE))]
        kernels += [(f"gluon-{v}", lambda v=v: gluon_call(v, ql, qr, pool, bt, lens, SCALE))
                    for v in variants]
        for name, fn in kernels:
            recs.append(time_one(name, fn, B, ctx, H, flops, mm, rows, refs, flush, args))
            with open(path, "w") as f:
                json.dump(recs, f, indent=1)


def time_one(name, fn, B, ctx, H, flops, mm, rows, refs, flush, args) -> dict:
    """Check one kernel against the reference rows, then its CUDA-graph time."""
    from profiling.roofline import graph_time_us
    rec = dict(kernel=name, batch=B, context=ctx, heads=H, flops=flops,
               matmul_TFLOPs=mm / 1e12)
    try:
        o, lse = fn()
        errs = [compare(o[b:b + 1], lse[b:b + 1], refs[b][0][None], refs[b][1][None])
                for b in rows]
        rec.update(ok=all(e["ok"] for e in errs),
                   max_err_o=max(e["max_err_o"] for e in errs))
        us = graph_time_us(fn, args.iters, flush)
        rec.update(time_us=us, TFLOPs=flops / us / 1e6,
                   matmul_fraction=flops / us / 1e6 / (mm / 1e12))
    except Exception:  # noqa: BLE001 - keep timing the others
        rec.update(ok=False, error=traceback.format_exc())
    print(f"  {name:13} B{B:<3} ctx {ctx:>6}: " + (
        f"{rec['time_us']:9.1f} us {rec['TFLOPs']:6.1f} TFLOP/s "
        f"{100 * rec['matmul_fraction']:5.1f} % of matmul  "
        f"{'ok' if rec['ok'] else 'WRONG'}" if "time_us" in rec else
        "ERROR " + rec.get("error", "")[-400:]), flush=True)
    return rec


def compile_report(out: str) -> list[dict]:
    from profiling.gluon_resources import check
    recs = [check(v, 64, num_splits=2) for v in gluon_mla.VARIANTS]
    with open(os.path.join(out, "compile.json"), "w") as f:
        json.dump(recs, f, indent=1, default=str)
    with open(os.path.join(out, "compile.log"), "w") as f:
        for r in recs:
            f.write(json.dumps({k: v for k, v in r.items() if k != "error"}, default=str) + "\n")
            if not r["ok"]:
                f.write(r["error"] + "\n")
    for r in recs:
        head = f"compile {r['variant']:6} page {r['page']:2} splits {r['num_splits']}: "
        print(head + (f"{r['registers']} regs (maxnreg; consumers setmaxnreg), stack "
                      f"{r['stack_bytes']} B, smem {r['shared_bytes']} B, HGMMA "
                      f"{r['hgmma_shapes']}" if r["ok"] else
                      "FAILED: " + r["error"].strip().splitlines()[-1][:300]), flush=True)
    return recs


def sub(phase: str, out: str, timeout: float, **kw) -> str:
    """Run one phase in a child process (a hung kernel is killed with it)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--out", out]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    try:
        res = subprocess.run(cmd, timeout=timeout)
        return "done" if res.returncode == 0 else f"exit {res.returncode}"
    except subprocess.TimeoutExpired:
        return f"TIMEOUT after {timeout:.0f} s (deadlock?)"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the logs and JSON")
    p.add_argument("--phase", default="all", choices=["all", "check", "time"])
    p.add_argument("--variant", default="seesaw")
    p.add_argument("--variants", default=",".join(gluon_mla.VARIANTS))
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--mem-cap-gb", type=float, default=60.0, help="largest KV pool timed")
    p.add_argument("--check-timeout", type=float, default=100.0)
    p.add_argument("--time-timeout", type=float, default=180.0)
    p.add_argument("--shapes", default="", help="BxCTX,... timed instead of the default list")
    p.add_argument("--heads", type=int, default=H, help="query heads of the timed shapes")
    p.add_argument("--no-triton", action="store_true", help="time the Gluon kernels only")
    p.add_argument("--shuffle-pages", action="store_true",
                   help="block tables of pages drawn at random from the whole pool (default: "
                        "the first pages, in order)")
    p.add_argument("--pool-tokens", type=int, default=0,
                   help="KV pool size in tokens, at least the largest shape's (with "
                        "--shuffle-pages a small shape's pages spread over all of it)")
    p.add_argument("--skip-checks", action="store_true",
                   help="time without the correctness subprocesses (the timing checks rows)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.phase == "check":
        return phase_check(args)
    if args.phase == "time":
        return phase_time(args)

    t0 = time.time()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    import triton
    print(f"triton {triton.__version__}", flush=True)
    compiled = {r["variant"] for r in compile_report(args.out) if r["ok"]}
    specs = [v for v in args.variants.split(",") if split_spec(v)[0] in compiled]
    status = {}
    for v in dict.fromkeys(split_spec(v)[0] for v in specs):      # each variant checked once
        if args.skip_checks:
            status[v] = "checks skipped"
            continue
        status[v] = sub("check", args.out, args.check_timeout, variant=v)
        path = os.path.join(args.out, f"check_{v}.json")
        recs = json.load(open(path)) if os.path.exists(path) else []
        status[v] += ", all PASS" if bool(recs) and all(r["ok"] for r in recs) else ", FAIL"
    passed = [v for v in specs if not status[split_spec(v)[0]].endswith("FAIL")]
    extra = dict(shapes=args.shapes, heads=args.heads, iters=args.iters,
                 pool_tokens=args.pool_tokens)
    status["timing"] = sub("time", args.out, args.time_timeout, variants=",".join(passed),
                           **extra, **({"no_triton": True} if args.no_triton else {}),
                           **({"shuffle_pages": True} if args.shuffle_pages else {}))
    summarize(args.out, status, time.time() - t0)


def summarize(out: str, status: dict, seconds: float) -> None:
    lines = [f"bench_mla_gluon: {seconds:.0f} s"]
    lines += [f"  {k}: {v}" for k, v in status.items()]
    path = os.path.join(out, "timings.json")
    recs = json.load(open(path)) if os.path.exists(path) else []
    by = {}
    for r in recs:
        by.setdefault((r["batch"], r["context"]), {})[r["kernel"]] = r
    kernels = sorted({r["kernel"] for r in recs})
    lines.append(f"{'shape':>14} " + " ".join(f"{k:>22}" for k in kernels))
    for (B, ctx), row in by.items():
        cells = []
        for k in kernels:
            r = row.get(k, {})
            cells.append(f"{r['time_us']:8.1f}us {100 * r['matmul_fraction']:5.1f}%"
                         f"{'' if r['ok'] else ' BAD'}" if "time_us" in r else f"{'-':>22}")
        lines.append(f"B{B:<3} x {ctx:>7} " + " ".join(f"{c:>22}" for c in cells))
    text = "\n".join(lines)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
