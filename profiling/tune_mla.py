"""Compare launch configs of the absorbed-MLA decode kernel (helix/attention/triton_mla.py) on
one GPU, against the roofline measured in the same run.

Shapes (one rank, DeepSeek-V3 absorbed: 128 heads, Dl 512 + Dr 64, bf16, page 64):
batch x context (1, 65536), (8, 65536), (1, 262144). For every candidate in CANDIDATES (each
chosen from compile-time resources, `python profiling/kernel_resources.py --mla-candidates`:
no real spills, shared memory <= 227 KB):
  - correctness once: a ragged batch (lengths 4133, 0, 777, 1 over random pages, so partial
    tiles, an empty sequence and split merging are all exercised) and the first timed shape,
    against a torch fp32 reference, loose bf16 tolerance; a config that fails is not timed;
  - time: median CUDA-graph replay with the L2 flushed before every replay (KV >> L2 anyway);
  - floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured here (a device
    copy, an 8192^3 GEMM); roofline fraction = floor / time.
One line per (config, shape), then a summary naming the best config (geometric mean of the
roofline fractions over the shapes), and JSON to --out (written after every measurement, so a
crash keeps what was measured). Every config is tried in its own try/except; configs are
ordered safest first. Budget: < 120 s on an H200 (--budget-s stops early, reporting what ran).

    python profiling/tune_mla.py --out profiling/results/tune_mla_h200.json
    TRITON_INTERPRET=1 python profiling/tune_mla.py --smoke --out /tmp/tune_mla_smoke.json  (CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:                      # the interpreter must be on before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention.triton_mla import mla_decode, mla_plan  # noqa: E402

# name -> overrides of helix.attention.triton_mla.MLA_TUNABLES (the rest: mla_launch_config's
# defaults, today those of "split-bn64-rowsum", the best of the first H200 run; every candidate
# names DEFER_L so it keeps the meaning it was measured with). Compile-time resources on sm_90,
# triton 3.6 (registers / stack bytes / shared bytes / wgmma per tile):
CANDIDATES = [   # most informative first: --budget-s skips from the end. Each names USE_TMA
    # and split_policy itself: the kernel's defaults (mla_launch_config) moved to TMA + fill
    # today's default: QK^T split across the warpgroups (36 m64n32k16 + 4 m64n256k16 per 64
    # tokens), eager rescale, per-tile row sum. 221 / 0 / 229376 (the baseline of this run)
    ("split-bn64-rowsum", dict(DEFER_L=False, USE_TMA=False, split_policy="2waves")),
    # USE_TMA: full tiles through in-kernel tensor descriptors (TMA + mbarrier, no per-thread
    # address math or cp.async), the partial last tile through masked loads (a second loop).
    # 255 / 8 (4 B spilled) / 230400, 2 x (36 + 4) wgmma (two loop bodies)
    ("tma-bn64", dict(USE_TMA=True, DEFER_L=False, split_policy="2waves")),
    # - with the fewest splits that fill the last wave (B=8: 8 splits, one wave)
    ("tma-bn64-fill", dict(USE_TMA=True, split_policy="fill", DEFER_L=False)),
    # PIPE_QK: the QK^T of tile i + 1 issued before the softmax of tile i (latent product
    # kept in flight), 32-token tiles (the tile is loaded twice, as K and as V: 2 x (36 + 32)
    # KB buffers). 246 / 0 / 217088; but ptxas serializes its wgmma (C7514: the carried S is
    # copied at the back edge while in flight), see triton_mla.py
    ("pipe-bn32", dict(PIPE_QK=True, BLOCK_N=32, DEFER_L=False, USE_TMA=False,
                        split_policy="2waves")),
    # the previous default (split-bn64-rowsum's denominator deferred). 229 / 0 / 229376
    ("split-bn64", dict(DEFER_L=True, USE_TMA=False, split_policy="2waves")),
    ("split-bn64-fill", dict(split_policy="fill", DEFER_L=True, USE_TMA=False)),
    # the kernel before the QK^T split: warps [8, 1] on QK^T -> both warpgroups compute the
    # same S with m64n16k16 (72 wgmma per 32-token tile); lazy rescale. 255 / 0 / 147472
    ("old-bn32-dupqk", dict(BLOCK_N=32, SPLIT_QK=False, RESCALE_LOG2=8.0, DEFER_L=False,
                            USE_TMA=False, split_policy="2waves")),
    # 32-token tiles, 4 KV buffers. 214 / 0 / 225280
    ("split-bn32-s4", dict(BLOCK_N=32, num_stages=4, DEFER_L=True, USE_TMA=False,
                           split_policy="2waves")),
    # fill + bf16 split partials. 255 / 0 / 229376
    ("split-bn64-fill-bf16part", dict(split_policy="fill", partial_dtype=torch.bfloat16,
                                      DEFER_L=True, USE_TMA=False)),
    # dropped after the first H200 run (tune_mla_h200.json, geomean roofline): split-bn64-lazy
    # 27.1 %, split-bn64-bf16part 28.8 %, split-bn64-w16 28.0 %, split-bn32-s4-lazy 25.9 %,
    # split-bn32-s3 27.2 %, split-bn32-s2 22.2 % (split-bn64-rowsum: 32.7 %)
]

GPU_DIMS = dict(h=128, dl=512, dr=64, page=64, dtype=torch.bfloat16)
GPU_SHAPES = [(1, 65536), (8, 65536), (1, 262144)]
GPU_CHECK_LENS = [4133, 0, 777, 1]
# the interpreter (CPU): tiny dims; fp16 (the interpreter mishandles bf16 dots)
SMOKE_DIMS = dict(h=16, dl=64, dr=16, page=64, dtype=torch.float16)
SMOKE_SHAPES = [(1, 256), (2, 256), (1, 512)]
SMOKE_CHECK_LENS = [600, 0, 70, 1]


def mla_cost(B: int, ctx: int, h: int, dl: int, dr: int, elt: int) -> tuple[int, int]:
    """(bytes, flops) of one decode step, as profiling/bench_attention.py counts them: the
    latent KV read once, Q and O once; QK^T (Dl + Dr) and PV (Dl) products."""
    return (B * ctx * (dl + dr) * elt + B * h * (dl + dr + dl) * elt,
            2 * B * h * ctx * (dl + dr + dl))


def reference(ql, qr, pool, bt, lens, scale):
    """fp32 torch MLA decode: o [B, H, Dl], lse [B, H] (-inf / 0 for empty sequences)."""
    B, H, Dl = ql.shape
    page = pool.shape[1]
    o = torch.zeros(B, H, Dl, dtype=torch.float32, device=ql.device)
    lse = torch.full((B, H), float("-inf"), device=ql.device)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        pages = bt[b, :triton.cdiv(n, page)].long()
        kv = pool[pages].reshape(-1, pool.shape[-1])[:n].float()              # [n, Dl + Dr]
        q = torch.cat((ql[b], qr[b]), -1).float()                             # [H, Dl + Dr]
        s = (q @ kv.T) * scale
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.softmax(s, -1) @ kv[:, :Dl]
    return o, lse


def check(o, lse, ref_o, ref_lse):
    """Loose (bf16) tolerance; returns the max abs errors or raises."""
    err_o = (o.float() - ref_o).abs().max().item()
    fin = torch.isfinite(ref_lse)
    if not torch.equal(fin, torch.isfinite(lse)):
        raise AssertionError("lse: -inf pattern differs from the reference")
    err_l = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    if not (err_o < 2e-2 + 2e-2 * ref_o.abs().max().item() and err_l < 2e-2):
        raise AssertionError(f"max |o err| {err_o:.3g}, max |lse err| {err_l:.3g}")
    return max(err_o, err_l)


class Bench:
    def __init__(self, args):
        self.smoke = args.smoke
        self.dev = torch.device("cpu" if args.smoke else "cuda")
        self.dims = SMOKE_DIMS if args.smoke else GPU_DIMS
        self.shapes = SMOKE_SHAPES if args.smoke else GPU_SHAPES
        if args.shapes:
            self.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        self.check_lens = SMOKE_CHECK_LENS if args.smoke else GPU_CHECK_LENS
        self.iters = args.iters
        d = self.dims
        self.scale = 192 ** -0.5                 # DeepSeek's qk head dim (128 + 64)
        gen = torch.Generator(device="cpu").manual_seed(0)
        page = d["page"]
        B = len(self.check_lens)
        width = max(triton.cdiv(n, page) for n in self.check_lens) + 1
        bench_pages = max(B_ * ctx for B_, ctx in self.shapes) // page
        self.num_pages = max(bench_pages, B * width) + 8
        self.pool = torch.empty(self.num_pages, page, d["dl"] + d["dr"], dtype=d["dtype"],
                                device=self.dev)
        flat = self.pool.view(-1)
        for i in range(0, flat.numel(), 1 << 28):
            flat[i:i + (1 << 28)].normal_()
        # the ragged correctness batch: random distinct pages, one spare column
        perm = torch.randperm(self.num_pages, generator=gen)[:B * width]
        self.check_bt = perm.view(B, width).int().to(self.dev)
        self.check_lens_t = torch.tensor(self.check_lens, dtype=torch.int32, device=self.dev)
        self.check_q = self._queries(B)
        self.check_ref = reference(*self.check_q, self.pool, self.check_bt, self.check_lens_t,
                                   self.scale)
        self.first_ref = None

    def _queries(self, B):
        d = self.dims
        return (torch.randn(B, d["h"], d["dl"], device=self.dev).to(d["dtype"]),
                torch.randn(B, d["h"], d["dr"], device=self.dev).to(d["dtype"]))

    def shape_inputs(self, B, ctx):
        page = self.dims["page"]
        bt = torch.arange(B * ctx // page, dtype=torch.int32, device=self.dev).view(B, -1)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=self.dev)
        torch.manual_seed(B * 1000003 + ctx)
        return (*self._queries(B), bt, lens)

    def run(self, config, ql, qr, bt, lens):
        return mla_decode(ql, qr, self.pool, bt, lens, self.scale, config=config)

    def verify(self, config):
        o, lse = self.run(config, *self.check_q, self.check_bt, self.check_lens_t)
        err = check(o, lse, *self.check_ref)
        B, ctx = self.shapes[0]
        inputs = self.shape_inputs(B, ctx)
        if self.first_ref is None:
            self.first_ref = reference(*inputs[:2], self.pool, *inputs[2:], self.scale)
        o, lse = self.run(config, *inputs)
        return max(err, check(o, lse, *self.first_ref))

    def time_us(self, fn):
        if self.smoke:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        from profiling.roofline import graph_time_us
        return graph_time_us(fn, self.iters, self.flush)

    def ceilings(self):
        """(copy bytes/s, matmul FLOP/s): measured on the GPU; rough CPU numbers in smoke."""
        if self.smoke:
            a = torch.randn(256, 256)
            t0 = time.perf_counter()
            for _ in range(10):
                a @ a
            mm = 10 * 2 * 256**3 / (time.perf_counter() - t0)
            x = torch.empty(1 << 24, dtype=torch.uint8)
            t0 = time.perf_counter()
            x.clone()
            return 2 * x.numel() / (time.perf_counter() - t0), mm
        from profiling.roofline import L2Flush, copy_bandwidth, matmul_rate
        self.flush = L2Flush()
        return copy_bandwidth(gib=2.0, iters=6), matmul_rate(iters=10)


def jsonable(config: dict) -> dict:
    return {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
            for k, v in config.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file for the records")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU through the Triton interpreter (sets "
                        "TRITON_INTERPRET=1): checks the script end to end")
    p.add_argument("--configs", default=None, help="comma list of candidate names (default all)")
    p.add_argument("--shapes", default=None, help="comma list of BxCTX, e.g. 1x65536,8x65536")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                   help='one more candidate, e.g. \'mine={"BLOCK_N": 32, "num_stages": 3, '
                        '"partial_dtype": "bfloat16"}\' (repeatable; run after the list)')
    p.add_argument("--iters", type=int, default=10, help="graph replays timed per measurement")
    p.add_argument("--budget-s", type=float, default=100.0,
                   help="stop starting new configs after this many seconds")
    args = p.parse_args()
    t_start = time.time()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke for the interpreter on CPU)")
    names = args.configs.split(",") if args.configs else [n for n, _ in CANDIDATES]
    known = dict(CANDIDATES)
    for item in args.extra:
        name, _, text = item.partition("=")
        config = json.loads(text)
        if isinstance(config.get("partial_dtype"), str):
            config["partial_dtype"] = getattr(torch, config["partial_dtype"])
        known[name] = config
        names.append(name)
    missing = [n for n in names if n not in known]
    if missing:
        sys.exit(f"unknown configs {missing}; known: {list(known)}")

    bench = Bench(args)
    copy_bw, mm = bench.ceilings()
    d = bench.dims
    elt = torch.tensor([], dtype=d["dtype"]).element_size()
    device = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"{device}: copy {copy_bw / 1e9:.0f} GB/s, matmul {mm / 1e12:.1f} TFLOP/s, triton "
          f"{triton.__version__}, torch {torch.__version__}", flush=True)
    result = dict(device=device, triton=triton.__version__, torch=torch.__version__,
                  copy_GBps=copy_bw / 1e9, matmul_TFLOPs=mm / 1e12, dims=jsonable(d),
                  shapes=bench.shapes, candidates={n: jsonable(known[n]) for n in names},
                  records=[], failures={}, skipped=[])

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for name in names:
        config = known[name]
        if time.time() - t_start > args.budget_s:
            result["skipped"].append(name)
            print(f"{name:<33} skipped: time budget", flush=True)
            continue
        t_cfg = time.time()
        try:
            err = bench.verify(config)
        except Exception as e:  # noqa: BLE001 - report, go on with the next config
            result["failures"][name] = f"{type(e).__name__}: {str(e)[-400:]}"
            print(f"{name:<33} FAILED check: {type(e).__name__}: {str(e)[-300:]}", flush=True)
            save()
            continue
        for B, ctx in bench.shapes:
            ql, qr, bt, lens = bench.shape_inputs(B, ctx)
            cfg, splits, _ = mla_plan(B, d["h"], d["dl"], d["dr"], d["dtype"],
                                      bt.shape[1] * d["page"], bench.dev, config)
            try:
                t = bench.time_us(lambda: bench.run(config, ql, qr, bt, lens))  # noqa: B023
            except Exception as e:  # noqa: BLE001
                result["failures"][f"{name} B{B} ctx{ctx}"] = f"{type(e).__name__}: {e}"[:400]
                print(f"{name:<33} B{B:<2} ctx {ctx:>7}: FAILED {type(e).__name__}: "
                      f"{str(e)[-300:]}", flush=True)
                continue
            nbytes, flops = mla_cost(B, ctx, d["h"], d["dl"], d["dr"], elt)
            floor = max(nbytes / copy_bw, flops / mm) * 1e6
            rec = dict(config=name, batch=B, context=ctx, num_splits=splits,
                       programs=B * splits * triton.cdiv(d["h"], cfg["BLOCK_H"]),
                       time_us=t, floor_us=floor, roofline_fraction=floor / t,
                       TFLOPs=flops / t / 1e6, max_err=err)
            result["records"].append(rec)
            print(f"{name:<33} B{B:<2} ctx {ctx:>7}: {t:9.1f} us  floor {floor:8.1f} us  "
                  f"{100 * floor / t:5.1f}% roofline  {flops / t / 1e6:6.1f} TFLOP/s  "
                  f"splits {splits:<3} err {err:.2g}", flush=True)
            save()
        print(f"{'':<33} ({time.time() - t_cfg:.1f} s with compile)", flush=True)

    # summary: geometric mean of the roofline fractions over the shapes a config completed
    summary = {}
    for name in names:
        recs = [r for r in result["records"] if r["config"] == name]
        if len(recs) == len(bench.shapes):
            summary[name] = math.exp(sum(math.log(r["roofline_fraction"]) for r in recs)
                                     / len(recs))
    result["summary_geomean_roofline"] = summary
    per_shape = {}
    for B, ctx in bench.shapes:
        recs = [r for r in result["records"] if (r["batch"], r["context"]) == (B, ctx)]
        if recs:
            best = min(recs, key=lambda r: r["time_us"])
            per_shape[f"B{B}x{ctx}"] = dict(config=best["config"], time_us=best["time_us"],
                                            roofline_fraction=best["roofline_fraction"])
    result["best_per_shape"] = per_shape
    cols = [f"B{B}x{ctx}" for B, ctx in bench.shapes]
    print(f"{'roofline %':<33} " + " ".join(f"{c:>11}" for c in cols) + "     geomean", flush=True)
    for name in names:
        frac = {f"B{r['batch']}x{r['context']}": r["roofline_fraction"]
                for r in result["records"] if r["config"] == name}
        cells = " ".join(f"{100 * frac[c]:11.1f}" if c in frac else f"{'-':>11}" for c in cols)
        geo = f"{100 * summary[name]:11.1f}" if name in summary else f"{'-':>11}"
        print(f"{name:<33} {cells} {geo}", flush=True)
    if summary:
        best = max(summary, key=summary.get)
        result["best"] = dict(name=best, config=jsonable(known[best]),
                              geomean_roofline=summary[best])
        shapes = ", ".join(f"{k}: {v['config']} {100 * v['roofline_fraction']:.1f}%"
                           for k, v in per_shape.items())
        print(f"BEST {best} {jsonable(known[best])}: geomean {100 * summary[best]:.1f}% of "
              f"roofline; per shape: {shapes}; total {time.time() - t_start:.0f} s", flush=True)
    else:
        print(f"BEST none: no config completed every shape; total {time.time() - t_start:.0f} s",
              flush=True)
    save()


if __name__ == "__main__":
    main()
