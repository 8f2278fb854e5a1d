"""The `helix` command line.

  helix demo                         a Helix decode of a small default model (GPU if present)
  helix generate --model M --prompt-ids 5,17,42 [--prompt-ids ...] --max-new-tokens N [--json]
                 [--kvp K --tpa A [--tpf F] [--ep E] [--kv-interleave I]]
  helix sweep configs/sweeps/tiny-cpu.yaml [--out results.json]   decode latency sweeps

A user's mistake exits non-zero with one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from helix.errors import HelixError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        print(f"helix: error: {message} (see helix {self.prog.split()[-1]} --help)", file=sys.stderr)
        sys.exit(2)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None


def _add_runtime_args(p: argparse.ArgumentParser, device_default: str | None) -> None:
    from helix.config import ATTENTION_BACKENDS, RuntimeConfig
    d = RuntimeConfig()
    g = p.add_argument_group("layout")
    g.add_argument("--kvp", type=int, default=1, help="KV-parallel degree (sequence split)")
    g.add_argument("--tpa", type=int, default=1, help="attention tensor-parallel degree (KV heads)")
    g.add_argument("--tpf", type=int, default=None, help="FFN tensor-parallel degree (default world/ep)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    g.add_argument("--kv-interleave", type=int, default=1, help="KV positions per round-robin block")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", choices=["cpu", "cuda"], default=device_default,
                   help="default: cuda when a GPU is present, else cpu")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--page-size", type=int, default=d.page_size, help="KV positions per page")
    g.add_argument("--max-context", type=int, default=d.max_context, help="prompt + generation cap")
    g.add_argument("--max-batch", type=int, default=d.max_batch, help="most running requests")
    g.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pages per rank (0: auto)")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                   default=d.attention_backend,
                   help="attention kernels (auto: triton on cuda, the torch reference on cpu)")
    g.add_argument("--seed", type=int, default=d.seed, help="preset weights / default sampling seed")
    g.add_argument("--layers", type=int, default=0, help="run only the first n layers (0: all)")
    g = p.add_argument_group("CUDA graphs")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly")
    g.add_argument("--graph-buckets", type=_ids, default=(),
                   help="batch buckets, e.g. 1,2,4,8 (default 1,2,4,8,16,24,... up to --max-batch)")
    g.add_argument("--graph-breaks", type=lambda t: tuple(x for x in t.split(",") if x), default=(),
                   help="regions to run eagerly inside the graph: attention, moe")
    g.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                   help="finish each step before preparing the next (default on cuda: overlap)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (greedy unless --temperature > 0)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop-ids", type=_ids, default=(), help="comma-separated ids that end a request")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos ids")


def _configs(args):
    import torch

    from helix.config import Layout, RuntimeConfig
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    layout = Layout(kvp=args.kvp, tpa=args.tpa, tpf=args.tpf, ep=args.ep,
                    kv_interleave=args.kv_interleave)
    runtime = RuntimeConfig(device=device, dtype=dtype, page_size=args.page_size,
                            max_context=args.max_context, max_batch=args.max_batch,
                            num_pages=args.num_pages, attention_backend=args.attention_backend,
                            seed=args.seed, layers=args.layers, cuda_graphs=args.cuda_graphs,
                            graph_buckets=tuple(args.graph_buckets), graph_breaks=args.graph_breaks,
                            overlap=args.overlap)
    return layout, runtime


def _sampling(args):
    from helix.runtime.sampling import SamplingParams
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.sample_seed,
                          stop_token_ids=tuple(args.stop_ids), ignore_eos=args.ignore_eos)


def _run(model: str, prompts: list[list[int]], args) -> dict:
    """Run the prompts as one batch; returns tokens, timing and KV accounting."""
    from helix.runtime.llm import LLM
    layout, runtime = _configs(args)
    params = _sampling(args)
    with LLM(model, layout, runtime) as llm:
        ids = [llm.add_request(p, params) for p in prompts]
        steps = []
        while llm.has_unfinished():
            steps.append(llm.step())
        kv = llm.kv_tokens_per_rank()
        return {
            "model": model,
            "tokens": [llm.outputs[i] for i in ids],
            "finish_reasons": [llm.finish_reasons[i] for i in ids],
            "layout": layout.as_dict(),
            "world_size": layout.world_size,
            "device": runtime.device,
            "dtype": runtime.dtype,
            "kv_tokens_per_rank": kv,
            "step_ms": [round(s.seconds * 1e3, 3) for s in steps],
        }


def cmd_generate(args) -> int:
    if not args.prompt_ids:
        raise HelixError("give at least one --prompt-ids 5,17,42")
    result = _run(args.model, args.prompt_ids, args)
    if args.json:
        print(json.dumps(result))
    else:
        for i, toks in enumerate(result["tokens"]):
            print(f"request {i}: {' '.join(map(str, toks))}")
    return 0


def cmd_demo(args) -> int:
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.kvp is None:
        args.kvp = 2 if gpus != 1 else 1       # CPU ranks (gloo) or 2 GPUs: a real Helix layout
    args.tpa = args.tpa or 1
    g = torch.Generator().manual_seed(args.seed)
    lengths = [5, 23, 61]
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    t0 = time.perf_counter()
    result = _run(args.model, prompts, args)
    dev = result["device"]
    print(f"Helix demo: model {args.model}, layout {result['layout']}, {result['world_size']} "
          f"{'GPU' if dev == 'cuda' else 'CPU'} rank(s), {result['dtype']}")
    for n, toks, why in zip(lengths, result["tokens"], result["finish_reasons"]):
        print(f"  prompt of {n:3d} tokens -> {len(toks)} new ({why}): {' '.join(map(str, toks))}")
    steps = result["step_ms"]
    decode = sorted(steps[1:]) or steps
    print(f"  step latency: prefill {steps[0]:.2f} ms, decode median {decode[len(decode) // 2]:.2f} ms "
          f"over {len(steps) - 1} steps")
    total = sum(n + len(t) - 1 for n, t in zip(lengths, result["tokens"]))
    for r, held in enumerate(result["kv_tokens_per_rank"]):
        print(f"  rank {r}: {held} KV positions (layer 0) of {total} written")
    print(f"  wall time {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_sweep(args) -> int:
    from helix.sweep import load_sweep, run_sweep
    sweep = load_sweep(args.file)
    records: list[dict] = []

    def report(rec):
        records.append(rec)
        lay = rec["layout"]
        print(f"{rec['model']:>18} kvp={lay['kvp']} tpa={lay['tpa']} ep={lay['ep']} "
              f"B={rec['batch']:<3} ctx={rec['context']:<7} step {rec['step_ms_median']:8.2f} ms "
              f"(p90 {rec['step_ms_p90']:.2f})  {rec['tokens_per_s']:9.1f} tok/s", flush=True)
        if args.out:
            with open(args.out, "w") as f:     # after every point: an interrupted sweep keeps data
                json.dump(records, f, indent=1)

    run_sweep(sweep, report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="helix", description="Helix-parallel decode runtime")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    p = sub.add_parser("generate", help="generate tokens for a batch of prompts")
    p.add_argument("--model", required=True, help="checkpoint directory, preset name or preset YAML")
    p.add_argument("--prompt-ids", type=_ids, action="append", default=[],
                   help="comma-separated token ids; repeat for each request of the batch")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    _add_sampling_args(p)
    _add_runtime_args(p, None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("sweep", help="decode latency over a YAML sweep (configs/sweeps/)")
    p.add_argument("file", help="sweep YAML: models, layouts, batches, contexts, ...")
    p.add_argument("--out", default=None, help="JSON file for the records")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("demo", help="a Helix decode of a small default model")
    p.add_argument("--model", default="tiny-llama", help="preset or checkpoint (default tiny-llama)")
    _add_sampling_args(p)
    _add_runtime_args(p, None)
    p.set_defaults(func=cmd_demo, kvp=None, tpa=None, max_new_tokens=24, ignore_eos=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HelixError as e:
        print(f"helix: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("helix: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
