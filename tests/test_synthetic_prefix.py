"""Requests with a synthetic KV prefix (long-context benchmarks without prefill): decoding starts
at the prefix's end on every layout, the prefix is held by its owner ranks, bad values fail."""

from __future__ import annotations

import pytest

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.errors import RequestError

PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)


def _run(layout: Layout):
    with LLM("tiny-llama", layout, RuntimeConfig(page_size=4, max_context=256)) as llm:
        a = llm.add_request([7], PARAMS, synthetic_prefix=37)
        b = llm.add_request([3, 4, 5], PARAMS)
        steps = []
        while llm.has_unfinished():
            steps.append(llm.step().num_tokens)
        return [llm.outputs[a], llm.outputs[b]], steps, llm.kv_tokens_per_rank()


def test_synthetic_prefix_decodes_from_its_end_on_every_layout():
    single, steps, kv = _run(Layout())
    assert steps[0] == 1 + 3                 # the prefixed request feeds one token, no prefill
    assert sum(kv) == (37 + 1 + 4) + (3 + 4)
    split, _, kv2 = _run(Layout(kvp=2))      # fresh pools hold zeros: the same noise everywhere
    assert split == single
    assert sorted(kv2) == [24, 25]           # 49 positions, round-robin


def test_bad_synthetic_prefix_is_refused():
    with LLM("tiny-llama", Layout(), RuntimeConfig(max_context=64)) as llm:
        with pytest.raises(RequestError, match="non-negative"):
            llm.add_request([1], PARAMS, synthetic_prefix=-1)
        with pytest.raises(RequestError, match="does not fit the maximum context"):
            llm.add_request([1, 2], PARAMS, synthetic_prefix=62)
        ok = llm.add_request([1], PARAMS, synthetic_prefix=40)
        while llm.has_unfinished():
            llm.step()
        assert len(llm.outputs[ok]) == 5
