"""HOP-B (helix/layers/hopb.py): the decode batch in M micro-batches, each one's KVP exchange
overlapping the next one's attention. On CPU ranks (gloo) the micro-batches run in order, so
tokens and logits must equal M = 1 bitwise, for M in {2, 3, 4}, uneven splits included, across
Helix layouts; the split really happens (the overlapped path runs once per layer and step)."""

from __future__ import annotations

import functools

import pytest
import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.layers import attention_gqa, attention_mla, hopb

PROMPTS = [list(range(3 + i, 9 + 2 * i)) for i in range(7)]     # 7 rows: uneven splits


def test_bounds_and_auto_choice():
    assert hopb.bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert hopb.bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert hopb.bounds(2, 2) == [(0, 1), (1, 2)]
    assert hopb.micro_batches(4, 16, kvp=1) == 1          # no exchange to hide
    assert hopb.micro_batches(4, 3, kvp=2) == 3           # never more than the rows
    assert hopb.micro_batches(0, 8, kvp=2) == 2 and hopb.micro_batches(0, 7, kvp=2) == 1


@functools.cache
def run(model: str, layout: Layout, m: int):
    rt = RuntimeConfig(page_size=4, max_context=64, max_batch=8, hopb=m)
    calls = []
    module = attention_mla if "deepseek" in model else attention_gqa
    real = module.overlapped

    def counting(attend, exchange, rows, micro, device):
        calls.append((rows, micro))
        return real(attend, exchange, rows, micro, device)

    module.overlapped = counting
    try:
        with LLM(model, layout, rt) as llm:
            for p in PROMPTS:
                llm.add_request(p, SamplingParams(max_new_tokens=5, ignore_eos=True))
            logits = []
            while llm.has_unfinished():
                llm.step()
                logits.append(llm.engine.last_logits.clone())
            return [llm.outputs[i] for i in range(len(PROMPTS))], logits, calls
    finally:
        module.overlapped = real


@pytest.mark.parametrize("model,layout,ms", [
    ("tiny-llama", Layout(kvp=2), (2, 3)),
    ("tiny-llama", Layout(kvp=2, tpa=2, kv_interleave=4), (4,)),
    ("tiny-deepseek-v3", Layout(kvp=2, kv_interleave=8), (3,)),
], ids=["gqa-kvp2", "gqa-kvp2-tpa2", "mla-kvp2"])
def test_hopb_equals_one_micro_batch(model, layout, ms):
    ref_tokens, ref_logits, ref_calls = run(model, layout, 1)
    assert not ref_calls
    layers = 4
    for m in ms:
        tokens, logits, calls = run(model, layout, m)
        assert tokens == ref_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
        # decode steps of 7 rows (graph bucket 8 on CPU: same path, eager), every layer split
        assert calls and all(c == (8, m) or c[1] == min(m, c[0]) for c in calls)
        assert len(calls) % layers == 0 and len(calls) >= 4 * layers
