"""Steps with prompt chunks through per-bucket prefill graphs (helix/runtime/prefill_graphs.py; on
CPU the runners execute the same path eagerly, so this covers buckets, padding and buffers): the
same tokens as eager steps, logits bitwise equal when a step fills its bucket (close when padded:
CPU BLAS blocks other row counts differently), padding rows that write no KV, the attention break
in program order, static buffers that never move, steps past the largest bucket eager; over KVP
ranks (gloo), pass-KV and pass-Q steps in their graph families, every rank replaying the bucket
of the rank that projects most, equal to the single-rank eager run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.graphs import Break, Segment, token_buckets
from helix.kv.ownership import local_len
from helix.runtime.prefill_graphs import LOCAL, PASS_KV

# a 16-token first step (fills bucket 16); joiners: 4 decode rows + 15 tokens (past the largest
# bucket: eager), then 5 decode rows + 9 tokens (padded to 16)
RT = RuntimeConfig(page_size=4, max_batch=8, max_prefill_tokens=16, prefill_graph_buckets=(16,))
LENGTHS, JOINERS = (4, 2, 7, 3), {1: 15, 2: 9}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 60, (n,), generator=g).tolist() for n in lengths]


def _run(model, layout=Layout(), runtime=RT, lengths=LENGTHS, joiners=JOINERS, new=3):
    """Per step: logits, whether it replayed a graph, the prefill graph it replayed (None: a
    decode graph or eager); the tokens of every request; prompt tokens projected per rank."""
    prompts = _prompts(lengths + tuple(joiners.values()))
    out = dict(logits=[], graphed=[], keys=[])
    with LLM(model, layout, runtime) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
               for p in prompts[:len(lengths)]]
        joining = iter(prompts[len(lengths):])
        step = 0
        while llm.has_unfinished():
            if step in joiners:
                ids.append(llm.add_request(next(joining), SamplingParams(max_new_tokens=new,
                                                                          ignore_eos=True)))
            eng = llm.engine
            if eng.prefill_graphs:
                eng.prefill_graphs.last_key = None
            llm.step()
            out["logits"].append(eng.last_logits.clone())
            out["graphed"].append(eng.last_graphed)
            out["keys"].append(eng.prefill_graphs.last_key if eng.prefill_graphs else None)
            step += 1
        out["tokens"] = [llm.outputs[i] for i in ids]
        out["projected"] = llm.prefill_tokens_per_rank()
    return out


def test_token_buckets_double_then_step_by_an_eighth_of_an_octave():
    b = token_buckets(8256)
    assert b[:6] == (16, 32, 64, 128, 256, 288) and b[-2:] == (8192, 8256)
    assert all(hi - lo <= lo // 8 for lo, hi in zip(b, b[1:]) if lo >= 256)  # padding <= 12.5 %
    assert token_buckets(24) == (16, 24) and token_buckets(8) == (8,)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_prefill_graphs_match_eager_steps(model):
    eager = _run(model, runtime=dataclasses.replace(RT, prefill_graphs=False))
    graphed = _run(model, runtime=dataclasses.replace(RT, prefill_graphs=True))
    assert graphed["tokens"] == eager["tokens"]
    assert torch.equal(graphed["logits"][0], eager["logits"][0])      # 16 tokens in bucket 16
    for a, b in zip(graphed["logits"], eager["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # step 0 prefills 16 tokens, step 1 holds 19 (eager), step 2 14 (padded to 16), then decode
    # graphs
    assert graphed["graphed"][:4] == [True, False, True, True]
    assert graphed["keys"][:4] == [(LOCAL, 16), None, (LOCAL, 16), None]


def test_padding_rows_write_no_kv():
    runtime = dataclasses.replace(RT, prefill_graphs=True)
    with LLM("tiny-llama", Layout(), runtime) as llm:
        engine = llm.engine
        before = [[t.clone() for t in layer] for layer in engine.caches]
        for p in _prompts((3, 2)):
            llm.add_request(p, SamplingParams(max_new_tokens=2, ignore_eos=True))
        llm.step()                                        # 5 tokens in bucket 16
        assert engine.last_graphed and engine.prefill_graphs.last_key == (LOCAL, 16)
        real = {engine.kv.pages[seq][j // 4] * 4 + j % 4        # the prompts' slots
                for seq, n in engine.kv.lengths.items() for j in range(n)}
        for lb, la in zip(before, engine.caches):
            for b, a in zip(lb, la):
                flat_b, flat_a = b.view(-1, *b.shape[2:]), a.view(-1, *a.shape[2:])
                changed = {int(i) for i in torch.nonzero((flat_a != flat_b).flatten(1).any(-1))}
                assert changed == real        # every real token wrote, no padding row did


def test_attention_break_in_program_order_and_buffers_never_move():
    runtime = dataclasses.replace(RT, prefill_graphs=True)
    with LLM("tiny-qwen3-moe", Layout(), runtime) as llm:
        graphs = llm.engine.prefill_graphs
        assert graphs.needed_breaks == {"attention", "moe"}   # moe: experts ask the host
        plan = graphs.runners[LOCAL].plan(16)
        assert [s.name for s in plan if isinstance(s, Break)] == ["attention", "moe"] * (
            llm.cfg.num_layers)
        assert all(isinstance(a, Segment) != isinstance(b, Segment) for a, b in zip(plan, plan[1:]))
        ptrs = graphs.bufs.data_ptrs()
        for p in _prompts((5, 9)):
            llm.add_request(p, SamplingParams(max_new_tokens=2, ignore_eos=True))
        while llm.has_unfinished():
            llm.step()
        assert graphs.bufs.data_ptrs() == ptrs and graphs.last_key == (LOCAL, 16)


# over KVP ranks: prompts shorter than kvp x interleave (empty shards), one in three chunks, a
# joiner prefilled next to decode rows; max_prefill 16 + max_batch 8: buckets 16, 24
MULTI = RuntimeConfig(page_size=4, max_batch=8, max_prefill_tokens=16, prefill_graphs=True)
MULTI_LENGTHS, MULTI_JOINERS = (1, 2, 5, 40), {3: 13}


def _reference(model):
    return _run(model, runtime=dataclasses.replace(MULTI, prefill_graphs=False),
                lengths=MULTI_LENGTHS, joiners=MULTI_JOINERS)


def _assert_close_run(got, ref):
    assert got["tokens"] == ref["tokens"]
    for a, b in zip(got["logits"], ref["logits"]):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-4


def test_kvp2_auto_replays_pass_kv_and_pass_q_graphs():
    """The 40-token prompt's last chunk (16 new tokens after 24 cached) passes Q, the others
    KV; the joiner's first chunk, next to a decode row, passes KV."""
    got = _run("tiny-llama", Layout(kvp=2, kv_interleave=4), MULTI, MULTI_LENGTHS,
               MULTI_JOINERS)
    _assert_close_run(got, _reference("tiny-llama"))
    assert got["keys"][:4] == [(PASS_KV, 16), (PASS_KV, 16), (LOCAL, 24), (PASS_KV, 16)]


def test_kvp2_ring_pass_kv_graphs_mla():
    runtime = dataclasses.replace(MULTI, prefill_cp="pass-kv", cp_gather_mb=0)
    layout = Layout(kvp=2, kv_interleave=1)
    got = _run("tiny-deepseek-v3", layout, runtime, MULTI_LENGTHS, MULTI_JOINERS)
    _assert_close_run(got, _reference("tiny-deepseek-v3"))
    assert all(k is None or k[0] == PASS_KV for k in got["keys"])
    lens = MULTI_LENGTHS + tuple(MULTI_JOINERS.values())
    assert got["projected"] == [sum(local_len(n, k, 2, 1) for n in lens) for k in range(2)]
