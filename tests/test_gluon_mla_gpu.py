"""On an sm_90 GPU: the Gluon MLA kernel (helix/attention/gluon_mla.py), every variant, against a
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


@needs_sm90
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("kv_early", [True, False])
@pytest.mark.parametrize("variant", ["seesaw", "few"])
def test_gluon_mla_sees_the_row_the_previous_kernel_appends(heads, kv_early, variant,
                                                            monkeypatch):
    """The decode step's order under PDL: a kernel appends each sequence's new row (its last,
    kv_len - 1), then the Gluon kernel attends. With KV_EARLY its producer loads the earlier
    tiles before waiting for the append: the new rows (stale NaN until the append) must be
    read after it, every time, eagerly and replayed in a CUDA graph. Lengths put the last row
    first in a tile, last in a tile, mid-tile and in a one-row sequence."""
    from helix import triton_util
    from helix.attention import triton_append
    from profiling.bench_mla_gluon import SCALE, compare, ragged_case
    assert triton_util.pdl_enabled(torch.device("cuda"))    # else nothing here overlaps
    monkeypatch.setattr(gluon_mla, "KV_EARLY", kv_early)
    lens = [4097, 4096, 3000, 1]
    ql, qr, kv, bt, kl = ragged_case(4, heads, lens, 4096 + 64, 64, seed=7)
    page = kv.shape[1]
    last = torch.tensor([n - 1 for n in lens], device="cuda")
    slots = bt[torch.arange(4, device="cuda"), last // page].long() * page + last % page
    gen = torch.Generator(device="cuda").manual_seed(8)
    rows = torch.empty(4, kv.shape[2], device="cuda", dtype=kv.dtype)

    def step():
        triton_append.append_kv(kv, rows, slots)
        return gluon_mla.mla_decode_gluon(ql, qr, kv, bt, kl, SCALE, variant=variant)

    def stale_rows():
        kv.view(-1, kv.shape[2])[slots] = float("nan")      # what the append must replace
        rows.copy_(torch.randn(rows.shape, generator=gen, device="cuda"))

    for _ in range(10):
        stale_rows()
        o, lse = step()
        rec = compare(o, lse, *gluon_mla.reference(ql, qr, kv, bt, kl, SCALE))
        assert rec["ok"], rec
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    for _ in range(10):
        stale_rows()
        graph.replay()
        torch.cuda.synchronize()
        rec = compare(o, lse, *gluon_mla.reference(ql, qr, kv, bt, kl, SCALE))
        assert rec["ok"], rec


@needs_sm90
@pytest.mark.parametrize("case", [0, 3, 5, 6])
def test_gluon_mla_head_blocks_in_clusters(case, monkeypatch):
    """CLUSTER_HEADS = 2: the two head blocks of 128 heads launched as one thread-block cluster
    give the reference's result, eagerly and replayed in a CUDA graph (the launch attribute is
    captured with the kernel)."""
    from profiling.bench_mla_gluon import CHECKS, SCALE, compare, graph_check, ragged_case
    monkeypatch.setattr(gluon_mla, "CLUSTER_HEADS", 2)
    B, heads, lens, ctx, page, splits = CHECKS[case]
    assert heads == 128
    args = ragged_case(B, heads, lens, ctx, page, seed=2000 + case)
    o, lse = gluon_mla.mla_decode_gluon(*args, SCALE, num_splits=splits)
    rec = compare(o, lse, *gluon_mla.reference(*args, SCALE))
    assert rec["ok"], rec
    rec = graph_check("seesaw")
    assert rec["ok"], rec
