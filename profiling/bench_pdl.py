"""Programmatic dependent launch (helix.triton_util: PDL) on chains of short kernels, and the
skinny projection kernel (helix.layers.skinny_gemm) against cuBLAS, one GPU.

A decode step at batch 1 is hundreds of dependent kernels of a few microseconds each; this
measures what PDL saves per kernel boundary, in CUDA graphs, with the same kernels and data
launched with and without it in the same process:

  (a) norm chain: N launches of the production rms_norm kernel (helix.layers.fused_ops), each
      normalising the previous one's output (one row of 2048, one program; and 64 rows);
  (b) norm + GEMM chain: the same with a cuBLAS GEMV (F.linear, [rows, 2048] x [2048, 2048]^T)
      between the norms, as a decode layer's norm -> projection -> norm;
  (c) decode kernels: N repetitions of a DeepSeek-V2-Lite-sized MLA sequence of Helix kernels
      (kv row, append, few-heads MLA at 1 x 4K with its split merge, absorb_v).

Each chain's outputs with PDL are compared bitwise with those without (the kernels are
deterministic), and the time per launch of both is reported.

  (d) projections alone (graph replay, L2 flushed): DeepSeek-V2-Lite's q (3072 x 2048), kv_a
      (576 x 2048), o (2048 x 2048), W_UK (16 x 512 x 128) and W_UV (16 x 128 x 512) at 1 and
      8 rows, cuBLAS (F.linear / einsum) against the skinny kernel; us and fraction of the
      copy rate for the weight's bytes;
  (e) a decode layer's projection chain, 27 times: norm -> q -> W_UK, norm -> kv_a, W_UV -> o,
      cuBLAS (PDL on for the norms) against the skinny kernels (all PDL).

  (f) synchronisation costs, one program an SM, 4 warps: a chain of N empty PDL kernels
      (each waits for the previous one, program 0 stores a word), the same with every
      program loading the word the previous kernel wrote, against ONE launch whose programs
      meet N times at a grid barrier (count in with a release atomic, then poll with acquire
      loads, or with atomic reads): what a persistent kernel pays per dependent phase
      against what a kernel boundary costs (profiling/results/mla_out.md). `--sync-only`
      runs only this.

    python profiling/bench_pdl.py --out pdl.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix import triton_util  # noqa: E402
from helix.attention import triton_append, triton_mla_few  # noqa: E402
from helix.layers import fused_mla, fused_ops, skinny_gemm  # noqa: E402
from profiling.roofline import graph_time_us  # noqa: E402


def norm_chain(rows: int, n: int, gemm: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    m = (torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16, generator=g) / 45)
    out = {}

    def fn():
        y = x
        for _ in range(n):
            y = fused_ops.rms_norm(y, w, 1e-6)
            if gemm:
                y = F.linear(y, m)
        out["y"] = y
    return fn, out, n * (2 if gemm else 1)


def mla_chain(n: int, context: int = 4096):
    g = torch.Generator(device="cuda").manual_seed(0)
    H, Dl, Dr, page = 16, 512, 64, 64
    pages = context // page + 1
    kv = torch.randn(pages, page, Dl + Dr, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.arange(pages, device="cuda", dtype=torch.int32)[None]
    lens = torch.tensor([context], device="cuda", dtype=torch.int32)
    slots = torch.tensor([context - 1], device="cuda", dtype=torch.int64)
    pos = torch.tensor([context - 1], device="cuda", dtype=torch.int64)
    ckv = torch.randn(1, Dl + Dr, device="cuda", dtype=torch.bfloat16, generator=g)
    norm_w = torch.ones(Dl, device="cuda", dtype=torch.bfloat16)
    cos = torch.rand(context, Dr // 2, device="cuda", generator=g)
    sin = torch.rand(context, Dr // 2, device="cuda", generator=g)
    ql = torch.randn(1, H, Dl, device="cuda", dtype=torch.bfloat16, generator=g)
    qr = torch.randn(1, H, Dr, device="cuda", dtype=torch.bfloat16, generator=g)
    w_uv = torch.randn(H, 128, Dl, device="cuda", dtype=torch.bfloat16, generator=g) / 22
    out = {}

    def fn():
        c = ckv
        for _ in range(n):
            row, q = fused_mla.mla_kv_row(c, norm_w, 1e-6, cos, sin, pos, False, qr)
            triton_append.append_kv(kv, row, slots)
            o, _ = triton_mla_few.mla_decode_few(ql, q, kv, bt, lens, 0.1)
            c = skinny_gemm.absorb_v(o, w_uv)[:, :Dl + Dr]
        out["y"] = c
    return fn, out, n * 6       # kv row, append, MLA, split merge, absorb, (slice: a view)


PROJECTIONS = {"q": (3072, 2048, 1), "kv_a": (576, 2048, 1), "o": (2048, 2048, 1),
               "w_uk": (512, 128, 16), "w_uv": (128, 512, 16)}


def _proj(name, rows, skinny: bool):
    """-> (fn, weight bytes) of one projection of `name` at `rows` rows."""
    N, K, G = PROJECTIONS[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    if name == "w_uk":                      # a view of kv_b_proj [h, nope + v, Dl]
        w = torch.randn(G, 256, N, device="cuda", dtype=bf, generator=g)[:, :K]
        x = torch.randn(rows, G, 192, device="cuda", dtype=bf, generator=g)[..., :K]
        fn = ((lambda: skinny_gemm.absorb_q(x, w)) if skinny else
              (lambda: torch.einsum("thk,hkn->thn", x, w)))
    elif name == "w_uv":
        w = torch.randn(G, 256, K, device="cuda", dtype=bf, generator=g)[:, 128:]
        x = torch.randn(rows, G, K, device="cuda", dtype=bf, generator=g)
        fn = ((lambda: skinny_gemm.absorb_v(x, w)) if skinny else
              (lambda: skinny_gemm.absorb_v_torch(x, w)))
    else:
        w = torch.randn(N, K, device="cuda", dtype=bf, generator=g)
        x = torch.randn(rows, K, device="cuda", dtype=bf, generator=g)
        fn = (lambda: skinny_gemm.linear(x, w)) if skinny else (lambda: F.linear(x, w))
    return fn, N * K * G * 2


def projections(args, copy_bw) -> list[dict]:
    from profiling.roofline import L2Flush
    flush, recs = L2Flush(), []
    for name in PROJECTIONS:
        for rows in (1, 8):
            times = {}
            for skinny in (False, True):
                fn, nbytes = _proj(name, rows, skinny)
                times[skinny] = graph_time_us(fn, args.iters, flush)
            fn_c, _ = _proj(name, rows, False)
            fn_s, _ = _proj(name, rows, True)
            err = (fn_c().float() - fn_s().float()).abs().max().item()
            floor = nbytes / copy_bw * 1e6
            recs.append(dict(case=f"projection {name}", rows=rows, weight_bytes=nbytes,
                             cublas_us=times[False], skinny_us=times[True], floor_us=floor,
                             cublas_copy_fraction=floor / times[False],
                             skinny_copy_fraction=floor / times[True], max_abs_diff=err))
            print(json.dumps(recs[-1]), flush=True)
    return recs


def layer_chain(layers: int, skinny: bool):
    fns = {name: _proj(name, 1, skinny)[0] for name in PROJECTIONS}
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    out = {}

    def fn():
        for _ in range(layers):           # the projections' inputs are fixed: only launches
            fused_ops.rms_norm(x, w, 1e-6)
            fns["q"]()
            fns["w_uk"]()
            fns["kv_a"]()
            fns["w_uv"]()
            out["y"] = fns["o"]()
    return fn, out, layers * 6


if triton_util.HAS_TRITON:
    from helix.triton_util import pdl_sync, tl, triton

    @triton.jit
    def _empty_kernel(x_ptr, PDL: tl.constexpr = False):
        pdl_sync(PDL)
        if tl.program_id(0) == 0:
            tl.store(x_ptr, 1)

    @triton.jit
    def _dependent_kernel(x_ptr, PDL: tl.constexpr = False):
        """Every program reads the word the previous kernel wrote (a dependent L2 load after
        the wait); program 0 writes it plus one."""
        pdl_sync(PDL)
        v = tl.load(x_ptr, cache_modifier=".cg")
        if tl.program_id(0) == 0:
            tl.store(x_ptr, v + 1)

    @triton.jit
    def _barriers_kernel(cnt_ptr, x_ptr, ROUNDS: tl.constexpr, ATOMIC_POLL: tl.constexpr,
                         PDL: tl.constexpr = False):
        """ROUNDS grid barriers on one monotone counter (round r waits for (r + 1) * P
        arrivals); a second counter counts the programs out and the last resets both."""
        pdl_sync(PDL)
        P = tl.num_programs(0)
        ptr = cnt_ptr + tl.zeros([1], dtype=tl.int32)
        for r in range(ROUNDS):
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
            seen = 0
            while seen < (r + 1) * P:
                if ATOMIC_POLL:
                    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
                else:
                    seen = tl.max(tl.inline_asm_elementwise(
                        "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                        is_pure=False, pack=1), axis=0)
            tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu") == P - 1:
            tl.store(cnt_ptr, 0)
            tl.store(cnt_ptr + 1, 0)
        if tl.program_id(0) == 0:
            tl.store(x_ptr, ROUNDS)


def sync_costs(args) -> list[dict]:
    """Part (f): us per kernel boundary (a chain of empty PDL kernels in a CUDA graph) and
    per in-kernel grid barrier (one launch, two polling ways), same programs and warps."""
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(2, dtype=torch.int32, device="cuda")
    n = args.n
    recs = []

    def chain():
        for _ in range(n):
            triton_util.run_kernel(_empty_kernel, (programs,), x, num_warps=4)
    chain_us = graph_time_us(chain, args.iters)
    recs.append(dict(case="empty PDL kernel chain", programs=programs, syncs=n,
                     us=chain_us, us_per_sync=chain_us / n))

    def dependent():
        for _ in range(n):
            triton_util.run_kernel(_dependent_kernel, (programs,), x, num_warps=4)
    dep_us = graph_time_us(dependent, args.iters)
    recs.append(dict(case="PDL kernel chain, a dependent load each", programs=programs,
                     syncs=n, us=dep_us, us_per_sync=dep_us / n))
    for atomic in (False, True):
        def one():
            triton_util.run_kernel(_barriers_kernel, (programs,), cnt, x, ROUNDS=n,
                                   ATOMIC_POLL=atomic, num_warps=4)

        def empty():
            triton_util.run_kernel(_barriers_kernel, (programs,), cnt, x, ROUNDS=0,
                                   ATOMIC_POLL=atomic, num_warps=4)
        us, base = graph_time_us(one, args.iters), graph_time_us(empty, args.iters)
        torch.cuda.synchronize()
        assert int(torch.count_nonzero(cnt)) == 0, cnt        # reset by the last program out
        recs.append(dict(case="grid barrier, " + ("atomic" if atomic else "acquire-load")
                         + " polling", programs=programs, syncs=n, us=us, launch_us=base,
                         us_per_sync=(us - base) / n))
    for r in recs:
        r["device"] = torch.cuda.get_device_name()
        print(json.dumps(r), flush=True)
    return recs


def run(args) -> list[dict]:
    recs = []
    cases = [("norm x1 row", lambda: norm_chain(1, args.n, False)),
             ("norm x64 rows", lambda: norm_chain(64, args.n, False)),
             ("norm + cuBLAS GEMV x1 row", lambda: norm_chain(1, args.n // 2, True)),
             ("MLA decode kernels 1 x 4K", lambda: mla_chain(args.n // 8))]
    for name, make in cases:
        res = {}
        for pdl in (False, True):
            triton_util.PDL = pdl
            fn, out, launches = make()
            us = graph_time_us(fn, args.iters)
            res[pdl] = (us, out["y"].clone(), launches)
        triton_util.PDL = True
        (off, y0, launches), (on, y1, _) = res[False], res[True]
        same = bool(torch.equal(y0, y1))
        recs.append(dict(case=name, launches=launches, off_us=off, on_us=on,
                         off_us_per_launch=off / launches, on_us_per_launch=on / launches,
                         saved_us_per_launch=(off - on) / launches, bitwise_equal=same,
                         device=torch.cuda.get_device_name()))
        print(json.dumps(recs[-1]), flush=True)
    us = {}
    for skinny in (False, True):
        fn, out, launches = layer_chain(27, skinny)
        us[skinny] = graph_time_us(fn, args.iters)
    recs.append(dict(case="projection chain x27 layers", launches=launches, cublas_us=us[False],
                     skinny_us=us[True], device=torch.cuda.get_device_name()))
    print(json.dumps(recs[-1]), flush=True)
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256, help="launches per chain (about)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sync-only", action="store_true", help="part (f) alone")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl needs a CUDA GPU")
    if not triton_util.pdl_enabled(torch.device("cuda")):
        raise SystemExit("PDL needs compute capability >= 9 and HELIX_PDL unset or not 0")
    from profiling.roofline import copy_bandwidth
    copy_bw = copy_bandwidth()
    recs = (sync_costs(args) if args.sync_only
            else run(args) + projections(args, copy_bw) + sync_costs(args))
    lines = [f"copy rate {copy_bw / 1e9:.0f} GB/s"]
    for r in recs:
        if "us_per_sync" in r:
            lines.append(f"{r['case']} ({r['programs']} programs): {r['us_per_sync']:.2f} us "
                         f"a sync ({r['syncs']} syncs)")
        elif "off_us" in r:
            lines.append(f"{r['case']}: {r['off_us_per_launch']:.2f} -> "
                         f"{r['on_us_per_launch']:.2f} us a launch ({r['launches']} launches; "
                         f"bitwise equal: {r['bitwise_equal']})")
        elif "rows" in r:
            lines.append(f"{r['case']} x{r['rows']}: cuBLAS {r['cublas_us']:.2f} us "
                         f"({r['cublas_copy_fraction']:.2f}), skinny {r['skinny_us']:.2f} us "
                         f"({r['skinny_copy_fraction']:.2f}), max |diff| {r['max_abs_diff']:.3g}")
        else:
            lines.append(f"{r['case']}: cuBLAS {r['cublas_us']:.1f} us, skinny "
                         f"{r['skinny_us']:.1f} us")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(recs, f, indent=1)


if __name__ == "__main__":
    main()
