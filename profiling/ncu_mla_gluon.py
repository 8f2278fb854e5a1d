"""One MLA decode shape on the Gluon kernel, launched a few times with nothing else on the GPU,
for Nsight Compute (issue 16: where a launch loses against the matmul rate).

    ncu --clock-control none --set full --import-source yes -k regex:mla_decode_kernel \
        --launch-skip 1 -c 1 -o OUT/mla python profiling/ncu_mla_gluon.py --shape 132x8192

The first launch compiles (skipped above); the pool's pages are in order, random bf16, every
sequence at the full context, 128 heads (DeepSeek-V3's rank) unless --heads says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from profiling.bench_attention import random_pool  # noqa: E402
from profiling.bench_mla_gluon import DL, DR, SCALE, gluon_call  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="132x8192", help="BATCHxCONTEXT")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--variant", default="seesaw", help="a bench_mla_gluon.py kernel spec")
    p.add_argument("--launches", type=int, default=3)
    args = p.parse_args(argv)
    B, ctx = (int(x) for x in args.shape.split("x"))
    pool = random_pool((B * ctx // 64, 64, DL + DR))
    bt = torch.arange(B * ctx // 64, dtype=torch.int32, device="cuda").view(B, -1)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    ql = torch.randn(B, args.heads, DL, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(B, args.heads, DR, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.launches):
        gluon_call(args.variant, ql, qr, pool, bt, lens, SCALE)
    torch.cuda.synchronize()
    print(f"{args.launches} launches of {args.variant} at {B} x {ctx}, {args.heads} heads")


if __name__ == "__main__":
    main()
