"""Programmatic dependent launch (helix.triton_util): which launches get it, and (on a GPU of
compute capability >= 9) that whole captured decode steps with it give bitwise the logits
without it."""

from __future__ import annotations

import pytest
import torch
from triton_mode import ON_GPU  # first: chooses the interpreter before triton loads

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix import triton_util  # noqa: E402
from helix.attention import triton_splits  # noqa: E402
from helix.layers import fused_ops  # noqa: E402

needs_sm90 = pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9,
                                reason="PDL needs a GPU of compute capability >= 9")


class _Kernel:
    """Stands in for a JIT kernel: records the launch options run_kernel passes."""

    def __init__(self, fn):
        self.fn, self.meta = fn, None

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.meta = meta
        return launch


def _with_pdl(x, PDL=False):
    pass


def _without_pdl(x, BLOCK=16):
    pass


def test_run_kernel_adds_pdl_only_to_kernels_that_take_it(monkeypatch):
    cpu = torch.zeros(1)
    k = _Kernel(_with_pdl)
    triton_util.run_kernel(k, (1,), cpu)
    assert k.meta == {"PDL": False}                  # off CUDA: an ordinary launch
    monkeypatch.setattr(triton_util, "pdl_enabled", lambda device: True)
    triton_util.run_kernel(k, (1,), cpu, BLOCK=4)
    assert k.meta == {"BLOCK": 4, "PDL": True, "launch_pdl": True}
    triton_util.run_kernel(k, (1,), cpu, PDL=False)  # an explicit choice wins
    assert k.meta == {"PDL": False}
    plain = _Kernel(_without_pdl)
    triton_util.run_kernel(plain, (1,), cpu, BLOCK=4)
    assert plain.meta == {"BLOCK": 4}                # no wait in its code: never PDL


def test_pdl_enabled_needs_cuda_and_the_switch(monkeypatch):
    assert not triton_util.pdl_enabled(torch.device("cpu"))
    assert not triton_util.pdl_enabled(None)
    monkeypatch.setattr(triton_util, "PDL", False)
    assert not triton_util.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setattr(triton_util, "PDL", True)
    monkeypatch.setattr(triton_util, "_INTERPRETED", True)
    assert not triton_util.pdl_enabled(torch.device("cuda", 0))   # the interpreter: never


def test_decode_step_kernels_take_pdl():
    """The kernels of a decode step opt in (a wait before their first access)."""
    from helix.attention import triton_append, triton_mla_few
    from helix.layers import fused_mla, moe_decode, skinny_gemm, triton_router
    for k in (fused_ops._rms_norm_kernel, fused_mla._kv_row_kernel, skinny_gemm._skinny_kernel,
              triton_append._append_kernel, triton_mla_few._mla_few_kernel,
              triton_splits._reduce_splits_kernel, triton_router._route_fused_kernel,
              moe_decode._gate_up_kernel, moe_decode._down_kernel):
        assert triton_util._takes_pdl(k), k


def _decode(model, pdl):
    triton_util.PDL = pdl
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", page_size=16, max_batch=4,
                       graph_buckets=(1, 2, 4), attention_backend="triton")
    with LLM(model, Layout(), rt) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True))
               for p in ([5, 17, 42, 3], [7, 8], [11, 12, 13])]
        logits = []
        while llm.has_unfinished():
            llm.step()
            logits.append(llm.engine.last_logits.clone())
        return [llm.outputs[i] for i in ids], logits


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_captured_steps_with_pdl_equal_steps_without(model, monkeypatch):
    monkeypatch.setattr(triton_util, "PDL", True)
    assert triton_util.pdl_enabled(torch.device("cuda"))     # the launches below do use PDL
    off_tokens, off_logits = _decode(model, False)
    on_tokens, on_logits = _decode(model, True)
    assert on_tokens == off_tokens
    assert len(on_logits) == len(off_logits)
    for a, b in zip(on_logits, off_logits):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_sm90
def test_pdl_chain_of_norms_equals_plain_launches(monkeypatch):
    """A captured chain of 200 dependent norm launches: bitwise the result without PDL."""
    assert triton_util.pdl_enabled(torch.device("cuda"))
    x0 = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    outs = []
    for pdl in (False, True):
        monkeypatch.setattr(triton_util, "PDL", pdl)
        y = x0
        for _ in range(2):                                 # compile outside the capture
            fused_ops.rms_norm(y, w, 1e-6)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x0
            for _ in range(200):
                y = fused_ops.rms_norm(y * 1.5, w, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        outs.append(y.clone())
    assert torch.equal(outs[0], outs[1])
