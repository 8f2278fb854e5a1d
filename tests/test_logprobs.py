"""Log-probabilities of generated tokens (SamplingParams.logprobs): each token's equals the
log-softmax of Hugging Face's logits at its position (the model's distribution, before
temperature and filters), its alternatives are HF's most likely tokens in order, a forced
token gets the forced id's, and they do not depend on the batch, on overlap or on which other
requests asked."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import SMALL

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.errors import RequestError
from helix.runtime.logprobs import MAX_LOGPROBS, TokenLogprob, token_logprobs

PROMPTS = [[5, 17, 42], list(range(3, 40, 3)), [77]]
TOL = 2e-4


def test_token_logprobs_against_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 4
    tokens = torch.tensor([0, 299, 17, 5, 150])
    lp, top_lp, top_ids = token_logprobs(logits.to(torch.bfloat16), tokens, 4)
    want = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
    assert lp.dtype == torch.float32 and torch.allclose(lp, want[torch.arange(5), tokens])
    assert torch.equal(top_ids, want.topk(4, -1).indices)
    assert torch.allclose(top_lp, want.topk(4, -1).values)
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()              # most likely first
    lp0, top0, ids0 = token_logprobs(logits, tokens, 0)
    assert top0.shape == (5, 0) and ids0.shape == (5, 0)
    assert torch.allclose(lp0, torch.log_softmax(logits, -1)[torch.arange(5), tokens])


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0, "3"])
def test_logprobs_field_is_checked(bad):
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS


def _hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at the positions that predict each output token [n, V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1)


def _run(path, params, overlap=False):
    with LLM(path, Layout(), RuntimeConfig(**SMALL, overlap=overlap)) as llm:
        ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        while llm.has_unfinished():
            llm.step()
        got = [(llm.outputs[i], llm.logprobs.get(i)) for i in ids]
        llm.release(ids[0])
        assert ids[0] not in llm.logprobs
        return got


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_logprobs_match_transformers(hf_checkpoint, family):
    path, hf = hf_checkpoint(family)
    forced = (3, 9, 27, 81)
    params = [SamplingParams(max_new_tokens=6, logprobs=5),                     # greedy
              SamplingParams(max_new_tokens=6, temperature=1.5, top_k=20, seed=4, logprobs=2),
              SamplingParams(max_new_tokens=4, forced_tokens=forced, logprobs=0)]
    runs = _run(path, params)
    for prompt, sp, (out, lps) in zip(PROMPTS, params, runs):
        assert len(lps) == len(out) == sp.max_new_tokens
        want = _hf_logprobs(hf, prompt, out)
        for s, (tok, lp) in enumerate(zip(out, lps)):
            assert isinstance(lp, TokenLogprob) and len(lp.top) == sp.logprobs
            assert abs(lp.logprob - want[s, tok].item()) <= TOL, (prompt, s)
            if sp.logprobs:
                top = want[s].topk(sp.logprobs)
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert max(abs(a - b) for (_, a), b in zip(lp.top, top.values.tolist())) <= TOL
    greedy, sampled, teacher = runs
    assert all(lp.top[0] == (t, lp.logprob) for t, lp in zip(*greedy))   # argmax = top 1
    # the sampled row drew unlikely tokens too: its logprobs are of the tokens drawn
    assert any(lp.top[0][0] != t for t, lp in zip(*sampled))
    assert teacher[0] == list(forced)


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at prompt rows 0 .. P-2 (scoring prompt[1:])."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits[:-1], -1)


def _check_prompt_logprobs(hf, prompt, got, k):
    assert len(got) == len(prompt) and got[0] is None
    want = _hf_prompt_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        assert abs(got[p].logprob - want[p - 1, prompt[p]].item()) <= TOL, p
        top = want[p - 1].topk(k)
        assert [t for t, _ in got[p].top] == top.indices.tolist()
        assert max((abs(a - b) for (_, a), b in zip(got[p].top, top.values.tolist())),
                   default=0) <= TOL


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("chunk", [4, 64])
def test_prompt_logprobs_match_transformers(hf_checkpoint, family, chunk, monkeypatch):
    """Prompts prefilled in chunks of 4 (a chunk's last row scores the next chunk's first
    token) or whole (through the LM head 5 rows at a time), next to a decoding request; the
    generated tokens' logprobs too."""
    from helix.runtime import logprobs
    monkeypatch.setattr(logprobs, "PROMPT_ROWS", 5)
    path, hf = hf_checkpoint(family)
    prompts = [list(range(3, 40, 3)), [5, 17, 42], [77, 78]]
    params = [SamplingParams(max_new_tokens=3, prompt_logprobs=2, logprobs=1),
              SamplingParams(max_new_tokens=6),
              SamplingParams(max_new_tokens=2, prompt_logprobs=0)]
    with LLM(path, Layout(), RuntimeConfig(**{**SMALL, "max_prefill_tokens": chunk})) as llm:
        ids = [llm.add_request(prompts[1], params[1])]
        llm.step()                                  # it decodes while the others prefill
        ids = [llm.add_request(prompts[0], params[0]), ids[0],
               llm.add_request(prompts[2], params[2])]
        while llm.has_unfinished():
            llm.step()
        assert ids[1] not in llm.prompt_logprobs
        for i, prompt, sp in ((0, prompts[0], params[0]), (2, prompts[2], params[2])):
            _check_prompt_logprobs(hf, prompt, llm.prompt_logprobs[ids[i]], sp.prompt_logprobs)
        out = llm.outputs[ids[0]]
        want = _hf_logprobs(hf, prompts[0], out)
        assert [abs(lp.logprob - want[s, t].item()) <= TOL
                for s, (t, lp) in enumerate(zip(out, llm.logprobs[ids[0]]))] == [True] * 3


