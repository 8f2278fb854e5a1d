"""Context-parallel prefill (helix/kv/context_parallel.py, helix/layers/cp_attention.py) on CPU
ranks over gloo: with pass-KV forced, each KVP rank projects only the prompt positions it owns,
and tokens and fp32 logits still equal the single-rank reference for the whole scenario (mixed
prompt lengths, prompts shorter than kvp x interleave, prompts in several chunks, a prompt
joining while others decode); the same with the KV passed around a ring; pass-Q forced; and the
rule that picks between them."""

from __future__ import annotations

import dataclasses

import pytest

from helix import Layout
from helix.kv.context_parallel import pass_kv_cheaper
from helix.kv.ownership import local_len
from parallel_helpers import RUNTIME, assert_same_run, cached_run, reference_run

PASS_KV = dataclasses.replace(RUNTIME, prefill_cp="pass-kv", max_prefill_tokens=8)
RING = dataclasses.replace(PASS_KV, cp_gather_mb=0)
PASS_Q = dataclasses.replace(RUNTIME, prefill_cp="pass-q", max_prefill_tokens=8)

CASES = [  # model, layout, runtime
    pytest.param("tiny-llama", Layout(kvp=2, tpa=2, kv_interleave=4), PASS_KV,
                 id="gqa-kvp2-tpa2-I4"),
    pytest.param("tiny-llama-h6", Layout(kvp=3, kv_interleave=1), PASS_KV, id="gqa-h6-kvp3-I1"),
    pytest.param("tiny-qwen3-moe", Layout(kvp=2, tpa=2, ep=4, kv_interleave=1), PASS_KV,
                 id="moe-kvp2-tpa2-ep4"),
    pytest.param("tiny-deepseek-v3", Layout(kvp=4, ep=2, kv_interleave=4), PASS_KV,
                 id="mla-kvp4-ep2-I4"),
    pytest.param("tiny-llama", Layout(kvp=2, kv_interleave=1), RING, id="gqa-kvp2-ring"),
    pytest.param("tiny-llama", Layout(kvp=2, kv_interleave=4), PASS_Q, id="gqa-kvp2-pass-q"),
]


@pytest.mark.parametrize("model,layout,runtime", CASES)
def test_context_parallel_prefill_matches_single_rank(model, layout, runtime):
    got = cached_run(model, layout, runtime)
    ref = cached_run(model, Layout(), dataclasses.replace(runtime, prefill_cp="auto"))
    assert_same_run(got, ref)
    # every prompt position was projected: by its owner only (pass-KV), by every rank (pass-Q)
    lens = [len(p) for p in ref.prompts.values()]
    per_kvp = [sum(local_len(n, k, layout.kvp, layout.kv_interleave) for n in lens)
               for k in range(layout.kvp)]
    if runtime.prefill_cp == "pass-kv":
        want = [per_kvp[r // layout.tpa] for r in range(layout.world_size)]
    else:
        want = [sum(lens)] * layout.world_size
    assert got.prefill_tokens == want


def test_scenario_prompts_span_several_chunks_and_empty_shards():
    ref = reference_run("tiny-llama")
    lens = sorted(len(p) for p in ref.prompts.values())
    assert lens[0] < 4 and lens[-1] > 2 * PASS_KV.max_prefill_tokens


@pytest.mark.parametrize("new,cached,kv_row,q_row,want", [
    (100, 0, 2 * 8 * 128, 32 * 129, True),        # a first chunk always passes KV
    (100, 100, 2 * 8 * 128, 32 * 129, True),      # Llama-3 8B: threshold ~ 2 Hkv / H = 0.5
    (100, 110, 2 * 8 * 128, 32 * 129, False),
    (10, 1000, 576, 128 * 513, True),             # MLA: threshold ~ 1 / H
    (1, 1000, 576, 128 * 513, False),
    (0, 0, 1, 1, False),
])
def test_pass_kv_rule(new, cached, kv_row, q_row, want):
    assert pass_kv_cheaper(new, cached, kv_row, q_row) is want
