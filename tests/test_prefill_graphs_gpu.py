"""On GPUs: steps with prompt chunks replayed from captured prefill graphs give the same tokens and
bitwise-equal logits as the same bucketed steps run eagerly (graph_eager), on one rank and over
two KVP ranks (pass-KV forced, and auto: pass-KV and pass-Q graphs), GQA and MLA, for a first
step padded to its bucket, chunks next to decode rows and a joiner; and the same tokens in fp32
as steps without prefill graphs. Chunks stay under 64 tokens, where MLA prefill runs the
absorbed form whether captured or not (helix/layers/mla_prefill.py)."""

from __future__ import annotations

import pytest
import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LENGTHS = (16, 5, 30, 9)          # 60 tokens: 48 (bucket 52, padded), then 12 + decode rows
JOINER = 21                       # joins at step 3, next to 4 decode rows


def _run(model, world, prefill_cp, dtype="bfloat16", **rt):
    runtime = RuntimeConfig(device="cuda", dtype=dtype, page_size=16, max_batch=5,
                            max_prefill_tokens=48, idle_prefill_tokens=48,
                            attention_backend="triton",
                            prefill_cp=prefill_cp, **rt)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in LENGTHS + (JOINER,)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(model, Layout(kvp=world), runtime) as llm:
        ids = [llm.add_request(p, params) for p in prompts[:-1]]
        logits, keys, step = [], [], 0
        while llm.has_unfinished():
            if step == 3:
                ids.append(llm.add_request(prompts[-1], params))
            llm.step()
            eng = llm.engine
            logits.append(eng.last_logits.clone())
            pg = eng.prefill_graphs
            keys.append(pg.last_key if pg is not None and eng.last_graphed else None)
            step += 1
        replayed = pg is not None and all(r.use_graphs for r in pg.runners.values())
        return [llm.outputs[i] for i in ids], logits, keys, replayed


def _skip_without(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")


@needs_cuda
@pytest.mark.parametrize("world,prefill_cp", [(1, "auto"), (2, "pass-kv"), (2, "auto")])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_captured_prefill_is_bitwise_equal_to_eager(model, world, prefill_cp):
    _skip_without(world)
    graphed = _run(model, world, prefill_cp, graph_eager=False)
    eager = _run(model, world, prefill_cp, graph_eager=True)
    assert graphed[3] and not eager[3]              # captured, and the same path uncaptured
    assert graphed[2] == eager[2] and graphed[2][0] is not None   # the same graphs, step 0 one
    assert graphed[0] == eager[0]
    for a, b in zip(graphed[1], eager[1]):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_prefill_graphs_give_the_tokens_of_eager_prefill(model, world):
    _skip_without(world)
    with_graphs = _run(model, world, "auto", dtype="float32", prefill_graphs=True)
    without = _run(model, world, "auto", dtype="float32", prefill_graphs=False)
    assert with_graphs[0] == without[0]
    for a, b in zip(with_graphs[1], without[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
