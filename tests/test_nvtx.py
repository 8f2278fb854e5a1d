"""NVTX ranges: the `nvtx` package when installed; a no-op on a machine with neither it nor CUDA."""

from __future__ import annotations

import contextlib
import types

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix import tracing as helix_nvtx


def test_engine_steps_emit_named_ranges(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def annotate(name, domain):
        seen.append((domain, name))
        yield

    monkeypatch.setattr(helix_nvtx, "_nvtx", types.SimpleNamespace(annotate=annotate))
    with LLM("tiny-llama", Layout(), RuntimeConfig(graph_buckets=(1, 2))) as llm:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    names = [n for d, n in seen if d == "helix"]
    assert "helix.forward_eager[5 tokens]" in names          # the prefill step
    assert names.count("helix.decode_graph[2]") == 2          # two decode steps, bucket path
    assert names.count("helix.sample") == 1                   # eager step; graphs sample inside
    assert names.count("helix.readback") == 3


def test_without_nvtx_or_cuda_ranges_are_no_ops(monkeypatch):
    monkeypatch.setattr(helix_nvtx, "_nvtx", None)
    monkeypatch.setattr(helix_nvtx.torch.cuda, "is_available", lambda: False)
    assert isinstance(helix_nvtx.nvtx_range("x"), contextlib.nullcontext)
