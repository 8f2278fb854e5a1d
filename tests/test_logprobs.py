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
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3),
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
        return [(llm.outputs[i], llm.logprobs.get(i)) for i in ids]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_captured_steps_give_the_eager_steps_logprobs(model):
    """Under CUDA graphs the log-probabilities (and penalised rows' tokens) are computed on the
    graph's static logits after its replay: bitwise those of the same bucketed steps run
    eagerly."""
    captured, eager = _gpu_run(model, False), _gpu_run(model, True)
    assert captured == eager
    (_, lps), (_, sampled), (teacher, _), (_, none) = captured
    assert none is None and teacher[:2] == [3, 4]
    assert all(lp.top[0][1] == lp.logprob for lp in lps)       # argmax (ties: either index)
    assert all(lp.logprob <= 0 and len(lp.top) == 1 for lp in sampled)
