"""Command-line options shared by the commands that run a model (generate, demo, serve,
profile): the layout, the runtime and the sampling flags, with defaults read from the config
dataclasses, and their conversion into the validated configs."""

from __future__ import annotations

import argparse

from helix.config import ATTENTION_BACKENDS, QUANTIZATIONS, Layout, RuntimeConfig
from helix.errors import RequestError
from helix.kv.quant import KV_CACHE_DTYPES
from helix.runtime.sampling import SamplingParams


def token_ids(text: str) -> list[int]:
    """'5,17,42' -> [5, 17, 42]; anything else is one clear argparse error."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token ids, e.g. 5,17,42") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty prompt: give at least one token id, e.g. 5,17,42")
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(
            f"{text!r}: token ids are non-negative integers, e.g. 5,17,42")
    return ids


def _hopb(text: str) -> int:
    if text == "auto":
        return 0
    try:
        m = int(text)
    except ValueError:
        m = 0
    if m < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of micro-batches >= 1 or auto")
    return m


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    g.add_argument("--kvp", type=int, default=1, help="KV-parallel degree (sequence split)")
    g.add_argument("--tpa", type=int, default=1, help="attention tensor-parallel degree (KV heads)")
    g.add_argument("--tpf", type=int, default=None,
                   help="FFN tensor-parallel degree (default world/ep)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE models)")
    g.add_argument("--kv-interleave", type=int, default=1,
                   help="KV positions per round-robin block")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    d = RuntimeConfig()
    g = p.add_argument_group("runtime")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when a GPU is present, else cpu")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=d.kv_cache_dtype,
                   help="KV cache storage (auto: --dtype; fp8: e4m3, half of bf16's bytes, "
                        "twice the positions per GPU)")
    g.add_argument("--quantization", choices=list(QUANTIZATIONS), default=d.quantization,
                   help="weights in memory (auto: the checkpoint's, fp8 checkpoints stay fp8; "
                        "fp8: 16-bit weights quantized at load, 128x128 block scales; none: fp8 "
                        "checkpoints dequantized to --dtype)")
    g.add_argument("--page-size", type=int, default=d.page_size, help="KV positions per page")
    g.add_argument("--max-context", type=int, default=d.max_context,
                   help="prompt + generation cap (0: the model's, at most 8192)")
    g.add_argument("--max-batch", type=int, default=d.max_batch, help="most running requests")
    g.add_argument("--num-pages", type=int, default=d.num_pages,
                   help="KV pages per rank (0: sized from free memory)")
    g.add_argument("--memory-utilization", type=float, default=d.memory_utilization,
                   help="share of device memory (cpu: RAM) to fill, KV pool included "
                        "(0: 0.9 cuda, 0.5 cpu)")
    g.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prompt tokens prefilled per step while requests decode, longer "
                        "prompts in chunks (0: 8192 cuda, 1024 cpu)")
    g.add_argument("--idle-prefill-tokens", type=int, default=d.idle_prefill_tokens,
                   help="... in a step where no request decodes (0: 32768 cuda, "
                        "--max-prefill-tokens cpu)")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                   default=d.attention_backend,
                   help="attention kernels (auto: triton on cuda, the torch reference on cpu)")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="preset weights / default sampling seed")
    g.add_argument("--layers", type=int, default=0, help="run only the first n layers (0: all)")
    g.add_argument("--timeout", type=float, default=d.timeout_s,
                   help="seconds a collective may wait: a dead or hung rank ends the run")
    g.add_argument("--hopb", type=_hopb, default=d.hopb, metavar="M|auto",
                   help="HOP-B: decode batch in M micro-batches, each one's KVP exchange "
                        "overlapping the next one's attention (auto: 2 from 8 rows on)")
    g.add_argument("--prefill-cp", choices=["auto", "pass-kv", "pass-q"], default=d.prefill_cp,
                   help="prompt chunks over KVP ranks: each rank projects its own positions "
                        "(pass-kv) or all of them (pass-q); auto: the smaller message")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the KV of earlier requests whose tokens begin a new one "
                        "(each prompt is prefilled whole)")
    g.add_argument("--scheduling", choices=["fcfs", "priority"], default=d.scheduling,
                   help="fcfs: arrival order; priority: requests' priority first (lower "
                        "first), preempting lower priorities")
    g.add_argument("--host-cache-gb", type=float, default=d.host_cache_gb,
                   help="host memory per rank that keeps cached KV blocks evicted from the "
                        "device (0: they are dropped)")
    g.add_argument("--speculative-tokens", type=int, default=d.speculative_tokens, metavar="K",
                   help="speculative decoding: up to K tokens guessed by n-gram lookup in the "
                        "request's own tokens and verified per step (the same tokens; 0: off; "
                        "steps then do not overlap)")
    g.add_argument("--speculative-ngram", type=int, default=d.speculative_ngram, metavar="N",
                   help="... the longest suffix looked up (n-grams of 1 .. N tokens)")
    g = p.add_argument_group("CUDA graphs")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly (decode and prefill)")
    g.add_argument("--graph-buckets", type=token_ids, default=(),
                   help="batch buckets, e.g. 1,2,4,8 (default 1,2,4,8,16,24,... up to --max-batch)")
    g.add_argument("--graph-breaks", type=_names, default=(),
                   help="regions to run eagerly inside the graph: attention, moe")
    g.add_argument("--no-prefill-graphs", dest="prefill_graphs", action="store_false",
                   default=None, help="run steps with prompt chunks eagerly (default on cuda: "
                                      "graphs)")
    g.add_argument("--prefill-graph-buckets", type=token_ids, default=(),
                   help="tokens per rank of the prefill graphs, e.g. 512,1024,2048 (default 16 "
                        "... 256, then 8 per octave up to --max-prefill-tokens + --max-batch)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                   help="finish each step before preparing the next (default on cuda: overlap)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (greedy unless --temperature > 0)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop-ids", type=token_ids, default=(),
                   help="comma-separated ids that end a request")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos ids")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens of the prompt and output (1: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtracted once per occurrence in the output")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtracted from tokens the output holds")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="each prompt token's log-probability given the ones before it, and K "
                        "alternatives (0-20; in --json's \"prompt_logprobs\")")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no eos / stop id before this many new tokens")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each token's log-probability and its K most likely alternatives "
                        "(0-20; in --json's \"logprobs\")")
    g = p.add_argument_group("structured output (a checkpoint with its tokenizer; one of)")
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="generate JSON following this schema (a file, or the schema inline)")
    g.add_argument("--json-object", action="store_true", help="generate a JSON value")
    g.add_argument("--regex", default=None, help="generate text matching the pattern")
    g.add_argument("--choice", default=None, metavar="A,B,...",
                   help="generate exactly one of these comma-separated strings")


def configs(args) -> tuple[Layout, RuntimeConfig]:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    layout = Layout(kvp=args.kvp, tpa=args.tpa, tpf=args.tpf, ep=args.ep,
                    kv_interleave=args.kv_interleave)
    runtime = RuntimeConfig(device=device, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
                            quantization=args.quantization,
                            page_size=args.page_size,
                            max_context=args.max_context, max_batch=args.max_batch,
                            num_pages=args.num_pages, memory_utilization=args.memory_utilization,
                            max_prefill_tokens=args.max_prefill_tokens,
                            idle_prefill_tokens=args.idle_prefill_tokens,
                            attention_backend=args.attention_backend, seed=args.seed,
                            layers=args.layers, timeout_s=args.timeout,
                            cuda_graphs=args.cuda_graphs, graph_buckets=tuple(args.graph_buckets),
                            graph_breaks=args.graph_breaks, overlap=args.overlap,
                            hopb=args.hopb, prefill_cp=args.prefill_cp,
                            prefill_graphs=args.prefill_graphs,
                            prefill_graph_buckets=tuple(args.prefill_graph_buckets),
                            prefix_caching=args.prefix_caching,
                            host_cache_gb=args.host_cache_gb, scheduling=args.scheduling,
                            speculative_tokens=args.speculative_tokens,
                            speculative_ngram=args.speculative_ngram)
    return layout, runtime


def sampling(args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.sample_seed,
                          stop_token_ids=tuple(args.stop_ids), ignore_eos=args.ignore_eos,
                          logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
                          repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty, min_tokens=args.min_tokens,
                          grammar=grammar(args))


def grammar(args) -> tuple[str, str] | None:
    """The structured-output flags -> a grammar spec (helix/runtime/grammar.py), or None."""
    import json
    import os

    from helix.runtime.grammar import choice_spec
    given = [f for f in ("json_schema", "json_object", "regex", "choice") if getattr(args, f)]
    if len(given) > 1:
        raise RequestError(f"give one of --json-schema, --json-object, --regex, --choice (got "
                           f"{', '.join('--' + f.replace('_', '-') for f in given)})")
    if args.json_schema is not None:
        text = args.json_schema
        if os.path.isfile(text):
            with open(text) as f:
                text = f.read()
        try:
            json.loads(text)
        except ValueError:
            raise RequestError(f"--json-schema: {args.json_schema!r} is neither a file nor "
                               f"JSON") from None
        return ("json_schema", text)
    if args.json_object:
        return ("json", "")
    if args.regex is not None:
        return ("regex", args.regex)
    if args.choice is not None:
        return choice_spec(args.choice.split(","))
    return None
