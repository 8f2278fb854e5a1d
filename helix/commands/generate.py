"""`helix generate`: run a batch of prompts to completion and report tokens, text, latency and KV.

    helix generate --model M --prompt-ids 5,17,42 --prompt-ids 7,8 --max-new-tokens 16
                   [--prompt "text" [--chat]] [--json] [layout, runtime and sampling flags]

Text prompts (--prompt, through the chat template with --chat) need a checkpoint that ships its
tokenizer; their text streams to the terminal as it is generated, in request order. The last
stdout line with --json is one JSON object (tokens, "text" per request: null without a tokenizer;
with --logprobs K, "logprobs" per request: per token {"logprob", "top": [[id, logprob], ...]};
with --prompt-logprobs K, "prompt_logprobs" the same per prompt token, null for the first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from helix.commands.options import (add_layout_args, add_runtime_args, add_sampling_args,
                                    configs, sampling, token_ids)
from helix.errors import HelixError


class _AddPrompt(argparse.Action):
    """--prompt / --prompt-ids: appended to args.prompts as (kind, value), in command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.prompts = [*namespace.prompts, (self.dest, value)]


def add_parser(subparsers):
    p = subparsers.add_parser("generate", help="generate tokens for a batch of prompts")
    p.add_argument("--model", required=True,
                   help="checkpoint directory, preset name or preset YAML")
    p.add_argument("--prompt-ids", dest="ids", type=token_ids, action=_AddPrompt,
                   help="comma-separated token ids; repeat for each request of the batch")
    p.add_argument("--prompt", dest="text", action=_AddPrompt,
                   help="prompt text (a checkpoint with tokenizer files); repeatable")
    p.add_argument("--chat", action="store_true",
                   help="send each --prompt as a user message through the chat template")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    add_sampling_args(p)
    add_layout_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run, prompts=[])
    return p


def run_batch(model: str, prompts: list[list[int]], args, tokenizer=None, on_delta=None) -> dict:
    """Run the prompts as one batch; returns tokens, text, timing and KV accounting.
    on_delta(index, delta) sees each request's new tokens and text as they come."""
    from helix.runtime.llm import LLM
    from helix.serving.stream import stream
    layout, runtime = configs(args)
    params = sampling(args)
    with LLM(model, layout, runtime) as llm:
        ids = [llm.add_request(p, params) for p in prompts]
        index = {rid: i for i, rid in enumerate(ids)}
        steps, first, text, t0 = [], {}, {rid: "" for rid in ids}, time.perf_counter()
        for d in stream(llm, ids, tokenizer, on_step=lambda out: steps.append(out.seconds)):
            if d.token_ids:
                first.setdefault(d.request_id, time.perf_counter() - t0)
            text[d.request_id] += d.text
            if on_delta is not None:
                on_delta(index[d.request_id], d)
        kv = llm.kv_tokens_per_rank()
        projected = llm.prefill_tokens_per_rank()
        ttft = [1e3 * first[i] for i in ids if i in first]
        decode = steps[1:] or steps
        return {
            "model": model,
            "tokens": [llm.outputs[i] for i in ids],
            "text": [text[i] if tokenizer else None for i in ids],
            "finish_reasons": [llm.finish_reasons[i] for i in ids],
            "errors": [llm.errors.get(i) for i in ids],
            "logprobs": None if params.logprobs is None else [
                [_logprob(lp) for lp in llm.logprobs[i]] for i in ids],
            "prompt_logprobs": None if params.prompt_logprobs is None else [
                [_logprob(lp) for lp in llm.prompt_logprobs[i]] for i in ids],
            "layout": layout.as_dict(),
            "world_size": layout.world_size,
            "device": runtime.device,
            "dtype": runtime.dtype, "kv_cache_dtype": runtime.kv_cache_dtype,
            "quantization": runtime.quantization,
            "kv_tokens_per_rank": kv,
            "prefill_tokens_per_rank": projected,
            "step_ms": [round(s * 1e3, 3) for s in steps],
            "ttft_ms": [round(t, 3) for t in ttft],
            "decode_ms_median": round(1e3 * statistics.median(decode), 3) if decode else None,
        }


def _logprob(lp) -> dict | None:
    return None if lp is None else {"logprob": lp.logprob, "top": [list(t) for t in lp.top]}


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


class _Printer:
    """Prints requests in order: the current one's text as it streams, later ones' as soon as
    their turn comes; token-id prompts as one line of ids when they finish."""

    def __init__(self, kinds: list[str], prompts: list[list[int]]):
        self.kinds, self.prompts = kinds, prompts
        self.pending = [[] for _ in kinds]        # per request: deltas not printed yet
        self.done = [False] * len(kinds)
        self.tokens = [[] for _ in kinds]
        self.current = 0

    def __call__(self, i: int, d) -> None:
        self.pending[i].append(d)
        while self.current < len(self.kinds):
            self._flush(self.current)
            if not self.done[self.current]:
                break
            self.current += 1

    def _flush(self, i: int) -> None:
        for d in self.pending[i]:
            if self.kinds[i] == "text" and not self.tokens[i] and not self.done[i]:
                print(f"request {i}: ", end="")
            self.tokens[i] += d.token_ids
            if self.kinds[i] == "text":
                print(d.text, end="")
            if d.finish_reason is not None:
                self._end(i, d)
        self.pending[i] = []
        sys.stdout.flush()

    def _end(self, i: int, d) -> None:
        self.done[i] = True
        err = f": {d.error}" if d.error else ""
        status = (f"{len(self.prompts[i])} prompt tokens -> {len(self.tokens[i])} new, "
                  f"{d.finish_reason}{err}")
        if self.kinds[i] == "text":
            if not self.tokens[i]:
                print(f"request {i}: ", end="")
            print(f"\n  ({status})")
        else:
            print(f"request {i} ({status}): {' '.join(map(str, self.tokens[i]))}")


def encode_prompts(model: str, prompts: list[tuple[str, object]], chat: bool):
    """(kind, value) prompts -> (token ids per prompt, the tokenizer or None)."""
    from helix.serving.tokenizer import load_tokenizer, require_tokenizer
    texts = [v for kind, v in prompts if kind == "text"]
    if chat and not texts:
        raise HelixError("--chat applies to text prompts: give --prompt TEXT")
    tok = load_tokenizer(model)
    if texts:
        tok = require_tokenizer(model, tok, "--prompt")
    out = []
    for kind, value in prompts:
        if kind == "ids":
            out.append(value)
        elif chat:
            out.append(tok.chat([{"role": "user", "content": value}]))
        else:
            out.append(tok.encode(value))
        if not out[-1]:
            raise HelixError(f"prompt {value!r} encodes to no tokens: give some text")
    return out, tok


def run(args) -> int:
    if not args.prompts:
        raise HelixError("give at least one --prompt-ids 5,17,42 or --prompt TEXT "
                         "(see helix generate --help)")
    prompts, tok = encode_prompts(args.model, args.prompts, args.chat)
    kinds = [kind for kind, _ in args.prompts]
    printer = None if args.json else _Printer(kinds, prompts)
    result = run_batch(args.model, prompts, args, tok, printer)
    if args.json:
        print(json.dumps(result))
        return 0
    print(describe(result))
    return 0
