"""Overlapped steps (RuntimeConfig.overlap): the host prepares step N + 1 while the device runs
step N, the next step's input ids are gathered on the device from the previous step's sampled
tokens, and tokens are read back one call later. On CPU the same code runs synchronously, so
these tests check the bookkeeping: identical tokens and finish reasons with and without overlap
(greedy, seeded sampling, forced tokens, stop ids, aborts, requests joining), the one-call lag,
and that no step is run past a request's length."""

from __future__ import annotations

import pytest

from helix import LLM, Layout, RuntimeConfig, SamplingParams

PROMPTS = [[5, 17, 42, 3], [7, 8], [11, 12, 13, 14, 15, 16, 17], [99, 98, 97]]


def _params(n, **kw):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def _scenario(llm: LLM, stop_id: int | None = None) -> dict:
    """Mixed lengths, one sampled and one forced request, a join and an abort mid-run."""
    ids = [llm.add_request(PROMPTS[0], _params(9)),
           llm.add_request(PROMPTS[1], _params(5, temperature=0.8, top_k=20, seed=3)),
           llm.add_request(PROMPTS[2], _params(7, forced_tokens=(4, 4, 9))),
           llm.add_request(PROMPTS[3], _params(12, stop_token_ids=(stop_id,) if stop_id else ()))]
    calls = 0
    while llm.has_unfinished():
        if calls == 3:
            ids.append(llm.add_request([21, 22, 23], _params(6)))
        if calls == 4:
            ids.append(llm.add_request([31, 32], _params(10)))
        if calls == 6:
            llm.abort(ids[-1])
        llm.step()
        calls += 1
    return {"tokens": [llm.outputs[i] for i in ids],
            "reasons": [llm.finish_reasons[i] for i in ids], "calls": calls}


def _run(overlap: bool, layout: Layout | None = None, stop_id: int | None = None, **rt) -> dict:
    runtime = RuntimeConfig(page_size=4, max_batch=8, overlap=overlap, **rt)
    with LLM("tiny-llama", layout or Layout(), runtime) as llm:
        return _scenario(llm, stop_id)


@pytest.mark.parametrize("graphs", [True, False])
def test_overlap_gives_the_same_tokens_and_finish_reasons(graphs):
    rt = dict(cuda_graphs=graphs, graph_buckets=(1, 2, 4, 8))
    plain = _run(False, **rt)
    # a stop id that fires mid-run for request 3 (its first token not seen before index 3)
    toks = plain["tokens"][3]
    k = next(k for k in range(3, len(toks)) if toks[k] not in toks[:k])
    plain = _run(False, stop_id=toks[k], **rt)
    over = _run(True, stop_id=toks[k], **rt)
    assert plain["reasons"][3] == "stop" and len(plain["tokens"][3]) == k + 1
    assert plain["tokens"][2][:3] == [4, 4, 9]
    assert "abort" in plain["reasons"]
    assert over["reasons"] == plain["reasons"]
    # an abort drops what is not read back yet: with overlap the last token is still pending
    assert over["tokens"][:-1] == plain["tokens"][:-1]
    assert over["tokens"][-1] == plain["tokens"][-1][:len(over["tokens"][-1])]


def test_overlap_reports_each_token_one_call_later():
    def steps(overlap):
        rt = RuntimeConfig(page_size=4, max_batch=8, overlap=overlap)
        with LLM("tiny-llama", Layout(), rt) as llm:
            rid = llm.add_request(PROMPTS[0], _params(4))
            outs = []
            while llm.has_unfinished():
                outs.append(llm.step())
            return [o.tokens.get(rid) for o in outs], [o.finished for o in outs], \
                [o.num_tokens for o in outs]
    toks, fin, fed = steps(False)
    otoks, ofin, ofed = steps(True)
    assert None not in toks and len(toks) == 4
    assert otoks == [None] + toks                   # the same tokens, one call later
    assert ofin[-1] == fin[-1] == {0: "length"}
    assert ofed == fed + [0]                        # the last call only reads back: no 5th row


def test_overlap_with_two_kvp_ranks_matches_one_rank():
    one = _run(False)
    two = _run(True, layout=Layout(kvp=2), dtype="float32")
    assert two["tokens"][:-1] == one["tokens"][:-1]     # the last one is aborted (see above)
    assert two["reasons"] == one["reasons"]


def test_sampled_tokens_do_not_depend_on_graphs_overlap_or_batch():
    """Sampling noise is keyed by (seed, position): the graph sampler, the eager one, overlap
    and the batch a request shares all give a seeded request the same tokens."""
    p = _params(12, temperature=1.5, top_p=0.95, seed=42)

    def run(graphs, overlap, others):
        rt = RuntimeConfig(page_size=4, max_batch=8, overlap=overlap, cuda_graphs=graphs,
                           graph_buckets=(1, 2, 4, 8))
        with LLM("tiny-llama", Layout(), rt) as llm:
            rid = llm.add_request(PROMPTS[0], p)
            for q in PROMPTS[1:1 + others]:
                llm.add_request(q, _params(5, temperature=0.9, seed=1))
            while llm.has_unfinished():
                llm.step()
            return llm.outputs[rid]

    alone = run(False, False, 0)
    assert len(set(alone)) > 3                       # really sampled, not a constant
    assert run(True, True, 3) == alone
    assert run(True, False, 2) == alone
    assert run(False, True, 1) == alone
