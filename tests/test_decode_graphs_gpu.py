"""On GPUs: the captured decode step gives the same tokens and bitwise-equal logits as the same
bucketed step run eagerly (graph_eager), on 1 and 2 ranks, with and without an eager break, for
batches that fill their bucket (4 in bucket 4) and batches that need padding (3 in bucket 4)."""

from __future__ import annotations

import pytest
import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[5, 17, 42, 3], [7, 8], [11, 12, 13, 14, 15, 16, 17], [99, 98, 97]]
NEW = [8, 8, 8, 4]   # the last request ends early: decode runs 4 rows, then 3 rows in bucket 4


def _run(model, world, breaks, eager):
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", page_size=16, max_batch=4,
                       graph_buckets=(1, 2, 4), graph_breaks=breaks, graph_eager=eager,
                       attention_backend="triton")
    with LLM(model, Layout(kvp=world), rt) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
               for p, n in zip(PROMPTS, NEW)]
        logits, buckets = [], []
        while llm.has_unfinished():
            llm.step()
            logits.append(llm.engine.last_logits.clone())
            buckets.append(llm.engine.graphs.runner.last_bucket)
        return [llm.outputs[i] for i in ids], logits, buckets


@needs_cuda
@pytest.mark.parametrize("breaks", [(), ("attention",)], ids=["whole-step", "attention-break"])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_captured_decode_is_bitwise_equal_to_eager(model, world, breaks):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    graphed = _run(model, world, breaks, eager=False)
    eager = _run(model, world, breaks, eager=True)
    # steps 2..4 decode 4 rows, steps 5..8 decode 3 rows (padded): all replay bucket 4
    assert graphed[2][1:] == [4] * (len(graphed[2]) - 1)
    assert graphed[0] == eager[0]
    for a, b in zip(graphed[1], eager[1]):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_overlapped_steps_give_the_same_tokens(model, world):
    """Overlap (tokens stay on the device, read back one step later) against the synchronous
    path, graphed and eager, with greedy and seeded temperature sampling."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW]
    params[1] = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.7, top_p=0.9,
                               seed=5)

    def run(overlap, graphs):
        rt = RuntimeConfig(device="cuda", dtype="float32", page_size=16, max_batch=4,
                           graph_buckets=(1, 2, 4), cuda_graphs=graphs, overlap=overlap,
                           attention_backend="triton")
        with LLM(model, Layout(kvp=world), rt) as llm:
            return llm.generate(PROMPTS, params)

    want = run(False, False)
    assert run(True, True) == want
    assert run(True, False) == want
