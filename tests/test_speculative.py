"""Speculative decoding by n-gram lookup (helix/runtime/speculative.py).

The oracle is exact: a request's tokens with guesses verified are the tokens of one-token
steps (each kept guess is the token chosen after the tokens before it: the argmax, or the seeded
draw of that position), so every run here is compared token for token with the same run without
speculation (and transformers' greedy tokens), on GQA and MLA models, over KVP ranks, sampled
requests included, with stop ids and length limits falling inside a step's kept guesses, a pool
tight enough to preempt, the prefix cache, and requests that do not speculate (logprobs) beside
ones that do. The page accounting must come back whole
(rejected guesses' pages released). The index itself is checked against a brute-force search.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_fixtures import SMALL, VOCAB, hf_greedy

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.runtime.speculative import NgramIndex

# prompts that repeat themselves (a tiny random model's greedy output then often loops too)
LOOP = [(5 * i) % 11 + 3 for i in range(11)] * 4
PROMPTS = [LOOP, [7, 9, 7, 9, 7, 9, 4], [(13 * i + 1) % VOCAB for i in range(29)]]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def run(path: str, prompts, params, layout: Layout | None = None, **runtime):
    """Every request to its end -> (outputs, finish reasons, stats); the pool comes back whole."""
    rt = RuntimeConfig(**{**SMALL, "max_prefill_tokens": 16, **runtime})
    with LLM(path, layout or Layout(), rt) as llm:
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        while llm.has_unfinished():
            llm.step()
        stats = llm.stats()
        assert llm.engine.kv_pages_free() == llm.engine.num_pages
        return ([llm.outputs[i] for i in ids], [llm.finish_reasons[i] for i in ids], stats)


# -- the index -----------------------------------------------------------------------------------

def brute_draft(tokens: list[int], ngram: int, k: int, before: int | None = None) -> list[int]:
    """The latest occurrence, ending before position `before` (default: the last), of the
    longest suffix found."""
    last = len(tokens) - 1 if before is None else before
    for n in range(min(ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for end in range(last - 1, n - 2, -1):                  # latest earlier occurrence
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_the_index_finds_what_a_search_finds_as_tokens_arrive(seed):
    """Whole, or indexed a few positions a draft (INDEX_BUDGET's catching up): the search then
    covers the positions indexed so far."""
    rng = random.Random(seed)
    ngram, k = rng.choice([1, 2, 3, 4]), rng.choice([1, 3, 5])
    budget = None if seed % 2 else rng.choice([1, 3])
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
    index = NgramIndex(ngram)
    for _ in range(60):
        got = index.draft(lambda a, b: tokens[a:b], len(tokens), k, budget)
        assert index.done <= len(tokens) - 1
        assert got == brute_draft(tokens, ngram, k, index.done), (tokens, got)
        tokens += [rng.randrange(6) for _ in range(rng.choice([1, 1, 2, 4]))]


# -- whole runs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_tokens_are_the_one_token_steps_tokens(hf_checkpoint, family):
    path, hf = hf_checkpoint(family)
    params = [greedy(24)] * len(PROMPTS)
    plain, _, base = run(path, PROMPTS, params)
    spec, reasons, stats = run(path, PROMPTS, params, speculative_tokens=4)
    assert spec == plain and reasons == ["length"] * 3
    assert spec == [hf_greedy(hf, p, 24)[0] for p in PROMPTS]
    assert stats["speculative_draft_tokens"] > 0 and base["speculative_draft_tokens"] == 0
    assert stats["speculative_accepted_tokens"] > 0


@pytest.mark.parametrize("family,layout", [("llama", Layout(kvp=2)),
                                           ("llama", Layout(kvp=2, tpa=2, kv_interleave=4)),
                                           ("deepseek_v3", Layout(kvp=2))],
                         ids=["llama-kvp2", "llama-kvp2-tpa2-I4", "mla-kvp2"])
def test_kvp_ranks_verify_the_same_guesses(hf_checkpoint, family, layout):
    """Chunks of guesses attended over KVP shards (pass-KV / pass-Q as a prompt chunk is) and
    rejected guesses' positions dropped on every rank."""
    path, _ = hf_checkpoint(family)
    params = [greedy(20)] * len(PROMPTS)
    plain, _, _ = run(path, PROMPTS, params, layout)
    spec, _, stats = run(path, PROMPTS, params, layout, speculative_tokens=3)
    assert spec == plain and stats["speculative_accepted_tokens"] > 0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_an_fp8_cache_speculates_as_it_decodes(hf_checkpoint, family):
    """Guesses written into an fp8 KV cache (rounded as any token's KV) and truncated when
    rejected: the tokens of one-token steps over the same cache, on the Triton kernels."""
    path, _ = hf_checkpoint(family)
    params = [greedy(10)] * len(PROMPTS)
    kw = dict(kv_cache_dtype="fp8", attention_backend="triton",
              device="cuda" if torch.cuda.is_available() else "cpu")
    plain, _, _ = run(path, PROMPTS, params, **kw)
    spec, _, stats = run(path, PROMPTS, params, speculative_tokens=3, **kw)
    assert spec == plain and stats["speculative_draft_tokens"] > 0    # chunks of guesses ran


def test_stop_ids_and_lengths_inside_the_kept_guesses(hf_checkpoint):
    """A stop id or max_new_tokens reached part-way through a step's kept tokens ends the
    request there, as one-token steps end it."""
    path, _ = hf_checkpoint("llama")
    (base,), _, _ = run(path, [LOOP], [greedy(30)])
    for n in (1, 2, 5, 9, 17):
        (a,), (why,), _ = run(path, [LOOP], [greedy(n)], speculative_tokens=6)
        assert a == base[:n] and why == "length"
    for j in (3, 8, 14):
        stop = base[j]
        sp = SamplingParams(max_new_tokens=30, stop_token_ids=[stop], ignore_eos=True)
        (a,), (why,), _ = run(path, [LOOP], [sp])
        (b,), (why_b,), _ = run(path, [LOOP], [sp], speculative_tokens=6)
        assert a == b and why == why_b == "stop" and b[-1] == stop
    (a,), (why,), _ = run(path, [LOOP], [greedy(40)], speculative_tokens=6, max_context=60)
    assert a == base[:60 - len(LOOP)] if len(base) >= 60 - len(LOOP) else True
    assert why == "length" and len(LOOP) + len(a) == 60


def test_penalised_and_biased_requests_speculate_with_the_same_tokens(hf_checkpoint):
    """Repetition / frequency / presence penalties, a logit bias and min_tokens (its stop ids
    held back): each row's processed logits count the guesses before it as output. Checked
    with an oracle that guesses the run's own tokens: every guess must be kept (a row that
    miscounted would choose otherwise), and the tokens are those of one-token steps; then
    with n-gram guesses among other requests."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from profiling.bench_speculative import Oracle
    path, _ = hf_checkpoint("qwen3")
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, ignore_eos=True,
                             frequency_penalty=0.6),
              greedy(20, repetition_penalty=1.3, presence_penalty=0.4),
              greedy(20, logit_bias={5: 2.0, 57: -1.5}, frequency_penalty=0.2),
              SamplingParams(max_new_tokens=20, min_tokens=7, stop_token_ids=[40, 64])]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[1]]
    for p, sp in zip(prompts, params):
        (want,), _, _ = run(path, [p], [sp])
        rt = RuntimeConfig(**{**SMALL, "max_prefill_tokens": 16}, speculative_tokens=4)
        with LLM(path, Layout(), rt) as llm:
            llm.engine.scheduler.drafter = Oracle([want], 4, [p])
            (got,) = llm.generate([p], sp)
            stats = llm.stats()
        assert got == want
        assert stats["speculative_accepted_tokens"] == stats["speculative_draft_tokens"] > 4
        if sp.min_tokens:                 # its stop id is first allowed inside a step
            assert len(want) == 8 and want[-1] == 64
    prompts, params = prompts + [PROMPTS[2]], params + [greedy(20)]
    plain, _, _ = run(path, prompts, params)
    spec, _, stats = run(path, prompts, params, speculative_tokens=4)
    assert spec == plain and stats["speculative_accepted_tokens"] > 0


def test_logprobs_come_with_every_kept_token(hf_checkpoint):
    """A logprobs request speculates: each token's log-probability and alternatives are the
    ones its one-token steps give (rows of the same logits), in the LLM and in streams."""
    from helix.serving.stream import stream
    path, _ = hf_checkpoint("qwen3")
    got = {}
    for k in (0, 4):
        rt = RuntimeConfig(**SMALL, speculative_tokens=k)
        with LLM(path, Layout(), rt) as llm:
            rid = llm.add_request(PROMPTS[1], greedy(20, logprobs=3))
            deltas = list(stream(llm, [rid]))
            got[k] = (llm.outputs[rid], llm.logprobs[rid],
                      [lp for d in deltas for lp in d.logprobs],
                      llm.stats()["speculative_accepted_tokens"])
    (tok0, lp0, s0, _), (tok4, lp4, s4, kept) = got[0], got[4]
    assert tok4 == tok0 and kept > 0 and len(lp4) == len(s4) == 20
    for a, b in zip(lp4 + s4, lp0 + s0):
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("layout", [Layout(), Layout(kvp=2)], ids=["kvp1", "kvp2"])
def test_sampled_requests_speculate_with_the_same_draws(hf_checkpoint, layout):
    """A row's draw is a function of its logits, the seed and the position: with guesses
    verified against the draws, sampled requests (temperature, top-k, top-p) give the tokens of
    one-token steps, and keep guesses."""
    path, _ = hf_checkpoint("qwen3")
    params = [SamplingParams(max_new_tokens=24, temperature=t, top_k=k, top_p=p, seed=s,
                             ignore_eos=True)
              for t, k, p, s in ((0.7, 0, 1.0, 1), (1.0, 20, 0.9, 2), (0.3, 5, 1.0, 3))]
    plain, _, _ = run(path, PROMPTS, params, layout)
    spec, _, stats = run(path, PROMPTS, params, layout, speculative_tokens=4)
    assert spec == plain and stats["speculative_accepted_tokens"] > 0


def test_a_tight_pool_and_the_prefix_cache_keep_the_tokens(hf_checkpoint):
    """Preemption while guesses hold pages, and conversations whose turns hit the prefix cache
    (blocks of kept tokens only are registered)."""
    path, _ = hf_checkpoint("llama")
    prompts = PROMPTS + [LOOP[:20] + [4, 4, 4], LOOP[5:30]]
    params = [greedy(28)] * len(prompts)
    plain, _, _ = run(path, prompts, params, num_pages=24, prefix_caching=False)
    spec, _, stats = run(path, prompts, params, num_pages=24, speculative_tokens=5)
    assert spec == plain and stats["preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0 and stats["speculative_accepted_tokens"] > 0
    turns = []
    for k in (0, 4):
        with LLM(path, Layout(), RuntimeConfig(**SMALL, speculative_tokens=k)) as llm:
            a = llm.generate([LOOP], greedy(12))[0]
            b = llm.generate([LOOP + a + [3, 8]], greedy(12))[0]
            turns.append((a, b, llm.stats()["prefix_cache_hits"]))
    assert turns[0][:2] == turns[1][:2] and turns[1][2] > 0


def test_rejected_guesses_give_back_their_pages_on_every_step(hf_checkpoint):
    """After each step the scheduler's page count of a running request is what its KV holds:
    the pages of the positions its kept tokens reached (rejected guesses' released at once,
    not when it ends)."""
    path, _ = hf_checkpoint("qwen3")
    rt = RuntimeConfig(**SMALL, speculative_tokens=6, prefix_caching=False)
    with LLM(path, Layout(), rt) as llm:
        for p in PROMPTS:
            llm.add_request(p, greedy(30))
        eng, checked = llm.engine, 0
        while llm.has_unfinished():
            llm.step()
            for r in eng.scheduler.running:
                if r.id in eng.kv.lengths and not r.prefilling:
                    assert eng.kv.lengths[r.id] == r.computed == r.num_tokens - 1
                    assert eng.scheduler.pages[r.id] == len(eng.kv.pages[r.id]) \
                        == eng.scheduler.pages_for(r.computed)
                    checked += 1
        assert checked > 20 and llm.stats()["speculative_accepted_tokens"] > 0


def test_a_prompt_that_fails_its_step_fails_alone(hf_checkpoint):
    """A long prompt joins a step where a request verifies guesses, and the step fails (out of
    memory): the prompt's request ends with "error", the speculating one is run again in the
    retry and keeps its tokens."""
    path, _ = hf_checkpoint("qwen3")
    (want,), _, _ = run(path, [PROMPTS[1]], [greedy(24)])
    with LLM(path, Layout(), RuntimeConfig(**SMALL, speculative_tokens=4)) as llm:
        real = llm.engine.model.hidden

        def hidden(ids, *args, **kw):
            if ids.shape[0] > 40:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32 GiB")
            return real(ids, *args, **kw)
        llm.engine.model.hidden = hidden
        a = llm.add_request(PROMPTS[1], greedy(24))
        for _ in range(3):
            llm.step()
        drafted = llm.stats()["speculative_draft_tokens"]
        b = llm.add_request(list(range(1, 60)), greedy(4))
        out = llm.step()
        assert out.finished == {b: "error"} and "Tried to allocate" in out.errors[b]
        assert a in out.tokens and llm.stats()["speculative_draft_tokens"] > drafted
        while llm.has_unfinished():
            llm.step()
        assert llm.outputs[a] == want and llm.finish_reasons[a] == "length"
        assert llm.engine.kv_pages_free() == llm.engine.num_pages


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_workload_gives_the_same_tokens(hf_checkpoint, seed):
    """Requests from shared stems joining at random steps, some aborted, in a 16-page pool with
    the prefix cache (test_prefix_cache's workload): every request aborted in neither run (a
    run with fewer steps draws fewer aborts) ends as it does without speculation, and the pool
    comes back whole (checked inside)."""
    from test_prefix_cache import _random_workload
    path, _ = hf_checkpoint("qwen3")
    plain, _ = _random_workload(path, seed)
    spec, stats = _random_workload(path, seed, speculative_tokens=3)
    kept = [i for i in plain if "aborted" not in (plain[i], spec[i])]
    assert len(kept) >= 8 and all(spec[i] == plain[i] for i in kept)
    assert stats["speculative_draft_tokens"] > 0


def test_streams_carry_every_kept_token(hf_checkpoint):
    from helix.serving.stream import stream
    path, _ = hf_checkpoint("qwen3")
    rt = RuntimeConfig(**SMALL, speculative_tokens=4)
    with LLM(path, Layout(), rt) as llm:
        rid = llm.add_request(PROMPTS[1], greedy(20))
        got = [t for d in stream(llm, [rid]) for t in d.token_ids]
        assert got == llm.outputs[rid] and len(got) == 20
        assert llm.stats()["engine_steps"] < 20


def test_the_server_engine_sends_every_kept_token(hf_checkpoint):
    """AsyncLLM (the engine process a server runs): several tokens of one request in one step
    arrive in order, the same as the LLM's own run."""
    import asyncio

    from helix.serving.async_engine import AsyncLLM
    path, _ = hf_checkpoint("qwen3")
    rt = RuntimeConfig(**SMALL, speculative_tokens=4)
    params = [greedy(20), greedy(20, logprobs=2), greedy(20)]
    want, _, _ = run(path, PROMPTS, params)
    engine = AsyncLLM(path, Layout(), rt, warmup=False)
    try:
        async def main():
            streams = [await engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
            return [await s.result() for s in streams], await engine.stats()
        got, stats = asyncio.run(main())
        assert [g.token_ids for g in got] == want and stats["speculative_accepted_tokens"] > 0
        assert len(got[1].logprobs) == 20 and got[0].logprobs is None
    finally:
        engine.close()


def test_bench_speculative_brackets_what_verification_gives(tmp_path):
    """profiling/bench_speculative.py (CPU smoke): an oracle's guesses, all kept, emit k + 1
    tokens a step; all rejected, one; both with the one-token steps' tokens (checked inside)."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from profiling import bench_speculative
    out = tmp_path / "spec.json"
    assert bench_speculative.main(["--model", "tiny-llama", "--batches", "2", "--contexts",
                                   "64", "--k", "3", "--new-tokens", "13", "--device", "cpu",
                                   "--out", str(out)]) == 0
    recs = {r["mode"]: r for r in json.loads(out.read_text())}
    assert recs["base"]["tokens_per_step"] == 2 and recs["base"]["draft_tokens"] == 0
    assert recs["kept"]["tokens_per_step"] == 2 * 4 and recs["kept"]["steps"] == 3
    assert recs["kept"]["accepted_tokens"] == recs["kept"]["draft_tokens"] == 2 * 3 * 3
    assert recs["rejected"]["tokens_per_step"] == 2 and recs["rejected"]["accepted_tokens"] == 0
    assert all(r["tokens_match"] == 1.0 for r in recs.values())          # fp32: exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_captured_steps_verify_as_eager_steps_do(model):
    """On CUDA (fp32): chunks of guesses through the prefill graphs (and eagerly) give the
    tokens of one-token steps under decode graphs; an oracle's guesses, all kept, emit k + 1
    tokens a step."""
    from profiling.bench_speculative import Oracle
    prompts = [LOOP * 3, [7, 9, 7, 9, 7, 9, 4] * 5]
    runs = []
    for k, graphs in ((0, True), (4, True), (4, False), (4, "oracle")):
        rt = RuntimeConfig(device="cuda", dtype="float32", page_size=16, max_batch=4,
                           max_context=512, num_pages=64, graph_buckets=(1, 2, 4),
                           speculative_tokens=k, cuda_graphs=graphs is not False)
        with LLM(model, Layout(), rt) as llm:
            if graphs == "oracle":
                llm.engine.scheduler.drafter = Oracle(runs[0], 4, prompts)
            runs.append(llm.generate(prompts, greedy(40)))
            steps = llm.stats()["engine_steps"]
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert steps <= 1 + -(-40 // 5) + 1


def test_generate_takes_the_flags(hf_checkpoint, capsys):
    import json

    from helix.cli import main
    path, _ = hf_checkpoint("qwen3")
    outs = []
    for flags in ([], ["--speculative-tokens", "4", "--speculative-ngram", "2"]):
        assert main(["generate", "--model", path, "--prompt-ids", "7,9,7,9,7,9,4",
                     "--max-new-tokens", "20", "--ignore-eos", "--json", *flags]) == 0
        outs.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    assert outs[0]["tokens"] == outs[1]["tokens"]
    assert len(outs[1]["step_ms"]) < len(outs[0]["step_ms"])       # fewer steps
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", path, "--prompt-ids", "5", "--speculative-tokens", "x"])
    assert e.value.code == 2


def test_bad_settings_are_config_errors():
    from helix.errors import ConfigError
    with pytest.raises(ConfigError, match="speculative_tokens must be an integer >= 0"):
        RuntimeConfig(speculative_tokens=-1)
    with pytest.raises(ConfigError, match="speculative_ngram must be an integer >= 1"):
        RuntimeConfig(speculative_ngram=0)
    assert not RuntimeConfig(device="cuda", speculative_tokens=2).resolved_overlap
