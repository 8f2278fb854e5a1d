"""Seeded sampling on several ranks: every rank holds the same full logits and the same
per-request generator, so each draws the same token; the run equals the single-rank run."""

from __future__ import annotations

from helix import LLM, Layout, RuntimeConfig, SamplingParams

PROMPTS = [[5, 17, 42, 3], [7, 8, 9], [11, 12]]
PARAMS = [SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, seed=7, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=1.2, top_p=0.9, seed=11, ignore_eos=True),
          SamplingParams(max_new_tokens=12, ignore_eos=True)]


def _generate(layout: Layout) -> list[list[int]]:
    with LLM("tiny-llama", layout, RuntimeConfig(page_size=4, max_batch=4)) as llm:
        return llm.generate(PROMPTS, PARAMS)


def test_sampled_tokens_match_single_rank_on_kvp2_tpa2():
    single = _generate(Layout())
    multi = _generate(Layout(kvp=2, tpa=2))
    assert multi == single
    # the sampled requests really sampled: they differ from greedy decoding of the same prompt
    with LLM("tiny-llama", Layout(), RuntimeConfig(page_size=4, max_batch=4)) as llm:
        greedy = llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert single[0] != greedy[0] and single[1] != greedy[1]
