"""Shared fixtures: tiny random Hugging Face checkpoints (tests/hf_fixtures.py), built once per
session."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/hf_fixtures.py

# Under pytest-xdist (the README's command: one worker a core) each worker takes one thread
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# Modules that share the layout matrix's multi-process runs (parallel_helpers.cached_run, one
# run per case per process): one xdist worker runs them all, so each case runs once
SHARED_RUNS = ("test_parallel_layouts.py", "test_kv_accounting.py", "test_context_parallel.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SHARED_RUNS:
            item.add_marker(pytest.mark.xdist_group("layout_runs"))


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf_ckpts"))


@pytest.fixture(scope="session")
def hf_checkpoint(ckpt_root):
    """hf_checkpoint(family, **kw) -> (checkpoint dir, fp32 HF model); built once per session per
    (family, kw). kw: seed, dtype, max_shard_size, tag, and config overrides (see hf_fixtures)."""
    import hf_fixtures
    cache: dict = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            tag = kw.pop("tag", "") or (f"-{len(cache)}" if kw else "")
            cache[key] = hf_fixtures.make_checkpoint(ckpt_root, family, tag=tag, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llama_ckpt(hf_checkpoint) -> str:
    """The workhorse checkpoint of the runtime and CLI tests (tiny Llama, llama3 RoPE)."""
    return hf_checkpoint("llama")[0]
