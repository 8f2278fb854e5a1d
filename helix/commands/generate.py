"""`helix generate`: run a batch of prompts to completion and report tokens, latency and KV.

    helix generate --model tiny-llama --prompt-ids 5,17,42 --prompt-ids 7,8 --max-new-tokens 16
                   [--json] [layout, runtime and sampling flags]
"""

from __future__ import annotations

import json
import statistics
import time

from helix.commands.options import (add_layout_args, add_runtime_args, add_sampling_args,
                                    configs, sampling, token_ids)
from helix.errors import HelixError


def add_parser(subparsers):
    p = subparsers.add_parser("generate", help="generate tokens for a batch of prompts")
    p.add_argument("--model", required=True, help="checkpoint directory, preset name or preset YAML")
    p.add_argument("--prompt-ids", type=token_ids, action="append", default=[],
                   help="comma-separated token ids; repeat for each request of the batch")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    add_sampling_args(p)
    add_layout_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run)
    return p


def run_batch(model: str, prompts: list[list[int]], args) -> dict:
    """Run the prompts as one batch; returns tokens, timing and KV accounting."""
    from helix.runtime.llm import LLM
    layout, runtime = configs(args)
    params = sampling(args)
    with LLM(model, layout, runtime) as llm:
        ids = [llm.add_request(p, params) for p in prompts]
        steps, first, t0 = [], {}, time.perf_counter()
        while llm.has_unfinished():
            out = llm.step()
            steps.append(out.seconds)
            now = time.perf_counter()
            for rid in out.tokens:
                first.setdefault(rid, now - t0)
        kv = llm.kv_tokens_per_rank()
        projected = llm.prefill_tokens_per_rank()
        ttft = [1e3 * first[i] for i in ids if i in first]
        decode = steps[1:] or steps
        return {
            "model": model,
            "tokens": [llm.outputs[i] for i in ids],
            "finish_reasons": [llm.finish_reasons[i] for i in ids],
            "errors": [llm.errors.get(i) for i in ids],
            "layout": layout.as_dict(),
            "world_size": layout.world_size,
            "device": runtime.device,
            "dtype": runtime.dtype,
            "kv_tokens_per_rank": kv,
            "prefill_tokens_per_rank": projected,
            "step_ms": [round(s * 1e3, 3) for s in steps],
            "ttft_ms": [round(t, 3) for t in ttft],
            "decode_ms_median": round(1e3 * statistics.median(decode), 3) if decode else None,
        }


def describe(result: dict) -> str:
    """The run's layout, latency and KV lines (after the tokens)."""
    lay = result["layout"]
    dev = "GPU" if result["device"] == "cuda" else "CPU"
    lines = [f"layout kvp={lay['kvp']} tpa={lay['tpa']} tpf={lay['tpf']} ep={lay['ep']} "
             f"kv_interleave={lay['kv_interleave']} on {result['world_size']} {dev} rank(s), "
             f"{result['dtype']}"]
    ttft = result["ttft_ms"]
    n = max(0, len(result["step_ms"]) - 1)
    if ttft:
        lines.append(f"time to first token {min(ttft):.1f}-{max(ttft):.1f} ms, decode "
                     f"{result['decode_ms_median']:.2f} ms/step (median of {n} steps)")
    lines.append("KV positions held per rank (layer 0): "
                 + ", ".join(f"rank {r}: {k}" for r, k in enumerate(result["kv_tokens_per_rank"])))
    return "\n".join(lines)


def run(args) -> int:
    if not args.prompt_ids:
        raise HelixError("give at least one --prompt-ids 5,17,42 (see helix generate --help)")
    result = run_batch(args.model, args.prompt_ids, args)
    if args.json:
        print(json.dumps(result))
        return 0
    for i, (toks, why, err) in enumerate(zip(result["tokens"], result["finish_reasons"],
                                             result["errors"])):
        print(f"request {i} ({len(args.prompt_ids[i])} prompt tokens -> {len(toks)} new, "
              f"{why}{': ' + err if err else ''}): {' '.join(map(str, toks))}")
    print(describe(result))
    return 0
