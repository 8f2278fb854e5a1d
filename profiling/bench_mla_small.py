"""Absorbed MLA decode at small batch, timed as a decode step runs it: a chain of one launch per
layer (each layer its own paged KV cache, so nothing is served from L2 across layers), captured
in one CUDA graph with PDL as the engine launches it. Per-layer time = graph time / layers.

Part "small": DeepSeek-V2-Lite's rank (16 heads, latent 512 + rope 64, page 64, bf16) at batch
1-2, each variant against the copy floor of its KV bytes and two ceilings measured in the same
run: a read-only Triton kernel streaming the same tiles over the same grid (what the split
layout allows), and a device copy of the same bytes.
Part "pairs": the Gluon kernel at 128 heads on the largest working sets with 1x / 2x / 4x the
default splits (issue 16: do the two head-block programs of a split drift apart?).

    PYTHONPATH=. python profiling/bench_mla_small.py --out $OUT/mla_small.json [--parts small,pairs]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import gluon_mla, triton_mla_few  # noqa: E402
from helix.attention.triton_splits import (fill_num_splits, sm_count_of,  # noqa: E402
                                           split_range, token_rows)
from helix.perf.rates import copy_bandwidth, event_median, matmul_rate  # noqa: E402
from helix.triton_util import pdl_sync, run_kernel  # noqa: E402

HEADS, DL, DR, PAGE = 16, 512, 64, 64
SCALE = 192 ** -0.5


@triton.jit
def _stream_kernel(kv_ptr, bt_ptr, lens_ptr, out_ptr, stride_kvp, stride_kvt, stride_btb,
                   num_splits, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PDL: tl.constexpr = False):
    """Reads the KV tiles of one (split, sequence) as the few-heads kernel does (latent and
    rope columns as two loads), sums them: the memory ceiling of that grid and tiling."""
    pdl_sync(PDL)
    split = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kv_len = tl.load(lens_ptr + b)
    start, end = split_range(kv_len, split, num_splits, BLOCK_N)
    cl = tl.arange(0, D_LATENT)
    cr = tl.arange(0, D_ROPE)
    acc = tl.zeros([D_LATENT], dtype=tl.float32)
    acc_r = tl.zeros([D_ROPE], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        rows, tmask = token_rows(bt_ptr + b * stride_btb, t0, end, stride_kvp, stride_kvt,
                                 BLOCK_N, PAGE_SIZE)
        c = tl.load(kv_ptr + rows[:, None] + cl[None, :], mask=tmask[:, None], other=0.0)
        r = tl.load(kv_ptr + rows[:, None] + D_LATENT + cr[None, :], mask=tmask[:, None],
                    other=0.0)
        acc += tl.sum(c.to(tl.float32), axis=0)
        acc_r += tl.sum(r.to(tl.float32), axis=0)
    tl.store(out_ptr + b * num_splits + split, tl.sum(acc, axis=0) + tl.sum(acc_r, axis=0))


def stream(kv, bt, lens, out, num_splits, block_n=64, stages=2, warps=8):
    B = bt.shape[0]
    run_kernel(_stream_kernel, (num_splits, B), kv, bt, lens, out, kv.stride(0), kv.stride(1),
               bt.stride(0), num_splits, D_LATENT=DL, D_ROPE=DR, BLOCK_N=block_n,
               PAGE_SIZE=kv.shape[1], num_warps=warps, num_stages=stages)


def chain_us(calls, iters: int) -> float:
    """Median us of one replay of a graph running calls[0](), calls[1](), ... in order."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    us = event_median(g.replay, iters) * 1e6
    del g
    return us


