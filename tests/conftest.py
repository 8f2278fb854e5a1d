"""Shared fixtures: tiny random Hugging Face checkpoints (tests/hf_fixtures.py), built once per
session."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/hf_fixtures.py

torch.set_num_threads(2)


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
