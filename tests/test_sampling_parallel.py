"""Seeded sampling on several ranks: every rank holds the same full logits and the same
per-request generator, so each draws the same token (penalties included); the run equals the
single-rank run, and so do the tokens' log-probabilities."""

from __future__ import annotations

from helix import LLM, Layout, RuntimeConfig, SamplingParams

PROMPTS = [[5, 17, 42, 3], [7, 8, 9], [11, 12]]
PARAMS = [SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, seed=7, ignore_eos=True,
                         logprobs=3),
          SamplingParams(max_new_tokens=12, temperature=1.2, top_p=0.9, seed=11, ignore_eos=True,
                         frequency_penalty=0.5, repetition_penalty=1.2),
          SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=1)]


def _generate(layout: Layout, logprobs: list | None = None) -> list[list[int]]:
    with LLM("tiny-llama", layout, RuntimeConfig(page_size=4, max_batch=4)) as llm:
        out = llm.generate(PROMPTS, PARAMS)
        if logprobs is not None:
            logprobs += [llm.logprobs.get(i) for i in sorted(llm.outputs)]
        return out


def test_sampled_tokens_match_single_rank_on_kvp2_tpa2():
    lp_single, lp_multi = [], []
    single = _generate(Layout(), lp_single)
    multi = _generate(Layout(kvp=2, tpa=2), lp_multi)
    assert multi == single
    assert lp_single[1] is None and lp_multi[1] is None
    for a, b in ((lp_single[i], lp_multi[i]) for i in (0, 2)):
        assert len(a) == len(b) == 12
        assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) <= 1e-5
    # the sampled requests really sampled: they differ from greedy decoding of the same prompt
    with LLM("tiny-llama", Layout(), RuntimeConfig(page_size=4, max_batch=4)) as llm:
        greedy = llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert single[0] != greedy[0] and single[1] != greedy[1]


def _prompt_logprobs(layout: Layout) -> list:
    rt = RuntimeConfig(page_size=4, max_batch=4, max_prefill_tokens=8, prefill_cp="pass-kv")
    with LLM("tiny-llama", layout, rt) as llm:
        ids = [llm.add_request(list(range(5, 5 + 3 * n, 3)),
                               SamplingParams(max_new_tokens=2, prompt_logprobs=2))
               for n in (21, 6)]
        while llm.has_unfinished():
            llm.step()
        return [llm.prompt_logprobs[i] for i in ids]


def test_prompt_logprobs_under_context_parallel_prefill_match_single_rank():
    """KVP 2 passing KV: each rank projects the positions it owns, yet every rank holds every
    row's hidden state after the attention's exchange, so the prompt scores equal one rank's."""
    single, multi = _prompt_logprobs(Layout()), _prompt_logprobs(Layout(kvp=2))
    for a, b in zip(single, multi):
        assert len(a) == len(b) and a[0] is None and b[0] is None
        assert [[t for t, _ in x.top] for x in a[1:]] == [[t for t, _ in x.top] for x in b[1:]]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:])) <= 1e-5
