"""The decode step through per-bucket graphs (on CPU the runner executes the same path eagerly):
same tokens and bitwise-equal logits as the plain eager step, padding that never touches real KV,
break order, static buffers that never move, and eager steps above the largest bucket."""

from __future__ import annotations

import pytest
import torch

from helix.graphs import Break, Segment
from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.kv.ownership import kv_owner, local_index

PROMPTS = [[5, 17, 42, 3], [7, 8], [11, 12, 13, 14, 15, 16, 17], [99, 98, 97], [1]]


def _run(model, n_requests, steps=6, **rt):
    """Per-step logits and final tokens of n_requests run together; KV caches at the end."""
    runtime = RuntimeConfig(page_size=4, max_batch=8, **rt)
    with LLM(model, Layout(), runtime) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=steps, ignore_eos=True))
               for p in PROMPTS[:n_requests]]
        logits = []
        while llm.has_unfinished():
            llm.step()
            logits.append(llm.engine.last_logits.clone())
        caches = [[t.clone() for t in layer] for layer in llm.engine.caches]
        return [llm.outputs[i] for i in ids], logits, caches


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_graph_path_matches_eager_bitwise_when_the_batch_fills_the_bucket(model):
    eager = _run(model, 4, cuda_graphs=False)
    graphed = _run(model, 4, cuda_graphs=True, graph_buckets=(1, 2, 4, 8))
    assert graphed[0] == eager[0]
    for a, b in zip(graphed[1], eager[1]):
        assert torch.equal(a, b)
    for la, lb in zip(graphed[2], eager[2]):
        for a, b in zip(la, lb):
            assert torch.equal(a, b)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_padded_bucket_gives_the_same_tokens(model):
    # 3 requests in bucket 4: a padded row changes the GEMM shapes, so logits agree to
    # rounding (CPU BLAS blocks M=3 and M=4 differently), tokens exactly
    eager = _run(model, 3, cuda_graphs=False)
    graphed = _run(model, 3, cuda_graphs=True, graph_buckets=(1, 2, 4, 8))
    assert graphed[0] == eager[0]
    for a, b in zip(graphed[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kvp", [1, 2])
def test_padded_rows_leave_every_other_kv_page_bit_identical(kvp):
    runtime = RuntimeConfig(page_size=4, max_batch=8, graph_buckets=(4, 8))
    with LLM("tiny-llama", Layout(kvp=kvp), runtime) as llm:
        engine = llm.engine
        for p in PROMPTS[:3]:
            llm.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
        llm.step()                                        # prefill (eager)
        before = [[t.clone() for t in layer] for layer in engine.caches]
        lengths = dict(engine.kv.lengths)
        llm.step()                                        # decode: 3 rows padded to bucket 4
        assert engine.graphs.runner.last_bucket == 4
        # the slots this step wrote on rank 0: the owned positions of the 3 real rows
        written = set()
        for seq, n in lengths.items():
            if kv_owner(n, kvp, 1) == engine.kv.kvp_rank:
                j = local_index(n, kvp, 1)
                page = engine.kv.pages[seq][j // 4]
                written.add(page * 4 + j % 4)
        for lb, la in zip(before, engine.caches):
            for b, a in zip(lb, la):
                flat_b, flat_a = b.view(-1, *b.shape[2:]), a.view(-1, *a.shape[2:])
                changed = {int(i) for i in torch.nonzero((flat_a != flat_b).flatten(1).any(-1))}
                assert changed <= written and changed   # only real rows wrote, and they did


def test_breaks_run_in_program_order_and_buffers_never_move():
    runtime = RuntimeConfig(page_size=4, max_batch=4, graph_buckets=(1, 2, 4),
                            graph_breaks=("attention",))
    with LLM("tiny-qwen3-moe", Layout(), runtime) as llm:
        graphs = llm.engine.graphs
        assert graphs.needed_breaks == {"attention", "moe"}   # moe: experts ask the host
        plan = graphs.runner.plan(4)
        names = [s.name for s in plan if isinstance(s, Break)]
        layers = llm.cfg.num_layers
        assert names == ["attention", "moe"] * layers
        # segments and breaks alternate: embedding ... attention | o_proj, router ... moe | ...
        assert all(isinstance(a, Segment) != isinstance(b, Segment) for a, b in zip(plan, plan[1:]))
        ptrs = graphs.runner.buffers.data_ptrs()
        for p in PROMPTS[:3]:
            llm.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
        buckets = []
        while llm.has_unfinished():
            llm.step()
            buckets.append(graphs.runner.last_bucket)
        assert graphs.runner.buffers.data_ptrs() == ptrs
        assert 4 in buckets                       # 3 requests decode in bucket 4 (one padded row)


def test_batch_above_largest_bucket_runs_eagerly():
    eager = _run("tiny-llama", 5, steps=4, cuda_graphs=False)
    graphed = _run("tiny-llama", 5, steps=4, cuda_graphs=True, graph_buckets=(1, 2))
    assert graphed[0] == eager[0]
    runtime = RuntimeConfig(page_size=4, max_batch=8, graph_buckets=(1, 2))
    with LLM("tiny-llama", Layout(), runtime) as llm:
        for p in PROMPTS[:3]:
            llm.add_request(p, SamplingParams(max_new_tokens=3, ignore_eos=True))
        graphed_steps = []
        while llm.has_unfinished():
            llm.step()
            graphed_steps.append(llm.engine.last_graphed)
    assert graphed_steps == [False, False, False]      # prefill, then 3 rows > bucket 2