def test_prompt_logprobs_are_scored_once_through_preemption(hf_checkpoint):
    """A pool for about one request: the newest is preempted and its prompt recomputed; its
    prompt positions are still scored once each."""
    path, hf = hf_checkpoint("llama")
    a, b = [5, 17, 42, 9, 88, 3, 61], list(range(10, 50))
    with LLM(path, Layout(), RuntimeConfig(**{**SMALL, "num_pages": 12})) as llm:
        ra = llm.add_request(a, SamplingParams(max_new_tokens=9, ignore_eos=True))
        rb = llm.add_request(b, SamplingParams(max_new_tokens=8, ignore_eos=True,
                                               prompt_logprobs=1))
        preempted = 0
        while llm.has_unfinished():
            llm.step()
            preempted = max([preempted] + [r.preemptions for r in llm.engine.scheduler.running
                                           if r.id == rb])
        assert preempted >= 1 and len(llm.outputs[ra]) == 9
        _check_prompt_logprobs(hf, b, llm.prompt_logprobs[rb], 1)


def test_prompt_logprobs_need_the_prompt_prefilled(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    with LLM(path, Layout(), RuntimeConfig(**SMALL)) as llm:
        with pytest.raises(RequestError, match="prompt_logprobs needs the whole prompt"):
            llm.add_request([1, 2], SamplingParams(prompt_logprobs=1), synthetic_prefix=8)


def test_logprobs_do_not_depend_on_overlap_or_on_other_requests(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    params = [SamplingParams(max_new_tokens=5, logprobs=3),
              SamplingParams(max_new_tokens=5, temperature=1.0, seed=2, logprobs=1),
              SamplingParams(max_new_tokens=5)]
    plain = _run(path, params)
    assert plain[2][1] is None                      # not asked: none kept
    overlapped = _run(path, params, overlap=True)
    alone = [_run(path, [sp] * 3)[i] for i, sp in enumerate(params[:2])]
    for a, b, c in zip(plain, overlapped, alone):
        assert a[0] == b[0] == c[0]
        for x, y, z in zip(a[1], b[1], c[1]):
            assert x.top == y.top and abs(x.logprob - y.logprob) <= 1e-6
            assert [t for t, _ in x.top] == [t for t, _ in z.top]
            assert abs(x.logprob - z.logprob) <= 1e-5


def test_http_shapes_without_a_tokenizer_and_at_minus_infinity():
    from helix.serving.app import LOGPROB_FLOOR, _Format
    lps = [TokenLogprob(-0.5, ((5, -0.5), (9, -2.0))), TokenLogprob(float("-inf"), ((1, -0.1),)),
           TokenLogprob(float("nan"), ())]
    body = _Format(False, "m", 3).logprobs([5, 6, 7], lps)
    assert body == {"tokens": ["token_id:5", "token_id:6", "token_id:7"],
                    "token_logprobs": [-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR],
                    "top_logprobs": [{"token_id:5": -0.5, "token_id:9": -2.0},
                                     {"token_id:1": -0.1}, {}],
                    "text_offset": [0, 10, 20]}
    chat = _Format(True, "m", 3).logprobs([6], lps[1:2])["content"]
    assert chat == [{"token": "token_id:6", "logprob": LOGPROB_FLOOR,
                     "bytes": list(b"token_id:6"),
                     "top_logprobs": [{"token": "token_id:1", "logprob": -0.1,
                                       "bytes": list(b"token_id:1")}]}]
    assert _Format(True, "m", 3).logprobs([6], None) is None


def _gpu_run(model: str, graph_eager: bool):
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", page_size=16, max_batch=4,
                       graph_buckets=(1, 2, 4), attention_backend="triton",
                       graph_eager=graph_eager)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5,
                             logprobs=1),
              SamplingParams(max_new_tokens=6, ignore_eos=True, forced_tokens=(3, 4), logprobs=0),
              SamplingParams(max_new_tokens=3, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5, logit_bias={7: 2.0})]
    with LLM(model, Layout(), rt) as llm:        # overlapped steps (the default on CUDA)
        ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS + [[9, 9]], params)]
        graphed = 0
        while llm.has_unfinished():
            llm.step()
            graphed += llm.engine.last_graphed
        assert graphed >= 4
        return [(llm.outputs[i], llm.logprobs.get(i), llm.prompt_logprobs.get(i)) for i in ids]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_captured_steps_give_the_eager_steps_logprobs(model):
    """Under CUDA graphs the log-probabilities (and penalised rows' tokens) are computed on the
    graph's static logits after its replay, prompt scores on a prefill graph's hidden states:
    bitwise those of the same bucketed steps run eagerly."""
    captured, eager = _gpu_run(model, False), _gpu_run(model, True)
    assert captured == eager
    (_, lps, prompt), (_, sampled, _), (teacher, _, _), (_, none, _) = captured
    assert none is None and teacher[:2] == [3, 4]
    assert len(prompt) == len(PROMPTS[0]) and all(len(lp.top) == 2 for lp in prompt[1:])
    assert all(lp.top[0][1] == lp.logprob for lp in lps)       # argmax (ties: either index)
    assert all(lp.logprob <= 0 and len(lp.top) == 1 for lp in sampled)
