"""Shared pieces of the multi-process (gloo) layout tests: the layout cases, one request scenario,
and runs cached for the whole pytest session.

Spawning costs seconds per rank, so each (model, layout) case is ONE `LLM` that runs the whole
scenario (mixed prompt lengths, prompts shorter than kvp * interleave, >= 32 decode steps, a
request joining mid-run, one leaving early); the per-step logits, tokens and KV accounting are
recorded once and every test reads the recording. The oracle is the same scenario on one rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.loader import read_model_config

PAGE = 8                     # page size; kv_interleave = PAGE is the page round-robin rule
# prompts prefill in chunks of <= 16 tokens (the 23-token prompt in two, the joiner's 13 next to
# decode rows); over KVP ranks each chunk picks pass-KV or pass-Q by the message-size rule
RUNTIME = RuntimeConfig(page_size=PAGE, dtype="float32", max_context=96, max_batch=8,
                        max_prefill_tokens=16)
LOGITS_RTOL = 1e-4           # max |a - b| over a step's logits, relative to max |reference|

# (prompt length, max_new_tokens) of the requests added before the first step: one batch of mixed
# lengths; lengths 1..5 are shorter than kvp * interleave for every Helix case (empty shards at
# prefill), 23 spans several interleave blocks. The 20-token request leaves while others decode.
INITIAL = ((1, 34), (2, 34), (5, 34), (11, 20), (23, 34))
JOINER = (13, 34)            # joins before step JOIN_AT, while the others decode
JOIN_AT = 5                  # 0-based step index


@dataclass(frozen=True)
class Case:
    """One multi-process run: a model (preset name or checkpoint dir) in one layout."""

    model: str
    kvp: int
    tpa: int
    ep: int = 1
    interleave: int = 1

    @property
    def layout(self) -> Layout:
        return Layout(kvp=self.kvp, tpa=self.tpa, ep=self.ep, kv_interleave=self.interleave)

    @property
    def world(self) -> int:
        return self.kvp * self.tpa

    @property
    def id(self) -> str:
        name = self.model.rstrip("/").split("/")[-1]
        return f"{name}-kvp{self.kvp}-tpa{self.tpa}-ep{self.ep}-I{self.interleave}"


@dataclass
class Run:
    """What one scenario produced, on rank 0."""

    prompts: dict[int, list[int]]     # request id -> prompt
    tokens: dict[int, list[int]]      # request id -> generated ids
    batches: list[list[int]]          # request ids of each step's logits rows, in row order
    logits: list[torch.Tensor]        # per step [S, V] fp32
    kv_tokens: list[int]              # KV positions (layer 0) each rank stored
    prefill_tokens: list[int]         # prompt tokens each rank projected

    def seq_len(self, rid: int) -> int:
        """Positions written to the KV cache: the prompt and every generated token but the last."""
        return len(self.prompts[rid]) + len(self.tokens[rid]) - 1


def scenario_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """The INITIAL prompts then the JOINER's, random ids drawn below min(vocab, 128)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [n for n, _ in INITIAL] + [JOINER[0]]
    return [torch.randint(3, min(vocab, 128), (n,), generator=g).tolist() for n in lengths]


def run_scenario(model: str, layout: Layout, runtime: RuntimeConfig = RUNTIME) -> Run:
    vocab = read_model_config(model)[0].vocab_size
    prompts = scenario_prompts(vocab)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in (*INITIAL, JOINER)]
    run = Run({}, {}, [], [], [], [])
    with LLM(model, layout, runtime) as llm:
        for prompt, sp in zip(prompts[:-1], params[:-1]):
            run.prompts[llm.add_request(prompt, sp)] = prompt
        step = 0
        while llm.has_unfinished():
            if step == JOIN_AT:
                run.prompts[llm.add_request(prompts[-1], params[-1])] = prompts[-1]
            out = llm.step()
            run.batches.append(list(out.tokens))
            run.logits.append(llm.engine.last_logits.float().cpu().clone())
            step += 1
        run.tokens = {rid: list(llm.outputs[rid]) for rid in run.prompts}
        run.kv_tokens = llm.kv_tokens_per_rank()
        run.prefill_tokens = llm.prefill_tokens_per_rank()
    return run


@functools.cache
def cached_run(model: str, layout: Layout, runtime: RuntimeConfig = RUNTIME) -> Run:
    """One run per (model, layout, runtime) per pytest session, shared by every test module."""
    return run_scenario(model, layout, runtime)


def reference_run(model: str) -> Run:
    """The oracle: the same scenario on a single rank, fp32."""
    return cached_run(model, Layout())


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_same_run(got: Run, ref: Run, rtol: float = LOGITS_RTOL) -> None:
    """Same schedule, identical greedy tokens, every step's logits within rtol."""
    assert got.batches == ref.batches, "the two runs scheduled different batches"
    for rid in ref.tokens:
        assert got.tokens[rid] == ref.tokens[rid], (
            f"request {rid} (prompt of {len(ref.prompts[rid])}): greedy tokens differ from step "
            + str(next(i for i, (a, b) in enumerate(zip(got.tokens[rid], ref.tokens[rid]))
                       if a != b)))
    errs = [max_rel_err(a, b) for a, b in zip(got.logits, ref.logits)]
    worst = max(range(len(errs)), key=errs.__getitem__)
    assert errs[worst] <= rtol, (f"step {worst} (batch {ref.batches[worst]}): logits rel err "
                                 f"{errs[worst]:.2e}")


# The layout matrix. Every value the issue names appears without the full cross product:
#   (kvp, tpa)  (2,1): llama, qwen3-moe, deepseek   (1,2): llama, qwen3-moe, deepseek (TP baseline)
#               (2,2): llama, qwen3-moe             (4,1): llama, qwen3-moe, deepseek
#               (3,1): llama-h6, deepseek-h6 (odd world)   (1,4): llama (TP, KV replicated 2x)
#   ep          qwen3-moe: 2, 2 (with tpf 2), 4, 1        deepseek: 1, 4, 2, 3
#   interleave  1, 4 and PAGE for each of the three model families
# MLA's TP baseline (1,2) replicates the one latent head on both ranks.
CASES = (
    # GQA dense: 8 query heads, 2 KV heads
    Case("tiny-llama", 2, 1, interleave=1),
    Case("tiny-llama", 2, 2, interleave=4),
    Case("tiny-llama", 4, 1, interleave=PAGE),
    Case("tiny-llama", 1, 2),
    Case("tiny-llama", 1, 4),
    # 6 query heads, 3 KV heads, tied embeddings, vocab not divisible by 3
    Case("tiny-llama-h6", 3, 1, interleave=4),
    # Qwen3-MoE: 8 query heads, 4 KV heads, 8 experts
    Case("tiny-qwen3-moe", 2, 1, ep=2, interleave=4),
    Case("tiny-qwen3-moe", 2, 2, ep=2, interleave=PAGE),
    Case("tiny-qwen3-moe", 4, 1, ep=4, interleave=1),
    Case("tiny-qwen3-moe", 1, 2, ep=1),
    # DeepSeek-V3: MLA, 8 heads, 8 experts + a shared expert
    Case("tiny-deepseek-v3", 2, 1, ep=1, interleave=PAGE),
    Case("tiny-deepseek-v3", 4, 1, ep=4, interleave=1),
    Case("tiny-deepseek-v3", 1, 2, ep=2),
    # 6 heads, 6 experts: MLA and EP over 3 ranks
    Case("tiny-deepseek-v3-h6", 3, 1, ep=3, interleave=4),
)
