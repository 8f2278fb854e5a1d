"""GQA decode launch variants at one model's decode shape, timed alone (issue 18: where the
Llama-3.1-8B step's GQA launch loses at batch 8 x 1K, Qwen3's at batch 1).

    python profiling/tune_gqa.py --shapes 8x1024,1x32768 --out gqa_tune.json

Shape per launch: --heads / --kv-heads / --head-dim (default Llama-3.1-8B: 32 / 8 / 128), bf16,
a paged pool of --page-size tokens a page (default the engine's, RuntimeConfig.page_size).
Each variant (split count, BLOCK_N, warps, pipeline stages, the merge in the split launch or a
second launch, the one-launch merge's bound and column chunk) is checked against the default
variant's output, then timed as a CUDA-graph replay with L2 flushed
(profiling.roofline.graph_time_us). The copy bandwidth is measured in the same run; floor = the
KV bytes read once at that rate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import triton_decode  # noqa: E402
from helix.config import RuntimeConfig  # noqa: E402
from profiling.roofline import L2Flush, copy_bandwidth, graph_time_us  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def variants(args) -> list[dict]:
    """Every combination of the listed knobs; 0 / None = the library's choice."""
    out = []
    for splits, bn, warps, stages, fused, elems, chunk in itertools.product(
            _ints(args.splits), _ints(args.block_n), _ints(args.warps), _ints(args.stages),
            args.fused.split(","), _ints(args.merge_elements), _ints(args.merge_chunk)):
        out.append(dict(num_splits=splits or None, block_n=bn or None, num_warps=warps or None,
                        num_stages=stages or None, fused=fused == "1",
                        merge_elements=elems or None, merge_chunk=chunk or None))
    return out


def run_variant(v: dict, call):
    """call() under the variant's module settings (the launch config, FUSED_MERGE and its
    bounds)."""
    base_config = triton_decode.gqa_launch_config
    base = (triton_decode.FUSED_MERGE, triton_decode.FUSED_MERGE_ELEMENTS,
            triton_decode.FUSED_MERGE_CHUNK)

    def config(*a, **k):
        c = base_config(*a, **k)
        if v["num_warps"]:
            c["num_warps"] = v["num_warps"]
        if v["num_stages"]:
            c["num_stages"] = v["num_stages"]
        return c

    triton_decode.gqa_launch_config = config
    triton_decode.FUSED_MERGE = v["fused"]
    triton_decode.FUSED_MERGE_ELEMENTS = v["merge_elements"] or base[1]
    triton_decode.FUSED_MERGE_CHUNK = v["merge_chunk"] or base[2]
    try:
        return call()
    finally:
        triton_decode.gqa_launch_config = base_config
        (triton_decode.FUSED_MERGE, triton_decode.FUSED_MERGE_ELEMENTS,
         triton_decode.FUSED_MERGE_CHUNK) = base


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="8x1024,1x1024,1x32768,8x32768", help="BATCHxCONTEXT list")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=RuntimeConfig().page_size)
    p.add_argument("--splits", default="0", help="comma list, 0: choose_num_splits")
    p.add_argument("--block-n", default="0", help="comma list, 0: gqa_launch_config's")
    p.add_argument("--warps", default="0", help="comma list, 0: gqa_launch_config's")
    p.add_argument("--stages", default="0", help="comma list, 0: gqa_launch_config's")
    p.add_argument("--fused", default="1,0", help="1: merge in the split launch, 0: two launches")
    p.add_argument("--merge-elements", default="0",
                   help="comma list of FUSED_MERGE_ELEMENTS bounds, 0: the library's")
    p.add_argument("--merge-chunk", default="0",
                   help="comma list of FUSED_MERGE_CHUNK sizes, 0: the library's")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)

    copy = copy_bandwidth()
    flush = L2Flush()
    records = []
    for shape in args.shapes.split(","):
        records += bench_shape(args, shape, copy, flush)
    with open(args.out, "w") as f:
        json.dump(dict(copy_gbps=round(copy / 1e9, 1), records=records), f, indent=1)


def bench_shape(args, shape: str, copy: float, flush) -> list[dict]:
    """The records of every variant at one BATCHxCONTEXT."""
    hq, hkv, d, page = args.heads, args.kv_heads, args.head_dim, args.page_size
    B, ctx = (int(x) for x in shape.split("x"))
    records = []
    pages = B * ctx // page
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_pool = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16,
                         generator=gen)
    v_pool = torch.randn_like(k_pool)
    # pages of a sequence scattered over the pool, as a serving pool's are
    bt = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(B, -1)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = d ** -0.5
    kv_bytes = 2 * B * ctx * hkv * d * 2
    ref_o, ref_lse = triton_decode.gqa_decode(q, k_pool, v_pool, bt, lens, scale)
    for v in variants(args):
        def fn(v=v):
            return triton_decode.gqa_decode(q, k_pool, v_pool, bt, lens, scale,
                                            num_splits=v["num_splits"], block_n=v["block_n"])
        try:
            o, lse = run_variant(v, fn)
            err = max((o.float() - ref_o.float()).abs().max().item(),
                      (lse - ref_lse).abs().max().item())
            us = run_variant(v, lambda: graph_time_us(fn, args.iters, flush))
        except Exception as exc:    # a variant that does not compile (shared memory)
            print(f"{shape} {v}: {type(exc).__name__}: "
                  f"{(str(exc) or '-').splitlines()[0][:120]}")
            continue
        splits = v["num_splits"] or triton_decode.gqa_num_splits(B, hkv, ctx, q.device)
        rec = dict(batch=B, context=ctx, heads=hq, kv_heads=hkv, head_dim=d, page_size=page,
                   **v, splits=splits, time_us=round(us, 2), max_err=err,
                   floor_us=round(kv_bytes / copy * 1e6, 2),
                   gbps=round(kv_bytes / us / 1e3, 1))
        records.append(rec)
        print(f"{shape:>9} splits {splits:3d} bn {v['block_n'] or '-':>3} "
              f"w {v['num_warps'] or '-'} s {v['num_stages'] or '-'} fused {int(v['fused'])} "
              f"elems {v['merge_elements'] or '-'} chunk {v['merge_chunk'] or '-'} | "
              f"{us:8.2f} us  floor {rec['floor_us']:7.2f}  {rec['gbps']:7.1f} GB/s  "
              f"err {err:.1e}", flush=True)
    return records


if __name__ == "__main__":
    main()
