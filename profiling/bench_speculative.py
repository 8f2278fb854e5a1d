"""What speculative decoding's verification costs and gives a decode step: whole steps of the same
batch and context (one rank, graphs where the device has them) in three modes:

  base      one-token steps (speculative_tokens 0, the runtime's default overlap);
  kept      k guesses a step that are all kept (an oracle replays the base run's tokens, and
            keeping is forced: in bf16 the chunk's kernels round differently from the decode
            kernel's, so a near-tie of a random model may go the other way): each step emits
            k + 1 tokens, the most verification can give;
  rejected  k guesses a step that are all wrong: each step emits 1 token for k + 1 rows, what
            a guess costs when the n-gram lookup misses.

A real workload's tokens per step lie between (the n-gram acceptance rate: the engine's
speculative_accepted_tokens / speculative_draft_tokens, /metrics' counters). Records carry
`tokens_match`, the share of each mode's tokens equal to the base run's (1.0 in fp32; in bf16
near-ties of the random weights may differ). Prompts are synthetic prefixes (helix sweep's: the
context's KV taken as written) plus one token.

    python profiling/bench_speculative.py --model llama-3.1-8b --layers 4 --batches 1,8 \\
        --contexts 8192,32768 --k 4 --out speculative.json
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.runtime.speculative import Drafter  # noqa: E402
from profiling import bench_args  # noqa: E402

MODES = ("base", "kept", "rejected")


class Oracle(Drafter):
    """Guesses from known outputs (prompt -> the tokens it generates): all right, or with
    `wrong`, every guess off by one id (all rejected)."""

    def __init__(self, outputs: list[list[int]], k: int, prompts: list[list[int]],
                 wrong: bool = False, vocab: int = 1 << 30):
        super().__init__(k, 1)
        self.future = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.wrong, self.vocab = wrong, vocab

    def guess(self, r, room: int) -> list[int]:
        out = self.future[tuple(r.prompt)][len(r.output):len(r.output) + room]
        return [(t + 1) % self.vocab for t in out] if self.wrong else out


def run_mode(model: str, layers: int, batch: int, context: int, k: int, mode: str, device: str,
             new_tokens: int, base: list[list[int]] | None, seed: int = 0) -> dict:
    import torch

    from helix.config import Layout, RuntimeConfig
    from helix.runtime.llm import LLM
    from helix.runtime.sampling import SamplingParams
    rt = RuntimeConfig(device=device, dtype="bfloat16" if device == "cuda" else "float32",
                       layers=layers, max_batch=batch, max_context=context + new_tokens + k + 2,
                       graph_buckets=(batch,), prefix_caching=False,
                       speculative_tokens=0 if mode == "base" else k)
    g = torch.Generator().manual_seed(seed)
    with LLM(model, Layout(), rt) as llm:
        vocab = llm.cfg.vocab_size
        prompts = [torch.randint(0, vocab, (1,), generator=g).tolist() + [b % vocab]
                   for b in range(batch)]
        if mode != "base":
            llm.engine.scheduler.drafter = Oracle(base, k, prompts, mode == "rejected", vocab)
        if mode == "kept":                          # every guess kept, whatever the rows chose
            verified = llm.engine._verified
            llm.engine._verified = lambda r, guesses, chosen, *a: verified(
                r, guesses, list(guesses) + chosen[len(guesses):], *a)
        sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        ids = [llm.add_request(p, sp, synthetic_prefix=context - len(p)) for p in prompts]
        llm.step()                                  # the first token (synthetic: no prefill)
        times = []
        t0 = time.perf_counter()
        while llm.has_unfinished():
            t = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        outputs = [llm.outputs[i] for i in ids]
        stats = llm.stats()
    same = sum(a == b for o, p in zip(outputs, base or outputs) for a, b in zip(o, p))
    tokens = batch * (new_tokens - 1)
    return {"model": model, "layers": layers, "device": device, "batch": batch,
            "context": context, "mode": mode, "k": 0 if mode == "base" else k,
            "steps": len(times), "step_ms_median": 1e3 * statistics.median(times),
            "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "tokens_per_step": tokens / len(times),
            "draft_tokens": stats["speculative_draft_tokens"],
            "accepted_tokens": stats["speculative_accepted_tokens"],
            "tokens_match": same / (batch * new_tokens), "outputs": outputs}


def measure(model: str, layers: int, batches: list[int], contexts: list[int], k: int,
            device: str, new_tokens: int) -> list[dict]:
    records = []
    for b in batches:
        for c in contexts:
            base = run_mode(model, layers, b, c, k, "base", device, new_tokens, None)
            records.append(base)
            for mode in MODES[1:]:
                records.append(run_mode(model, layers, b, c, k, mode, device, new_tokens,
                                        base["outputs"]))
    for r in records:
        del r["outputs"]
    return records


def table(records: list[dict]) -> str:
    base = {(r["batch"], r["context"]): r for r in records if r["mode"] == "base"}
    lines = ["batch  context  mode      k  step ms  tok/step    tok/s  x base tok/s  x base step"]
    for r in records:
        b = base[(r["batch"], r["context"])]
        lines.append(f"{r['batch']:5d}  {r['context']:7d}  {r['mode']:8s} {r['k']:2d} "
                     f"{r['step_ms_median']:8.3f}  {r['tokens_per_step']:8.2f} "
                     f"{r['tokens_per_s']:8.1f}  {r['tokens_per_s'] / b['tokens_per_s']:12.3f}"
                     f"  {r['step_ms_median'] / b['step_ms_median']:11.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--k", type=int, default=4, help="guesses a step")
    ap.add_argument("--new-tokens", type=int, default=41, help="tokens a request generates")
    args = ap.parse_args(argv)
    if args.k < 1 or args.new_tokens < 2:
        print("bench_speculative: --k must be >= 1 and --new-tokens >= 2", file=sys.stderr)
        return 2
    records = measure(args.model, args.layers, [int(b) for b in args.batches.split(",")],
                      [int(c) for c in args.contexts.split(",")], args.k, args.device,
                      args.new_tokens)
    return bench_args.finish(records, args.out, table(records))


if __name__ == "__main__":
    sys.exit(main())
