"""Block-fp8 projections (helix.layers.fp8.linear) against the bf16 ones a step runs
(helix.layers.skinny_gemm.linear: the GEMV / skinny kernel at decode rows, cuBLAS past them),
one GPU, in CUDA graphs; past two rows also both fp8 routes forced (the tiled kernel,
`_fp8_linear_kernel`, and dequantize + cuBLAS), to place fp8.DEQUANT_ROWS.

Each case is a chain of copies of one projection (distinct weights, > 256 MB in all, far over
L2), so the weights stream from DRAM as in a step. Reported per projection: us, the weight's
floor at the copy rate measured in the same run (fp8: half the bytes, plus 4 bytes a 128 x 128
block), and the fp8 product's largest difference from F.linear over its dequantized weight.

    python profiling/bench_fp8_linear.py --rows 1,8,64,512 --out fp8_linear.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.layers import fp8, skinny_gemm  # noqa: E402
from profiling.roofline import graph_time_us  # noqa: E402

SHAPES = [("llama-3.1-8b qkv", 6144, 4096), ("llama-3.1-8b o_proj", 4096, 4096),
          ("llama-3.1-8b gate_up", 28672, 4096), ("llama-3.1-8b down", 4096, 14336),
          ("deepseek-v3 x_proj (q_a + kv_a)", 2112, 7168),
          ("deepseek-v3 o_proj / 8", 7168, 2048), ("deepseek-v2-lite x_proj", 3648, 2048)]
CHAIN_BYTES = 256 << 20


def case(name: str, N: int, K: int, rows: list[int], iters: int, copy_bw: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    copies = max(2, -(-CHAIN_BYTES // (N * K * 2)))
    bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5
          for _ in range(copies)]
    q = [fp8.quantize(w) for w in bf]
    recs = []
    for T in rows:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        us_bf = graph_time_us(lambda: [skinny_gemm.linear(x, w) for w in bf], iters) / copies
        us_f8 = graph_time_us(lambda: [fp8.linear(x, b.weight, b.scale) for b in q],
                              iters) / copies
        forced = {}
        if T > 2:
            forced["tiled_us"] = graph_time_us(
                lambda: [fp8.linear_triton(x, b.weight, b.scale) for b in q], iters) / copies
            forced["dequant_gemm_us"] = graph_time_us(
                lambda: [F.linear(x, fp8.dequantize_triton(b.weight, b.scale, x.dtype))
                         for b in q], iters) / copies
        ref = F.linear(x.float(), fp8.dequantize(q[0].weight, q[0].scale, torch.float32))
        err = float((fp8.linear(x, q[0].weight, q[0].scale).float() - ref).abs().max()
                    / ref.abs().max())
        f8_bytes = N * K * fp8.element_bytes("fp8", 2)
        recs.append(dict(case=name, N=N, K=K, rows=T, copies=copies,
                         bf16_us=us_bf, fp8_us=us_f8, speedup=us_bf / us_f8,
                         bf16_floor_us=N * K * 2 / copy_bw * 1e6,
                         fp8_floor_us=f8_bytes / copy_bw * 1e6, fp8_rel_err=err, **forced,
                         device=torch.cuda.get_device_name()))
        print(json.dumps(recs[-1]), flush=True)
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("bench_fp8_linear needs an sm_89+ CUDA GPU")
    from profiling.roofline import copy_bandwidth
    copy_bw = copy_bandwidth()
    recs = [r for name, N, K in SHAPES for r in case(name, N, K, args.rows, args.iters, copy_bw)]
    print(f"copy rate {copy_bw / 1e9:.0f} GB/s")
    for r in recs:
        print(f"{r['case']:<34} rows {r['rows']:>4}: bf16 {r['bf16_us']:8.2f} us "
              f"({r['bf16_us'] / r['bf16_floor_us']:.2f} x floor), fp8 {r['fp8_us']:8.2f} us "
              f"({r['fp8_us'] / r['fp8_floor_us']:.2f} x floor), {r['speedup']:.2f} x, "
              f"rel err {r['fp8_rel_err']:.1e}"
              + (f"; tiled {r['tiled_us']:.2f}, dequant + GEMM {r['dequant_gemm_us']:.2f} us"
                 if "tiled_us" in r else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_rate=copy_bw, records=recs), f, indent=1)


if __name__ == "__main__":
    main()
