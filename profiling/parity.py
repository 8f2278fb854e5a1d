"""Layout parity run: the same prompts through several layouts, compared with the single-rank run.

For each model: a single-rank fp32 run (the oracle), a single-rank run in --dtype, then every
layout in --dtype. Records, per layout: greedy tokens identical to the single-rank run in the same
dtype, the relative error of every step's logits against the fp32 oracle (teacher-forced on the
layout's own tokens while they agree), and the decode step time.

    python profiling/parity.py --device cuda --dtype bfloat16 --layouts 1x2,2x1 \
        --models tiny-llama,tiny-deepseek-v3 --out profiling/results/parity_2xh200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams


def prompts_for(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(model: str, layout: Layout, runtime: RuntimeConfig, prompts, steps: int) -> dict:
    """Run the prompts as one batch; per-step logits on the CPU, tokens, step times."""
    with LLM(model, layout, runtime) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=steps, ignore_eos=True)) for p in prompts]
        logits, times = [], []
        while llm.has_unfinished():
            out = llm.step()
            logits.append(llm.engine.last_logits.float().cpu())
            times.append(out.seconds)
        return {"tokens": [llm.outputs[i] for i in ids], "logits": logits, "step_s": times,
                "kv_tokens_per_rank": llm.kv_tokens_per_rank()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(res: dict, same_dtype: dict, oracle: dict) -> dict:
    tok_equal = res["tokens"] == same_dtype["tokens"]
    agree = [t == o for t, o in zip(res["tokens"], oracle["tokens"])]
    errs = [rel_err(a, b) for a, b in zip(res["logits"], oracle["logits"])]
    # logits are only comparable while every request has followed the oracle's tokens
    first_diff = min([next((i for i, (x, y) in enumerate(zip(t, o)) if x != y), len(t))
                      for t, o in zip(res["tokens"], oracle["tokens"])])
    cmp = errs[:first_diff + 1]
    decode = res["step_s"][1:] or res["step_s"]
    return {"tokens_equal_single_rank_same_dtype": tok_equal,
            "requests_equal_fp32_oracle": sum(agree), "requests": len(agree),
            "prefill_logits_rel_err_vs_fp32": errs[0],
            "max_logits_rel_err_vs_fp32_while_tokens_agree": max(cmp),
            "steps_compared": len(cmp),
            "decode_step_ms_median": 1e3 * statistics.median(decode),
            "kv_tokens_per_rank": res["kv_tokens_per_rank"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-llama,tiny-deepseek-v3")
    ap.add_argument("--layouts", default="2x1,1x2", help="comma list of KVPxTPA")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--lengths", default="3,17,64,200")
    ap.add_argument("--rel-tol", type=float, default=2e-2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    records = []
    for model in args.models.split(","):
        base = dict(device=args.device, page_size=16, max_context=1024, max_batch=8, layers=args.layers)
        rt32 = RuntimeConfig(dtype="float32", **base)
        rt = RuntimeConfig(dtype=args.dtype, **base)
        from helix.loader import read_model_config
        vocab = read_model_config(model)[0].vocab_size
        prompts = prompts_for(vocab, lengths)
        t0 = time.time()
        oracle = run(model, Layout(), rt32, prompts, args.steps)
        single = run(model, Layout(), rt, prompts, args.steps)
        rows = [("1x1", single)]
        for spec in args.layouts.split(","):
            kvp, tpa = (int(x) for x in spec.lower().split("x"))
            rows.append((spec, run(model, Layout(kvp=kvp, tpa=tpa), rt, prompts, args.steps)))
        for spec, res in rows:
            rec = {"model": model, "layout": spec, "dtype": args.dtype, "layers": args.layers,
                   "prompt_lengths": lengths, "steps": args.steps, **compare(res, single, oracle)}
            rec["pass"] = (rec["tokens_equal_single_rank_same_dtype"]
                           and rec["prefill_logits_rel_err_vs_fp32"] <= args.rel_tol)
            records.append(rec)
            print(json.dumps(rec), flush=True)
        print(f"# {model}: {time.time() - t0:.1f} s", flush=True)
    meta = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor(),
            "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
            "torch": torch.__version__,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() or None}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    ok = all(r["pass"] for r in records)
    print(f"SUMMARY parity {'PASS' if ok else 'FAIL'}: " + "; ".join(
        f"{r['model']} {r['layout']} tokens_eq={r['tokens_equal_single_rank_same_dtype']} "
        f"err={r['prefill_logits_rel_err_vs_fp32']:.2e}" for r in records))


if __name__ == "__main__":
    main()
