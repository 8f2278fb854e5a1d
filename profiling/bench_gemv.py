"""The one-tile GEMV (helix.layers.skinny_gemm._gemv_kernel) against the split-K skinny kernel,
as a decode step runs them: a chain of DeepSeek-V2-Lite's per-layer projections at 1-4 rows,
27 layers, PDL on, in a CUDA graph, one GPU.

Per layer: the input RMS norm, the x projection (q + kv_a, 3648 x 2048), W_UV's absorption
(16 heads of 128 x 512) and o_proj (2048 x 2048); every layer its own weights (27 x 23 MB,
far over L2), so the chain streams them from DRAM as a step does. Variants, in one process:
the skinny kernel (GEMV off); the GEMV with its weights loaded after the PDL wait ("late");
loaded before it ("early", the default); and the early GEMV over tile sizes (TILE weight
elements a program) and warps. Reported: us a layer, the weights' floor at the copy rate
measured in the same run, and the largest difference of the chain's outputs against the
skinny kernel's (the sum order differs; both accumulate in fp32).

    python profiling/bench_gemv.py --out gemv.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix import triton_util  # noqa: E402
from helix.layers import fused_ops, skinny_gemm  # noqa: E402
from profiling.roofline import graph_time_us  # noqa: E402

LAYERS, D, XP, H, V, DL = 27, 2048, 3648, 16, 128, 512
VARIANTS = [("skinny", False, False, None), ("gemv-late", True, False, None),
            ("gemv", True, True, None)] + [
    (f"gemv tile {tile} warps {warps}", True, True, dict(TILE=tile, num_warps=warps))
    for tile in (4096, 8192, 16384, 32768) for warps in (4, 8)
    if (tile, warps) != (16384, 4)] + [
    ("gemv-late tile 8192", True, False, dict(TILE=8192)),
    ("gemv-late tile 8192 warps 8", True, False, dict(TILE=8192, num_warps=8))]


def layer_weights(gen):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    return [dict(norm=torch.rand(D, generator=gen, **bf) + 0.5,
                 x=torch.randn(XP, D, generator=gen, **bf) / 45,
                 uv=torch.randn(H, 2 * V, DL, generator=gen, **bf)[:, V:] / 22,
                 o=torch.randn(D, H * V, generator=gen, **bf) / 45) for _ in range(LAYERS)]


def chain(weights, rows: int, gen):
    x0 = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    lat = torch.randn(rows, H, DL, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = {}

    def fn():
        h = x0
        for w in weights:
            n = fused_ops.rms_norm(h, w["norm"], 1e-6)
            skinny_gemm.linear(n, w["x"])
            o = skinny_gemm.absorb_v(lat, w["uv"])     # a fixed input: PDL still waits
            h = skinny_gemm.linear(o, w["o"])
        out["y"] = h
    return fn, out


def set_variant(on: bool, early: bool, tiles: dict | None) -> None:
    skinny_gemm.GEMV, skinny_gemm.GEMV_EARLY = on, early
    skinny_gemm.gemv_config = (_GEMV_CONFIG if tiles is None else
                               lambda T, N, K, G, sm, config=None: _GEMV_CONFIG(T, N, K, G, sm,
                                                                                tiles))


_GEMV_CONFIG = skinny_gemm.gemv_config


def run(args, copy_bw) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = layer_weights(gen)
    nbytes = sum(w[k].numel() * 2 for w in weights[:1] for k in ("x", "uv", "o"))
    floor = nbytes / copy_bw * 1e6
    recs = []
    for rows in args.rows:
        fn, out = chain(weights, rows, torch.Generator(device="cuda").manual_seed(rows))
        ref = None
        for name, on, early, tiles in VARIANTS:
            set_variant(on, early, tiles)
            us = graph_time_us(fn, args.iters) / LAYERS
            fn()                                  # eagerly: the graph's pool is gone
            y = out["y"].float()
            ref = y if ref is None else ref
            recs.append(dict(case="projection chain", rows=rows, variant=name, tiles=tiles,
                             early=early, us_per_layer=us, floor_us_per_layer=floor,
                             vs_floor=us / floor, weight_bytes_per_layer=nbytes,
                             max_abs_diff=(y - ref).abs().max().item(),
                             device=torch.cuda.get_device_name()))
            print(json.dumps(recs[-1]), flush=True)
    set_variant(True, True, None)
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    if not triton_util.pdl_enabled(torch.device("cuda")):
        raise SystemExit("this bench measures PDL chains: it needs compute capability >= 9 and "
                         "HELIX_PDL unset or not 0")
    from profiling.roofline import copy_bandwidth
    copy_bw = copy_bandwidth()
    recs = run(args, copy_bw)
    lines = [f"copy rate {copy_bw / 1e9:.0f} GB/s; floor {recs[0]['floor_us_per_layer']:.2f} us "
             f"a layer ({recs[0]['weight_bytes_per_layer'] / 1e6:.1f} MB)"]
    for r in recs:
        lines.append(f"rows {r['rows']} {r['variant']}: {r['us_per_layer']:.2f} us a layer "
                     f"({r['vs_floor']:.2f} x floor), max |diff| {r['max_abs_diff']:.3g}")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_rate=copy_bw, records=recs), f, indent=1)


if __name__ == "__main__":
    main()
