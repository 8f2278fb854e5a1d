"""Every layout against the single-rank fp32 reference, and one per family against
`transformers`, on CPU ranks over gloo.

Each case is one multi-process run of the scenario in parallel_helpers (mixed prompt lengths in
one batch, prompts shorter than kvp * interleave so some KVP ranks start with empty shards, >= 32
decode steps, a request joining mid-run and one leaving early). Greedy tokens must be identical
and every step's fp32 logits within 1e-4 relative. The matrix (CASES) is described where it is
defined; `test_matrix_covers_the_issue` keeps it honest.
"""

from __future__ import annotations

import pytest

from helix import Layout
from parallel_helpers import (CASES, INITIAL, JOIN_AT, JOINER, LOGITS_RTOL, PAGE, Case,
                              assert_same_run, cached_run, max_rel_err, reference_run)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_layout_matches_single_rank(case: Case):
    assert_same_run(cached_run(case.model, case.layout), reference_run(case.model))


def test_scenario_exercises_the_edge_cases():
    """The reference run really has the shape the cases rely on."""
    ref = reference_run("tiny-llama")
    first, *_, joiner = ref.prompts
    assert len(ref.batches[0]) == 3              # short prompts in one step, the long in chunks
    assert len(ref.batches[1]) == 4 and len(ref.batches[2]) == 5
    assert len({len(p) for p in ref.prompts.values()}) == len(ref.prompts)
    assert min(len(p) for p in ref.prompts.values()) < min(c.kvp * c.interleave
                                                             for c in CASES if c.kvp > 1)
    assert joiner not in ref.batches[JOIN_AT - 1] and joiner in ref.batches[JOIN_AT]
    assert len(ref.batches[JOIN_AT]) == len(INITIAL) + 1            # its prefill next to decodes
    assert len(ref.batches[-1]) == 1                                # others left before it
    assert min(len(t) for t in ref.tokens.values()) >= 20
    assert len(ref.tokens[first]) - 1 >= 32 and JOINER[1] - 1 >= 32  # decode steps


def test_matrix_covers_the_issue():
    """Each (kvp, tpa) pair, each ep for MoE, each interleave value, on each model family."""
    family = {"tiny-llama": "gqa", "tiny-llama-h6": "gqa", "tiny-qwen3-moe": "moe",
              "tiny-deepseek-v3": "mla", "tiny-deepseek-v3-h6": "mla"}
    pairs = {(c.kvp, c.tpa) for c in CASES}
    assert {(2, 1), (1, 2), (2, 2), (4, 1), (3, 1)} <= pairs
    for fam in ("gqa", "moe", "mla"):
        cases = [c for c in CASES if family[c.model] == fam]
        assert {1, 4, PAGE} <= {c.interleave for c in cases if c.kvp > 1}, fam
        assert {(2, 1), (1, 2), (4, 1)} <= {(c.kvp, c.tpa) for c in cases}, fam
        if fam != "gqa":
            assert {1, 2, 4} <= {c.ep for c in cases}, fam
    assert any(c.kvp == 1 and c.tpa > 2 for c in CASES)             # TP baseline replicating GQA KV
    assert any(c.kvp == 1 and family[c.model] == "mla" for c in CASES)


# -- against transformers --------------------------------------------------------------------

HF_CASES = [  # family, kvp, tpa, ep, interleave
    pytest.param("llama", 2, 2, 1, 4, id="hf-llama-kvp2-tpa2-I4"),
    pytest.param("qwen3_moe", 4, 1, 4, 1, id="hf-qwen3_moe-kvp4-tpa1-ep4-I1"),
    pytest.param("deepseek_v3", 2, 1, 2, PAGE, id=f"hf-deepseek_v3-kvp2-tpa1-ep2-I{PAGE}"),
]


@pytest.mark.parametrize("family,kvp,tpa,ep,interleave", HF_CASES)
def test_layout_matches_transformers(hf_checkpoint, family, kvp, tpa, ep, interleave):
    """hf_checkpoint (conftest): the tiny random checkpoint of `family` and its HF model."""
    from hf_fixtures import hf_greedy
    path, model = hf_checkpoint(family)
    run = cached_run(path, Layout(kvp=kvp, tpa=tpa, ep=ep, kv_interleave=interleave))
    for rid, prompt in run.prompts.items():
        tokens, logits = hf_greedy(model, prompt, len(run.tokens[rid]))
        assert run.tokens[rid] == tokens, f"request {rid} (prompt of {len(prompt)})"
        mine = [step[batch.index(rid)] for step, batch in zip(run.logits, run.batches)
                if rid in batch]
        errs = [max_rel_err(a, b) for a, b in zip(mine, logits)]
        assert len(errs) == len(tokens) and max(errs) <= LOGITS_RTOL, (
            f"request {rid}: worst logits rel err {max(errs):.2e} at its step "
            f"{errs.index(max(errs))}")
