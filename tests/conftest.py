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

# Modules that share multi-process runs (parallel_helpers.cached_run: one run per case per
# process) run on one xdist worker each group, so each case runs once: the layout matrix's
# modules, and the context-parallel module (its own cases and references)
SHARED_RUNS = {"test_parallel_layouts.py": "layout_runs", "test_kv_accounting.py": "layout_runs",
               "test_context_parallel.py": "cp_runs"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = SHARED_RUNS.get(item.path.name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


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