def layer_inputs(batch: int, heads: int, ctx: int, layers: int, gen, table_tokens: int = 0):
    """Per layer: (q_latent, q_rope, kv pool, block table, lens), pages shuffled per layer. The
    block table holds max(ctx, table_tokens) tokens (an engine's tables hold its max context,
    and kernels size their splits from the width), of which ctx are live."""
    out = []
    width = -(-max(ctx, table_tokens) // PAGE)
    for _ in range(layers):
        pages = batch * width
        kv = torch.randn(pages, PAGE, DL + DR, generator=gen, device="cuda",
                         dtype=torch.bfloat16)
        bt = torch.randperm(pages, generator=gen, device="cuda").int().view(batch, width)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        ql = torch.randn(batch, heads, DL, generator=gen, device="cuda", dtype=torch.bfloat16)
        qr = torch.randn(batch, heads, DR, generator=gen, device="cuda", dtype=torch.bfloat16)
        out.append((ql, qr, kv, bt, lens))
    return out


def flagged(fn, **flags):
    """fn run with gluon_mla's module flags set to `flags` (restored after each call)."""
    def run(x):
        saved = {k: getattr(gluon_mla, k) for k in flags}
        for k, v in flags.items():
            setattr(gluon_mla, k, v)
        try:
            return fn(x)
        finally:
            for k, v in saved.items():
                setattr(gluon_mla, k, v)
    return run


def small_variants(batch: int, ctx: int, sms: int, full: bool, table: int = 0):
    """(name, fn(layer inputs) -> None) of every variant timed at one shape (full: with the
    few-heads kernel's split / tile variants, all three stream depths)."""
    auto = fill_num_splits(batch, 1, max(ctx, table), sms, min_tokens=128, max_splits=128)
    v = []

    def few(cfg=None, splits=None):
        return lambda x: triton_mla_few.mla_decode_few(*x, SCALE, num_splits=splits, config=cfg)

    v.append(("few", few()))
    if full:
        for s in (16, 32, 64, 256):
            if s != auto and s * 128 <= batch * ctx * 2:
                v.append((f"few-s{s}", few(splits=s)))
        v.append(("few-bn32-st3", few(dict(BLOCK_N=32, num_stages=3, min_tokens=64))))
        v.append(("few-bn32-st4", few(dict(BLOCK_N=32, num_stages=4, min_tokens=64))))
        v.append(("few-w8", few(dict(num_warps=8))))
        v.append(("few-bf16-partials", few(dict(partial_dtype=torch.bfloat16))))

    def few_kernel_only(x):
        # the split kernel without the reduce: the reduce's cost is the difference
        ql, qr, kv, bt, lens = x
        cfg, n, _ = triton_mla_few.few_plan(batch, HEADS, DL, DR, kv.dtype, bt.shape[1] * PAGE,
                                            ql.device)
        o_ws = torch.empty(batch, HEADS, n, DL, device="cuda")
        l_ws = torch.empty(batch, HEADS, n, device="cuda")
        run_kernel(triton_mla_few._mla_few_kernel, (n, batch), ql, qr, kv, bt, lens, o_ws,
                   l_ws, SCALE * 1.4426950408889634, ql.stride(0), ql.stride(1), qr.stride(0),
                   qr.stride(1), kv.stride(0), kv.stride(1), bt.stride(0), o_ws.stride(0),
                   o_ws.stride(1), o_ws.stride(2), l_ws.stride(0), l_ws.stride(1), HEADS, n,
                   D_LATENT=DL, D_ROPE=DR, PAGE_SIZE=PAGE, DOT_PRECISION="tf32", **cfg)
    v.append(("few-kernel-only", few_kernel_only))
    if gluon_mla.gluon_available(torch.device("cuda")):
        v.append(("gluon", lambda x: gluon_mla.mla_decode_gluon(*x, SCALE)))
        if gluon_mla.gluon_available(torch.device("cuda"), "few"):
            v.append(("gluon-few", lambda x: gluon_mla.mla_decode_gluon(*x, SCALE,
                                                                        variant="few")))
            for s in ((16, 32, 64) if full else ()):       # fewer splits: a cheaper merge
                if s * 64 <= max(ctx, table):
                    v.append((f"gluon-few-s{s}", lambda x, s=s: gluon_mla.mla_decode_gluon(
                        *x, SCALE, num_splits=s, variant="few")))
        v.append(("gluon-nopdl", flagged(lambda x: gluon_mla.mla_decode_gluon(*x, SCALE),
                                         PDL=False)))
        v.append(("gluon-kv-late", flagged(lambda x: gluon_mla.mla_decode_gluon(*x, SCALE),
                                           KV_EARLY=False)))
        v.append(("gluon-noskip", flagged(lambda x: gluon_mla.mla_decode_gluon(*x, SCALE),
                                          SKIP_EMPTY=False)))
        v.append(("gluon-7a34bf8", flagged(lambda x: gluon_mla.mla_decode_gluon(*x, SCALE),
                                           PDL=False, MAX_SPLITS=64, SKIP_EMPTY=False)))
    if table > ctx:              # the ceilings of the live bytes need a pool of those alone
        return v, auto
    outs = {}
    for stages in ((2, 3, 4) if full else (2,)):
        def st(x, stages=stages):
            o = outs.setdefault(id(x[2]), torch.empty(batch * 256, device="cuda"))
            stream(x[2], x[3], x[4], o, auto, stages=stages)
        v.append((f"stream-st{stages}", st))
    copies = {}

    def copy(x):
        dst = copies.setdefault(id(x[2]), torch.empty_like(x[2]))
        dst.copy_(x[2])
    v.append(("copy", copy))
    return v, auto


def bench_small(args, copy_bw: float) -> list[dict]:
    recs = []
    sms = sm_count_of(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in args.batches:
        for ctx in args.contexts:
            layers = args.layers
            xs = layer_inputs(batch, HEADS, ctx, layers, gen, args.table_tokens)
            nbytes = batch * ctx * (DL + DR) * 2         # the live tokens' KV
            variants, auto = small_variants(batch, ctx, sms, args.all_variants,
                                            args.table_tokens)
            ref = triton_mla_few.mla_decode_few(*xs[0], SCALE)[0].float()
            for name, fn in variants:
                try:
                    if name.startswith(("few", "gluon")) and name != "few-kernel-only":
                        o = fn(xs[0])[0].float()
                        err = ((o - ref).norm() / ref.norm()).item()
                    else:
                        err = None
                    us = chain_us([lambda x=x, fn=fn: fn(x) for x in xs], args.iters) / layers
                except Exception as e:  # noqa: BLE001 - a variant that fails is reported
                    print(f"  {name} @ {batch}x{ctx}: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    continue
                floor_us = nbytes / copy_bw * 1e6 * (2 if name == "copy" else 1)
                recs.append(dict(part="small", batch=batch, context=ctx, variant=name,
                                 auto_splits=auto, us=us, kv_bytes=nbytes, floor_us=floor_us,
                                 floor_frac=floor_us / us, rel_err_vs_few=err))
                print(json.dumps(recs[-1]), flush=True)
            del xs
            torch.cuda.empty_cache()
    return recs


def bench_pairs(args) -> list[dict]:
    """The Gluon kernel on the largest working sets: 128 heads (two head-block programs read
    each split's KV) and 64 heads (one program: no pair to drift apart), block tables in
    shuffled page order (the benches') and in pool order, default and doubled splits."""
    recs = []
    if not gluon_mla.gluon_available(torch.device("cuda")):
        print("  gluon not available: part pairs skipped", flush=True)
        return recs
    gen = torch.Generator(device="cuda").manual_seed(1)
    sms = sm_count_of(torch.device("cuda"))
    for batch, ctx in args.pair_shapes:
        x = layer_inputs(batch, 128, ctx, 1, gen)[0]
        bt = x[3]
        in_order = torch.arange(bt.numel(), device="cuda", dtype=torch.int32).view_as(bt)
        for heads in (128, 64):
            auto = gluon_mla.plan(batch, heads, ctx, sms).num_splits
            for order, table in (("shuffled", bt), ("in-order", in_order)):
                for mult in ((1, 2) if heads == 128 else (1,)):
                    n = auto * mult
                    fn = lambda h=heads, n=n, t=table, x=x: gluon_mla.mla_decode_gluon(  # noqa
                        x[0][:, :h], x[1][:, :h], x[2], t, x[4], SCALE, num_splits=n)
                    us = chain_us([fn], args.iters)
                    flop = 2 * batch * heads * ctx * (DL + DR + DL)
                    recs.append(dict(part="pairs", batch=batch, context=ctx, heads=heads,
                                     pages=order, splits=n, auto_splits=auto, us=us,
                                     kv_gb=x[2].numel() * 2 / 1e9, tflops=flop / us / 1e6,
                                     matmul_frac=flop / us / 1e-6 / args.matmul))
                    print(json.dumps(recs[-1]), flush=True)
        x = bt = in_order = None
        torch.cuda.empty_cache()
    return recs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="small,pairs")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--contexts", default="1024,8192,32768,131072")
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--table-tokens", type=int, default=0,
                   help="block-table width in tokens (an engine's max context; 0: the context)")
    p.add_argument("--all-variants", action="store_true",
                   help="the few-heads kernel's split / tile variants and every stream depth")
    p.add_argument("--pair-shapes", default="8x524288,32x524288,64x262144,64x524288",
                   help="batch x context of part pairs")
    args = p.parse_args(argv)
    args.pair_shapes = [tuple(int(v) for v in x.split("x")) for x in args.pair_shapes.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    t0 = time.time()
    copy_bw = copy_bandwidth()
    args.matmul = matmul_rate() if "pairs" in args.parts else 0.0
    recs = []
    parts = args.parts.split(",")
    if "small" in parts:
        recs += bench_small(args, copy_bw)
    if "pairs" in parts:
        recs += bench_pairs(args)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, copy_gbps=copy_bw / 1e9,
                matmul_tflops=args.matmul / 1e12, args=vars(args),
                seconds=time.time() - t0)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, records=recs), f, indent=1)
    print("\nvariant            " + "".join(f"{b}x{c // 1024}K".rjust(12)
                                            for b in args.batches for c in args.contexts))
    names = list(dict.fromkeys(r["variant"] for r in recs if r["part"] == "small"))
    for n in names:
        row = []
        for b in args.batches:
            for c in args.contexts:
                r = [x for x in recs if x["part"] == "small" and x["variant"] == n
                     and x["batch"] == b and x["context"] == c]
                row.append(f"{r[0]['us']:.1f}({r[0]['floor_frac']:.2f})" if r else "-")
        print(n.ljust(19) + "".join(x.rjust(12) for x in row))
    for r in recs:
        if r["part"] == "pairs":
            print(f"pairs {r['batch']}x{r['context'] // 1024}K {r['heads']} heads "
                  f"{r['pages']} splits {r['splits']}: {r['us']:.0f} us "
                  f"{r['tflops']:.0f} TFLOP/s ({r['matmul_frac']:.1%})")


if __name__ == "__main__":
    main()
