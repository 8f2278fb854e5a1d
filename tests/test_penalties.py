"""Repetition / frequency / presence penalties, logit_bias and min_tokens
(helix/runtime/penalties.py): every
greedy token equals the argmax of Hugging Face's logits at its position after the same
processing (HF's own RepetitionPenaltyLogitsProcessor for the repetition part), HF `generate`
with repetition_penalty gives the same tokens, sampled rows are processed too, and nothing
depends on overlap or on the other requests of the batch."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import SMALL, hf_processed_argmax

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.errors import RequestError

PROMPTS = [[77], list(range(3, 40, 3)), [5, 17, 42, 17, 5]]
NEW = 10


def _run(path, params, overlap=False, prompts=PROMPTS):
    with LLM(path, Layout(), RuntimeConfig(**SMALL, overlap=overlap)) as llm:
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        while llm.has_unfinished():
            llm.step()
        assert not llm.engine.vocab_rows                  # dropped when the requests retired
        return [llm.outputs[i] for i in ids]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_penalized_greedy_tokens_match_transformers(hf_checkpoint, family):
    path, hf = hf_checkpoint(family)
    params = [SamplingParams(max_new_tokens=NEW, repetition_penalty=1.4, ignore_eos=True),
              SamplingParams(max_new_tokens=NEW, frequency_penalty=1.5, presence_penalty=0.7,
                             logit_bias={9: 3.0, "11": -100}, ignore_eos=True),
              SamplingParams(max_new_tokens=NEW, repetition_penalty=0.8, presence_penalty=-0.5,
                             ignore_eos=True)]
    plain = _run(path, [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * 3)
    got = _run(path, params)
    for prompt, sp, out, base in zip(PROMPTS, params, got, plain):
        assert out == hf_processed_argmax(hf, prompt, out, sp)
        assert out != base                                 # the processing changed the run
    assert 11 not in got[1]
    for prompt, out in zip(PROMPTS, got[:1]):              # HF generate, repetition penalty
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=NEW, min_new_tokens=NEW, repetition_penalty=1.4,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out == want


def test_processed_rows_do_not_depend_on_overlap_or_the_batch(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    params = [SamplingParams(max_new_tokens=NEW, temperature=0.3, seed=3, frequency_penalty=2.0,
                             ignore_eos=True),
              SamplingParams(max_new_tokens=NEW, temperature=0.7, seed=5, ignore_eos=True),
              # its greedy run repeats one token: under overlap, the penalty must count the
              # token still on the device
              SamplingParams(max_new_tokens=NEW, repetition_penalty=1.3, ignore_eos=True)]
    prompts = PROMPTS[::-1]
    base = _run(path, params, prompts=prompts)
    assert _run(path, params, overlap=True, prompts=prompts) == base
    assert [_run(path, [sp] * 3, prompts=prompts)[i] for i, sp in enumerate(params)] == base
    unpenalized = _run(path, [SamplingParams(max_new_tokens=NEW, temperature=0.3, seed=3,
                                             ignore_eos=True)] * 3, prompts=prompts)
    assert base[0] != unpenalized[0]                       # the sampled row was processed


def test_forced_tokens_count_as_output_for_the_penalties(hf_checkpoint):
    """Teacher-forced tokens are output: a penalty counts them (under overlap the one still
    pending is the step's input id, not a device token). Token 9, biased up and forced three
    times: with all three counted the next token is another (37); with two it would be 9."""
    path, hf = hf_checkpoint("llama")
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True, forced_tokens=(9, 9, 9),
                        frequency_penalty=2.0, logit_bias={9: 9.25})
    outs = [_run(path, [sp] * 3, overlap)[2] for overlap in (False, True)]
    assert outs[0] == outs[1] and outs[0][:3] == [9, 9, 9]
    assert outs[0][3:] == hf_processed_argmax(hf, PROMPTS[2], outs[0], sp)[3:]
    assert outs[0][3] != 9


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_holds_back_the_stop_ids(hf_checkpoint, overlap):
    path, _ = hf_checkpoint("llama")
    free = _run(path, [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * 3)[1]
    stop = free[1]
    params = [SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,), min_tokens=m)
              for m in (0, 6, NEW)]
    got = _run(path, params, overlap, prompts=[PROMPTS[1]] * 3)
    assert got[0] == free[:2]                              # stops at its stop id
    for out, m in zip(got[1:], (6, NEW)):
        assert len(out) >= m and stop not in out[:m]
        assert out[:1] == free[:1]                         # the same until the stop id
        assert out[-1] == stop or len(out) == NEW


@pytest.mark.parametrize("field,bad", [("repetition_penalty", 0), ("repetition_penalty", -1.0),
                                       ("frequency_penalty", 2.5), ("presence_penalty", -3),
                                       ("presence_penalty", float("nan")),
                                       ("logit_bias", {5: 101}), ("logit_bias", {"x": 1}),
                                       ("logit_bias", {-1: 1}), ("logit_bias", [5]),
                                       ("min_tokens", 17), ("min_tokens", -1)])
def test_bad_penalty_fields_are_one_line_errors(field, bad):
    with pytest.raises(RequestError, match="logit_bias" if field == "logit_bias" else field):
        SamplingParams(**{field: bad})


def test_logit_bias_outside_the_vocabulary_is_refused(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    with LLM(path, Layout(), RuntimeConfig(**SMALL)) as llm:
        with pytest.raises(RequestError, match="logit_bias holds 128"):
            llm.add_request([1, 2], SamplingParams(logit_bias={128: 1.0}))
