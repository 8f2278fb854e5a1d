"""On an sm_90 GPU: the Gluon MLA kernel (helix/attention/gluon_mla.py), both variants, against a
float32 torch computation: ragged lengths, partial pages, empty sequences (kv_len 0: O = 0,
LSE = -inf), 16 / 64 / 128 heads, page 64 and 16, automatic and forced splits, stale slots and
freshly allocated outputs poisoned with NaN, and one call captured in a CUDA graph replayed on
new inputs. The cases are profiling/bench_mla_gluon.py's (the GPU script runs them too)."""

from __future__ import annotations

import pytest
import torch

from helix.attention import gluon_mla

pytestmark = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")


@needs_sm90
@pytest.mark.parametrize("variant", gluon_mla.VARIANTS)
def test_gluon_available(variant):
    assert gluon_mla.gluon_available("cuda", variant), gluon_mla.why_unavailable("cuda", variant)


@needs_sm90
@pytest.mark.parametrize("variant", gluon_mla.VARIANTS)
@pytest.mark.parametrize("case", range(7))
def test_gluon_mla_matches_reference(variant, case):
    from profiling.bench_mla_gluon import CHECKS, SCALE, compare, ragged_case
    B, heads, lens, ctx, page, splits = CHECKS[case]
    args = ragged_case(B, heads, lens, ctx, page, seed=1000 + case)
    poison = torch.full((64 << 20,), float("nan"), device="cuda")     # reused by the outputs
    del poison
    o, lse = gluon_mla.mla_decode_gluon(*args, SCALE, num_splits=splits, variant=variant)
    assert o.dtype == torch.bfloat16 and o.shape == (B, heads, 512) and lse.shape == (B, heads)
    rec = compare(o, lse, *gluon_mla.reference(*args, SCALE))
    assert rec["ok"], rec


@needs_sm90
@pytest.mark.parametrize("variant", gluon_mla.VARIANTS)
def test_gluon_mla_under_cuda_graph(variant):
    from profiling.bench_mla_gluon import graph_check
    rec = graph_check(variant)
    assert rec["ok"], rec
