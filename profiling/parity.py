"""Layout parity run: the same prompts through several layouts, against the single-rank run.

Per model: a single-rank fp32 greedy run gives the oracle tokens. Every layout then runs, in fp32
and in --dtype, teacher-forced on those tokens (SamplingParams.forced_tokens), so each step's
logits are comparable however rounding moves the argmax. Recorded per (layout, dtype):
- fp32: greedy argmax equal to the oracle token at every step, max logits relative error;
- --dtype: logits relative error vs fp32 (prefill and the median step <= --rel-tol; single
  steps can spike where bf16 rounding moves an MoE routing choice, in the single-rank run too),
  and argmax agreement with
  the single-rank run in the same dtype. A flip between two runs whose logits each lie within
  e1, e2 (max abs) of the fp32 logits is only possible where the top-2 gap is <= 2 (e1 + e2):
  flips above that bound are errors, flips below it are rounding;
- the free-running greedy tokens of the layout in --dtype vs the single-rank run (informative);
- decode step time (eager, reference backend: not a performance figure).

    python profiling/parity.py --device cuda --dtype bfloat16 --layouts 2x1,1x2 \
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


def run(model: str, layout: Layout, runtime: RuntimeConfig, prompts, steps: int,
        forced=None) -> dict:
    """Run the prompts as one batch; per-step logits [S, V] on the CPU, tokens, step times."""
    forced = forced or [()] * len(prompts)
    with LLM(model, layout, runtime) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=steps, ignore_eos=True,
                                                 forced_tokens=tuple(f)))
               for p, f in zip(prompts, forced)]
        logits, times = [], []
        while llm.has_unfinished():
            out = llm.step()
            logits.append(llm.engine.last_logits.float().cpu())
            times.append(out.seconds)
        return {"tokens": [llm.outputs[i] for i in ids], "logits": logits, "step_s": times,
                "kv_tokens_per_rank": llm.kv_tokens_per_rank()}


def parse_layout(spec: str) -> Layout:
    """"KxA" (kvp x tpa) or "KxAeE" (with expert parallelism E), e.g. 4x2e8."""
    attn, _, ep = spec.lower().partition("e")
    kvp, tpa = (int(x) for x in attn.split("x"))
    return Layout(kvp=kvp, tpa=tpa, ep=int(ep) if ep else 1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def forced_report(res: dict, oracle: dict, single: dict) -> dict:
    """Teacher-forced comparison, step by step (every step holds all requests: same lengths)."""
    errs = [rel_err(a, b) for a, b in zip(res["logits"], oracle["logits"])]
    arg = torch.stack([l.argmax(-1) for l in res["logits"]])           # [steps, S]
    arg_single = torch.stack([l.argmax(-1) for l in single["logits"]])
    arg_oracle = torch.stack([l.argmax(-1) for l in oracle["logits"]])
    m = torch.stack([top2_margin(l) for l in single["logits"]])
    e1 = torch.stack([(a - o).abs().amax(-1) for a, o in zip(res["logits"], oracle["logits"])])
    e2 = torch.stack([(a - o).abs().amax(-1) for a, o in zip(single["logits"], oracle["logits"])])
    differ = arg != arg_single
    bound = 2 * (e1 + e2)
    return {"max_logits_rel_err_vs_fp32": max(errs), "prefill_logits_rel_err_vs_fp32": errs[0],
            "median_logits_rel_err_vs_fp32": statistics.median(errs),
            "logits_rel_err_vs_fp32_per_step": [round(e, 6) for e in errs],
            "argmax_equal_fp32_oracle": float((arg == arg_oracle).float().mean()),
            "argmax_equal_single_rank": float((~differ).float().mean()),
            "argmax_flips": int(differ.sum()),
            "argmax_flips_above_rounding_bound": int((differ & (m > bound)).sum()),
            "token_steps": int(arg.numel())}
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-llama,tiny-deepseek-v3")
    ap.add_argument("--layouts", default="2x1,1x2", help="comma list of KVPxTPA[eEP], e.g. 4x2e8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--lengths", default="3,17,64,200")
    ap.add_argument("--rel-tol", type=float, default=2e-2, help="--dtype logits vs fp32")
    ap.add_argument("--fp32-tol", type=float, default=1e-4, help="fp32 logits vs fp32 single rank")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    layouts = ["1x1"] + args.layouts.split(",")
    records = []
    for model in args.models.split(","):
        base = dict(device=args.device, page_size=16, max_context=1024, max_batch=8,
                    layers=args.layers)
        from helix.loader import read_model_config
        prompts = prompts_for(read_model_config(model)[0].vocab_size, lengths)
        t0 = time.time()
        rt32, rt = RuntimeConfig(dtype="float32", **base), RuntimeConfig(dtype=args.dtype, **base)
        oracle = run(model, Layout(), rt32, prompts, args.steps)
        forced = oracle["tokens"]
        runs = {}
        for spec in layouts:
            lay = parse_layout(spec)
            runs[spec] = {"fp32": run(model, lay, rt32, prompts, args.steps, forced),
                          "low": run(model, lay, rt, prompts, args.steps, forced),
                          "free": run(model, lay, rt, prompts, args.steps)}
        for spec in layouts:
            r = runs[spec]
            fp32 = forced_report(r["fp32"], oracle, runs["1x1"]["fp32"])
            low = forced_report(r["low"], oracle, runs["1x1"]["low"])
            decode = r["low"]["step_s"][1:]
            rec = {"model": model, "layout": spec, "dtype": args.dtype, "layers": args.layers,
                   "prompt_lengths": lengths, "steps": args.steps,
                   "fp32": fp32, args.dtype: low,
                   "free_running_tokens_equal_single_rank": (r["free"]["tokens"]
                                                             == runs["1x1"]["free"]["tokens"]),
                   "kv_tokens_per_rank": r["low"]["kv_tokens_per_rank"],
                   "decode_step_ms_median_eager_reference": 1e3 * statistics.median(decode)}
            rec["pass"] = (fp32["argmax_equal_fp32_oracle"] == 1.0
                           and fp32["max_logits_rel_err_vs_fp32"] <= args.fp32_tol
                           and low["prefill_logits_rel_err_vs_fp32"] <= args.rel_tol
                           and low["median_logits_rel_err_vs_fp32"] <= args.rel_tol
                           and low["argmax_flips_above_rounding_bound"] == 0)
            records.append(rec)
            print(json.dumps(rec), flush=True)
        print(f"# {model}: {time.time() - t0:.1f} s", flush=True)
    meta = {"device": (torch.cuda.get_device_name(0) if args.device == "cuda"
                       else platform.processor()),
            "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
            "torch": torch.__version__, "args": vars(args),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() or None}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    ok = all(r["pass"] for r in records)
    print(f"SUMMARY parity {'PASS' if ok else 'FAIL'}: " + "; ".join(
        f"{r['model']} {r['layout']} fp32_argmax={r['fp32']['argmax_equal_fp32_oracle']:.3f} "
        f"fp32_err={r['fp32']['max_logits_rel_err_vs_fp32']:.1e} "
        f"{args.dtype}_err={r[args.dtype]['max_logits_rel_err_vs_fp32']:.1e} "
        f"flips={r[args.dtype]['argmax_flips']}/{r[args.dtype]['token_steps']} "
        f"(above bound {r[args.dtype]['argmax_flips_above_rounding_bound']})" for r in records))


if __name__ == "__main__":
    main()
