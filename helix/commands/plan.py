"""`helix plan`: predicted decode step, throughput and KV capacity of every valid layout of N
GPUs for a model, batch and context, ranked (helix.perf.planner; no GPU needed).

    helix plan --model deepseek-v3 --gpus 8 --batch 8 --context 131072 [--hardware h200]
               [--layers n] [--hopb 1,2,4] [--page-size 64] [--top 20] [--json]

The TP baseline (kvp = 1) is always in the table, and `vs TP` compares every row with the
fastest TP-baseline row. Rows that do not fit in memory come last, marked with the largest batch
that fits at this context.
"""

from __future__ import annotations

import argparse
import json

from helix.config import parse_dtype
from helix.errors import HelixError
from helix.kv.quant import KV_CACHE_DTYPES, cache_dtype


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4")
    return vals


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="rank the layouts of N GPUs by predicted decode step")
    p.add_argument("--model", required=True,
                   help="preset name, preset YAML or checkpoint directory")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) of the layout")
    p.add_argument("--batch", type=int, required=True, help="requests decoding together")
    p.add_argument("--context", type=int, required=True, help="tokens per request")
    p.add_argument("--hardware", default="h200",
                   help="hardware YAML or a name in configs/hardware (default h200)")
    p.add_argument("--layers", type=int, default=0, help="first n layers only (0: all)")
    p.add_argument("--hopb", type=_ints, default=(1, 2, 4),
                   help="HOP-B depths to try (default 1,2,4)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="KV cache storage (auto: --dtype; fp8: one byte an element)")
    p.add_argument("--quantization", choices=["auto", "none", "fp8"], default="auto",
                   help="weights: fp8 (one byte an element, 128x128 block scales: a fp8 "
                        "checkpoint or --quantization fp8) or none (--dtype); default: the "
                        "checkpoint's")
    p.add_argument("--page-size", type=int, default=64, help="KV positions per page")
    p.add_argument("--top", type=int, default=20, help="rows shown (the TP baseline always is)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=run)
    return p


def _layout(lay) -> str:
    return f"kvp={lay.kvp} tpa={lay.tpa} tpf={lay.tpf} ep={lay.ep}"


def _model_line(cfg) -> str:
    attn = (f"MLA (latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim})" if cfg.is_mla
            else f"GQA {cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}")
    ffn = (f"MoE {cfg.num_experts} experts top-{cfg.experts_per_token}" if cfg.is_moe
           else f"dense FFN {cfg.intermediate_size}")
    return f"{cfg.num_layers} layers, {attn}, {cfg.num_heads} query heads, {ffn}"


def rows_for(cfg, args, hw):
    from helix.perf.planner import plan
    es = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    from helix.layers import fp8
    rows = plan(cfg, args.gpus, args.batch, args.context, hw, args.hopb, es, args.page_size,
                kv_bytes=cache_dtype(args.kv_cache_dtype, parse_dtype(args.dtype)).itemsize,
                weight_es=fp8.element_bytes(weights(cfg, args), es))
    tp = [r for r in rows if r.layout.kvp == 1]
    best_tp = min((r.step_ms for r in tp), default=None)
    shown = rows[:args.top]
    if tp and not any(r.layout.kvp == 1 for r in shown):
        shown.append(min(tp, key=lambda r: r.step_ms))
    return rows, shown, best_tp


def weights(cfg, args) -> str | None:
    """-> "fp8" where the plan's weights are fp8 (the flag, else the checkpoint's), else None."""
    from helix.layers import fp8
    return fp8.resolve(args.quantization, cfg.quantization)


def run(args) -> int:
    from helix.loader import read_model_config
    from helix.perf.hardware import load_hardware
    for name in ("gpus", "batch", "context", "page_size", "top"):
        if getattr(args, name) < 1:
            raise HelixError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cfg, _ = read_model_config(args.model, args.layers)
    hw = load_hardware(args.hardware)
    rows, shown, best_tp = rows_for(cfg, args, hw)
    if args.json:
        out = {"model": args.model, "layers": cfg.num_layers, "gpus": args.gpus,
               "batch": args.batch, "context": args.context, "dtype": args.dtype,
               "kv_cache_dtype": args.kv_cache_dtype, "weights": weights(cfg, args) or args.dtype,
               "hardware": {"name": hw.name, "path": hw.path},
               "rows": [{"rank": rows.index(r) + 1, "tp_baseline": r.layout.kvp == 1,
                         "speedup_vs_tp": best_tp / r.step_ms if best_tp else None,
                         **r.as_dict()} for r in shown]}
        print(json.dumps(out))
        return 0
    print(f"helix plan: {args.model} on {args.gpus} x {hw.name} ({hw.path}), batch {args.batch} "
          f"x context {args.context}, {args.dtype}"
          + (", fp8 KV cache" if args.kv_cache_dtype == "fp8" else "")
          + (", fp8 weights" if weights(cfg, args) == "fp8" else ""))
    print(f"  model: {_model_line(cfg)}")
    print(f"  {len(rows)} candidates (layouts x HOP-B depth); * = TP baseline, vs TP = fastest "
          f"TP-baseline step / this step")
    head = (f"{'rank':>4}  {'layout':<24} {'hopb':>4} {'step ms':>9} {'floor ms':>9} "
            f"{'tok/s/user':>10} {'tok/s/GPU':>10} {'vs TP':>6} {'weights GiB':>11} "
            f"{'KV GiB':>8} {'max batch':>9}  fits")
    print(head)
    for r in shown:
        mark = "*" if r.layout.kvp == 1 else " "
        vs = f"{best_tp / r.step_ms:5.2f}x" if best_tp else "     -"
        fits = ("yes" if r.fits else f"no: max context {r.max_context}" if r.weights_fit
                else "no: weights exceed HBM")
        print(f"{rows.index(r) + 1:>4}{mark} {_layout(r.layout):<24} {r.hopb:>4} "
              f"{r.step_ms:9.3f} {r.floor_ms:9.3f} {r.tokens_per_s_user:10.1f} "
              f"{r.tokens_per_s_gpu:10.1f} {vs:>6} {r.weight_gib:11.2f} {r.kv_gib:8.2f} "
              f"{r.max_batch:9d}  {fits}")
    print(f"  step = {hw.graph_step_factor} x (per phase: kernels x {hw.kernel_us} us + "
          f"max(bytes / {hw.hbm_read_tbps} TB/s, FLOPs / {hw.matmul_tflops} TFLOP/s) + exposed "
          f"collectives); floor = the roofline alone (helix/perf/planner.py)")
    return 0
