"""`helix demo`: a Helix decode of a small default model: KVP = 2 CPU ranks without a GPU (or on
2 GPUs), one rank on a single GPU."""

from __future__ import annotations

import time

from helix.commands.generate import describe, run_batch
from helix.commands.options import add_layout_args, add_runtime_args, add_sampling_args


def add_parser(subparsers):
    p = subparsers.add_parser("demo", help="a Helix decode of a small default model")
    p.add_argument("--model", default="tiny-llama",
                   help="preset or checkpoint (default tiny-llama)")
    add_sampling_args(p)
    add_layout_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run, kvp=None, tpa=None, max_new_tokens=24, ignore_eos=True)
    return p


def run(args) -> int:
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.kvp is None:
        args.kvp = 2 if gpus != 1 else 1       # CPU ranks (gloo) or 2 GPUs: a real Helix layout
    args.tpa = args.tpa or 1
    g = torch.Generator().manual_seed(args.seed)
    lengths = [5, 23, 61]
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    t0 = time.perf_counter()
    result = run_batch(args.model, prompts, args)
    print(f"Helix demo: model {args.model}")
    for n, toks, why in zip(lengths, result["tokens"], result["finish_reasons"]):
        print(f"  prompt of {n:3d} tokens -> {len(toks)} new ({why}): {' '.join(map(str, toks))}")
    total = sum(n + len(t) - 1 for n, t in zip(lengths, result["tokens"]))
    print("  " + describe(result).replace("\n", "\n  "))
    print(f"  {total} positions written in all; wall time {time.perf_counter() - t0:.1f} s")
    return 0
