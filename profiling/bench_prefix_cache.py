"""What the prefix cache saves a multi-turn conversation: the time to first token of each turn,
whose prompt is the whole conversation so far, with the cache on and off, in one process.

    python profiling/bench_prefix_cache.py --model llama-3.1-8b --layers 4 \\
        --system 32768 --turns 4 --question 256 --answer 64 --out prefix_cache.json

(--kvp N splits the sequence over N ranks: a block is then N x page-size positions, and
"prefilled" counts the prompt tokens rank 0 projected.) With --distract N an unrelated request
of N prompt tokens runs between turns; with --num-pages small enough it pushes the
conversation's blocks out of the pool, and --host-cache-gb G adds a third mode whose evicted
blocks wait in G GiB of host memory (copied back on the next turn instead of prefilled).

Turn k's prompt is a system prompt of --system tokens, then k (question, answer) pairs, then a
new --question tokens; each turn generates --answer tokens (greedy, eos ignored) that join the
history. With the cache on, a turn prefills only what its earlier turns did not write (the last
question and the answer's last token, up to a block); off, its whole prompt. Each mode runs on
its own engine after one warm-up request of unrelated tokens (compiles, captures). Prints the
TTFT per turn and mode and their ratio; --out writes the records.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from profiling import bench_args  # noqa: E402


def conversation(llm, system: int, turns: int, question: int, answer: int, seed: int,
                 distract: int = 0) -> list:
    """Run the turns on an open LLM (an unrelated request of `distract` tokens after each);
    one record per turn."""
    import torch

    from helix.runtime.sampling import SamplingParams
    g = torch.Generator().manual_seed(seed)
    vocab = llm.cfg.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    params = SamplingParams(max_new_tokens=answer, ignore_eos=True)
    history, records = tokens(system), []
    for turn in range(turns):
        prompt = history + tokens(question)
        before = llm.prefill_tokens_per_rank()[0]
        t0 = time.perf_counter()
        rid = llm.add_request(prompt, params)
        while not llm.outputs[rid] and rid not in llm.finish_reasons:
            llm.step()
        ttft = time.perf_counter() - t0
        while llm.has_unfinished():
            llm.step()
        if llm.finish_reasons[rid] == "error":
            raise RuntimeError(f"turn {turn} failed: {llm.errors[rid]}")
        records.append({"turn": turn, "prompt_tokens": len(prompt),
                        "cached_tokens": llm.cached_tokens.get(rid, 0),
                        "prefilled_tokens": llm.prefill_tokens_per_rank()[0] - before,
                        "ttft_ms": 1e3 * ttft})
        history = prompt + llm.outputs[rid]
        if distract:
            llm.generate([tokens(distract)], params)
    return records


def measure(model: str, layers: int, device: str, system: int, turns: int, question: int,
            answer: int, kvp: int = 1, seed: int = 0, distract: int = 0, num_pages: int = 0,
            host_cache_gb: float = 0.0) -> list[dict]:
    """Records of every turn in each mode: the cache off, on, and (host_cache_gb > 0) on with
    its host tier ("mode": off | on | host)."""
    from helix import LLM, Layout, RuntimeConfig
    from helix.runtime.sampling import SamplingParams
    longest = max(system + turns * (question + answer), distract + answer) + 16
    modes = [("off", False, 0.0), ("on", True, 0.0)]
    if host_cache_gb:
        modes.append(("host", True, host_cache_gb))
    out = []
    for mode, cache, gb in modes:
        rt = RuntimeConfig(device=device, dtype="bfloat16" if device == "cuda" else "float32",
                           layers=layers, max_batch=2, max_context=longest, num_pages=num_pages,
                           prefix_caching=cache, host_cache_gb=gb)
        with LLM(model, Layout(kvp=kvp), rt) as llm:
            llm.generate([list(range(3, 3 + min(system, 512)))],           # warm-up
                         SamplingParams(max_new_tokens=2, ignore_eos=True))
            llm.reset_prefix_cache()
            for rec in conversation(llm, system, turns, question, answer, seed, distract):
                out.append({"model": model, "layers": layers, "device": device, "kvp": kvp,
                            "mode": mode, "prefix_caching": cache, "host_cache_gb": gb,
                            "distract": distract, **rec})
    return out


def table(records: list[dict]) -> str:
    """Per turn and cached mode: what it found cached, prefilled, its TTFT and that over off."""
    off = {r["turn"]: r for r in records if r["mode"] == "off"}
    lines = ["turn  mode  prompt  cached  prefilled  TTFT ms  TTFT ms (off)  / off"]
    for r in records:
        if r["mode"] == "off":
            continue
        base = off[r["turn"]]
        lines.append(f"{r['turn']:4d}  {r['mode']:4s}  {r['prompt_tokens']:6d}  "
                     f"{r['cached_tokens']:6d}  {r['prefilled_tokens']:9d}  {r['ttft_ms']:7.1f}  "
                     f"{base['ttft_ms']:13.1f}  {r['ttft_ms'] / base['ttft_ms']:5.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--system", type=int, default=32768, help="system prompt tokens")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--question", type=int, default=256, help="new tokens a turn adds")
    ap.add_argument("--answer", type=int, default=64, help="tokens a turn generates")
    ap.add_argument("--kvp", type=int, default=1, help="KVP ranks (the sequence split)")
    ap.add_argument("--distract", type=int, default=0,
                    help="an unrelated request of this many prompt tokens after each turn")
    ap.add_argument("--num-pages", type=int, default=0, help="KV pages per rank (0: sized)")
    ap.add_argument("--host-cache-gb", type=float, default=0.0,
                    help="a third mode: the cache with this much host memory per rank")
    args = ap.parse_args(argv)
    for name in ("system", "turns", "question", "answer", "kvp"):
        if getattr(args, name) < 1:
            print(f"bench_prefix_cache: --{name} must be >= 1", file=sys.stderr)
            return 2
    records = measure(args.model, args.layers, args.device, args.system, args.turns,
                      args.question, args.answer, args.kvp, distract=args.distract,
                      num_pages=args.num_pages, host_cache_gb=args.host_cache_gb)
    return bench_args.finish(records, args.out, table(records))


if __name__ == "__main__":
    sys.exit(main())
