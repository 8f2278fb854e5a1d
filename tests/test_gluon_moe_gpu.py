"""On an sm_90 GPU: the one-row Gluon MoE launch (helix/layers/gluon_moe.py) against the fp32
torch reference at DeepSeek-V2-Lite's and Qwen3-235B's expert shapes (fewer experts), with and
without shared experts, with experts of other ranks among the top-k; repeated calls with new
routing (its counters back to zero); a CUDA graph replayed with new routing; moe_decode taking
it at one row; and a 2-layer DeepSeek-V2-Lite engine whose logits match the two Triton launches'."""

from __future__ import annotations

import pytest
import torch

from helix.layers import gluon_moe as gm
from helix.layers import moe_decode as md

pytestmark = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")

# (experts, top-k, I, shared width, D)
SHAPES = {"dsv2lite": (16, 6, 1408, 2816, 2048), "qwen3": (16, 8, 1536, 0, 4096),
          "small": (8, 3, 256, 512, 256),
          # DeepSeek-V3 at EP 8 (its shared expert's shard of 8): the ring at half depth
          "dsv3_ep8": (16, 8, 2048, 256, 7168)}


def _case(name, seed=0):
    E, k, inter, ws, dim = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)

    def rand(*s, scale=0.02):
        return (torch.randn(*s, generator=gen) * scale).to("cuda", torch.bfloat16)

    gate, up, down = rand(E, inter, dim), rand(E, inter, dim), rand(E, dim, inter)
    shared = (rand(ws, dim), rand(ws, dim), rand(dim, ws)) if ws else None
    x = rand(1, dim, scale=1.0)
    return x, gate, up, down, shared, k


def _routing(E, k, first, gen, foreign=0):
    """ids [1, k] (int32): k distinct experts, `foreign` of them outside [first, first + E)."""
    local = torch.randperm(E, generator=gen)[:k - foreign] + first
    other = torch.arange(foreign) + first + E
    ids = torch.cat([local, other])[torch.randperm(k, generator=gen)]
    w = torch.rand(1, k, generator=gen)
    return ids.view(1, k).int().cuda(), (w / w.sum()).cuda()


def _check(out, ref):
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-2 * scale, (err, scale)


@needs_sm90
def test_available():
    assert gm.available(torch.device("cuda")), gm.why_unavailable(torch.device("cuda"))


@needs_sm90
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("foreign", [0, 2])
def test_matches_reference(name, foreign):
    x, gate, up, down, shared, k = _case(name)
    gen = torch.Generator().manual_seed(7)
    first = 32
    for _ in range(3):                    # new routing each call: the counters must be reset
        ids, w = _routing(gate.shape[0], k, first, gen, foreign)
        out = gm.moe_row(x, gate, up, down, w, ids, first, shared)
        torch.cuda.synchronize()
        _check(out, gm.reference(x, gate, up, down, w, ids, first, shared))
    from helix import triton_util
    assert int(triton_util.arrival_counters(x.device, 1).abs().sum()) == 0


@needs_sm90
def test_cuda_graph_replays_with_new_routing():
    x, gate, up, down, shared, k = _case("dsv2lite", seed=3)
    gen = torch.Generator().manual_seed(11)
    ids, w = _routing(gate.shape[0], k, 0, gen)
    gm.moe_row(x, gate, up, down, w, ids, 0, shared)       # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gm.moe_row(x, gate, up, down, w, ids, 0, shared)
    for _ in range(4):
        new_ids, new_w = _routing(gate.shape[0], k, 0, gen)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        _check(out, gm.reference(x, gate, up, down, w, ids, 0, shared))


@needs_sm90
def test_moe_decode_takes_the_row_launch_at_one_row(monkeypatch):
    x, gate, up, down, shared, k = _case("dsv2lite", seed=5)
    ids, w = _routing(gate.shape[0], k, 0, torch.Generator().manual_seed(2))
    assert gm.available(x.device)          # its self-check runs the launch too: before counting
    calls = []
    real = gm.moe_row
    monkeypatch.setattr(gm, "moe_row", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = md.moe_decode(x, gate, up, down, w, ids, 0, shared=shared)
    assert calls == [1]
    monkeypatch.setattr(gm, "ENABLED", False)
    two = md.moe_decode(x, gate, up, down, w, ids, 0, shared=shared)
    assert calls == [1]
    _check(out, gm.reference(x, gate, up, down, w, ids, 0, shared))
    _check(two, gm.reference(x, gate, up, down, w, ids, 0, shared))


def _engine_logits(enabled: bool, monkeypatch):
    from helix import LLM, Layout, RuntimeConfig, SamplingParams
    monkeypatch.setattr(gm, "ENABLED", enabled)
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", layers=2, seed=0, max_batch=1,
                       max_context=256, page_size=64, attention_backend="triton",
                       graph_buckets=(1,))
    with LLM("deepseek-v2-lite", Layout(), rt) as llm:
        llm.add_request([5, 17, 42, 3], SamplingParams(max_new_tokens=6, ignore_eos=True))
        logits = []
        while llm.has_unfinished():
            llm.step()
            logits.append(llm.engine.last_logits.float().clone())
    return logits


@needs_sm90
def test_engine_logits_match_the_two_launches(monkeypatch):
    monkeypatch.setattr(gm, "ROUTED", False)          # the router's own launch before it
    calls = []
    real = gm.moe_row
    monkeypatch.setattr(gm, "moe_row", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    row = _engine_logits(True, monkeypatch)
    assert calls, "the engine never took the one-row launch"
    two = _engine_logits(False, monkeypatch)
    assert len(row) == len(two)
    for a, b in zip(row, two):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item() + 1e-3


# -- the router inside the launch (gluon_moe.moe_row_routed, gluon_route) ----------------------

# name: (RouteSpec fields, all experts, router dtype, (I, shared width, D))
ROUTES = {
    "dsv2lite": (dict(k=6, sigmoid=False, groups=1, topk_group=1, group_rule="none",
                      norm=False, scaling=1.0), 64, torch.float32, (1408, 2816, 2048)),
    "qwen3": (dict(k=8, sigmoid=False, groups=1, topk_group=1, group_rule="none", norm=True,
                   scaling=1.0), 128, torch.bfloat16, (1536, 0, 4096)),
    "v2_groups": (dict(k=6, sigmoid=False, groups=8, topk_group=3, group_rule="max",
                       norm=False, scaling=16.0), 160, torch.float32, (256, 512, 512)),
    "v3_sigmoid": (dict(k=8, sigmoid=True, groups=8, topk_group=4, group_rule="top2",
                        norm=True, scaling=2.5), 256, torch.float32, (256, 512, 512)),
}


def _routed_case(name, seed=0):
    from helix.layers.triton_router import RouteSpec
    fields, ne, rdt, (inter, ws, dim) = ROUTES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*s, scale=0.02, dtype=torch.bfloat16):
        return (torch.randn(*s, generator=gen, device="cuda") * scale).to(dtype)

    spec = RouteSpec(**fields)
    # every expert local: each chosen one is read (first 0, all of them on this rank)
    gate, up, down = rand(ne, inter, dim), rand(ne, inter, dim), rand(ne, dim, inter)
    shared = (rand(ws, dim), rand(ws, dim), rand(dim, ws)) if ws else None
    router = rand(ne, dim, scale=0.05, dtype=rdt)
    bias = rand(ne, scale=0.05, dtype=torch.float32) if spec.sigmoid else None
    norm_w = (1.0 + rand(dim, scale=0.1)).to(torch.bfloat16)
    return spec, gate, up, down, shared, router, bias, norm_w, rand


def _two_launches(a, res, norm_w, router, bias, spec, gate, up, down, shared):
    from helix.layers import triton_router as tr
    y, h, w, ids = tr.route_add_norm_triton(a, res, norm_w, 1e-6, router, bias, spec)
    return gm.moe_row(y, gate, up, down, w, ids, 0, shared), h, y, w, ids


def _check_routed(got, want):
    out, h, y, w, ids = got
    out2, h2, y2, w2, ids2 = want
    assert torch.equal(ids, ids2), (ids, ids2)
    assert torch.equal(h, h2)
    ulp = 2.0 ** -7                                     # bf16: rstd's last bit may differ
    assert ((y.float() - y2.float()).abs() <= ulp * y2.float().abs() + 1e-6).all()
    assert ((w.float() - w2.float()).abs() <= ulp * w2.float().abs() + 1e-6).all()
    _check(out, out2.float())


@needs_sm90
@pytest.mark.parametrize("name", list(ROUTES))
def test_routed_launch_matches_the_router_and_the_launch(name):
    spec, gate, up, down, shared, router, bias, norm_w, rand = _routed_case(name)
    dim = gate.shape[2]
    for _ in range(3):                    # new rows each call: the counters must be reset
        a, res = rand(1, dim, scale=1.0), rand(1, dim, scale=1.0)
        got = gm.moe_row_routed(a, res, norm_w, 1e-6, router, bias, spec, gate, up, down, 0,
                                shared)
        torch.cuda.synchronize()
        _check_routed(got, _two_launches(a, res, norm_w, router, bias, spec, gate, up, down,
                                         shared))
        _check(got[0], gm.reference(got[2], gate, up, down, got[3], got[4], 0, shared))
    from helix import triton_util
    assert int(triton_util.arrival_counters(a.device, 1).abs().sum()) == 0


@needs_sm90
def test_routed_launch_in_a_cuda_graph_replays_with_new_rows():
    spec, gate, up, down, shared, router, bias, norm_w, rand = _routed_case("dsv2lite", 4)
    dim = gate.shape[2]
    a, res = rand(1, dim, scale=1.0), rand(1, dim, scale=1.0)
    args = (norm_w, 1e-6, router, bias, spec, gate, up, down, 0, shared)
    gm.moe_row_routed(a, res, *args)                  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = gm.moe_row_routed(a, res, *args)
    seen = set()
    for _ in range(4):
        a.copy_(rand(1, dim, scale=1.0))
        res.copy_(rand(1, dim, scale=1.0))
        g.replay()
        torch.cuda.synchronize()
        _check_routed(got, _two_launches(a, res, norm_w, router, bias, spec, gate, up, down,
                                         shared))
        seen.add(tuple(got[4].reshape(-1).tolist()))
    assert len(seen) > 1, "the rows did not change the routing"


@needs_sm90
def test_engine_takes_the_routed_launch_and_matches(monkeypatch):
    calls = []
    real = gm.moe_row_routed
    monkeypatch.setattr(gm, "moe_row_routed",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    routed = _engine_logits(True, monkeypatch)
    assert calls, "the engine never took the routed launch"
    monkeypatch.setattr(gm, "ROUTED", False)
    n = len(calls)
    plain = _engine_logits(True, monkeypatch)
    assert len(calls) == n
    assert len(routed) == len(plain)
    for a, b in zip(routed, plain):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item() + 1e-3


# -- fp8 experts (block scales, helix.layers.fp8) in the launch ---------------------------------

def _q(w):
    """A 16-bit [E, n, k] stack or [n, k] matrix -> (block fp8 weight, its scale grid)."""
    from helix.layers import fp8
    return tuple(fp8.quantize(w))


def _fp8_case(name, seed=0):
    x, gate, up, down, shared, k = _case(name, seed)
    (g8, gs), (u8, us), (d8, ds) = (_q(w) for w in (gate, up, down))
    sh8 = ssc = None
    if shared is not None:
        sh8, ssc = zip(*(_q(w) for w in shared))
    return x, (g8, u8, d8), (gs, us, ds), sh8, ssc, k


@needs_sm90
def test_fp8_available():
    dev = torch.device("cuda")
    assert gm.available(dev, scaled=True), gm.why_unavailable(dev, scaled=True)


@needs_sm90
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("foreign", [0, 2])
def test_fp8_matches_reference_and_the_two_launches(name, foreign, monkeypatch):
    """fp8 experts in the launch against the fp32 product of the dequantized weights, and
    against moe_decode's two fp8 launches (gluon_moe.FP8 off), several routings."""
    x, (g8, u8, d8), scales, sh8, ssc, k = _fp8_case(name)
    gen = torch.Generator().manual_seed(5)
    first = 32
    for _ in range(3):
        ids, w = _routing(g8.shape[0], k, first, gen, foreign)
        out = gm.moe_row(x, g8, u8, d8, w, ids, first, sh8, scales, ssc)
        torch.cuda.synchronize()
        _check(out, gm.reference(x, g8, u8, d8, w, ids, first, sh8, scales, ssc))
        if sh8 is None or md.shared_scales_fit(g8.shape[1]):
            monkeypatch.setattr(gm, "FP8", False)
            two = md.moe_decode(x, g8, u8, d8, w, ids, first, shared=sh8, scales=scales,
                                shared_scales=ssc)
            monkeypatch.setattr(gm, "FP8", True)
            _check(out, two.float())
    from helix import triton_util
    assert int(triton_util.arrival_counters(x.device, 1).abs().sum()) == 0


@needs_sm90
def test_fp8_moe_decode_takes_the_row_launch_in_a_graph(monkeypatch):
    """moe_decode at one row with fp8 experts takes the launch (not with gluon_moe.FP8 off), and
    a captured call replays with new routings."""
    x, (g8, u8, d8), scales, sh8, ssc, k = _fp8_case("dsv2lite", seed=3)
    gen = torch.Generator().manual_seed(9)
    ids, w = _routing(g8.shape[0], k, 0, gen)
    assert gm.available(x.device, scaled=True)
    calls = []
    real = gm.moe_row
    monkeypatch.setattr(gm, "moe_row", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    run = lambda: md.moe_decode(x, g8, u8, d8, w, ids, 0, shared=sh8, scales=scales,  # noqa
                                shared_scales=ssc)
    run()
    assert calls == [1]
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    for _ in range(3):
        new_ids, new_w = _routing(g8.shape[0], k, 0, gen)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        _check(out, gm.reference(x, g8, u8, d8, w, ids, 0, sh8, scales, ssc))
    monkeypatch.setattr(gm, "FP8", False)
    n = len(calls)
    run()
    assert len(calls) == n


@needs_sm90
@pytest.mark.parametrize("name", ["dsv2lite", "v3_sigmoid"])
def test_fp8_routed_launch_matches_the_router_and_the_launch(name):
    spec, gate, up, down, shared, router, bias, norm_w, rand = _routed_case(name)
    (g8, gs), (u8, us), (d8, ds) = (_q(w) for w in (gate, up, down))
    sh8, ssc = zip(*(_q(w) for w in shared)) if shared is not None else (None, None)
    sc = dict(scales=(gs, us, ds), shared_scales=ssc)
    dim = gate.shape[2]
    from helix.layers import triton_router as tr
    for _ in range(3):
        a, res = rand(1, dim, scale=1.0), rand(1, dim, scale=1.0)
        got = gm.moe_row_routed(a, res, norm_w, 1e-6, router, bias, spec, g8, u8, d8, 0, sh8,
                                **sc)
        torch.cuda.synchronize()
        y, h, w, ids = tr.route_add_norm_triton(a, res, norm_w, 1e-6, router, bias, spec)
        want = (gm.moe_row(y, g8, u8, d8, w, ids, 0, sh8, **sc), h, y, w, ids)
        _check_routed(got, want)
        _check(got[0], gm.reference(got[2], g8, u8, d8, got[3], got[4], 0, sh8, **sc))


@needs_sm90
def test_fp8_engine_takes_the_routed_launch_and_matches_the_two_launches(monkeypatch):
    """DeepSeek-V2-Lite's first layers with fp8 weights (quantized at load): the engine's
    one-row steps take the routed launch with fp8 experts, and its logits match the same
    engine on moe_decode's fp8 launches (gluon_moe.FP8 off)."""
    from helix import LLM, Layout, RuntimeConfig, SamplingParams
    calls = []
    real = gm.moe_row_routed
    monkeypatch.setattr(gm, "moe_row_routed",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def logits(fp8_row):
        monkeypatch.setattr(gm, "FP8", fp8_row)
        rt = RuntimeConfig(device="cuda", dtype="bfloat16", layers=3, seed=0, max_batch=1,
                           max_context=256, page_size=64, attention_backend="triton",
                           graph_buckets=(1,), quantization="fp8")
        out = []
        with LLM("deepseek-v2-lite", Layout(), rt) as llm:
            assert llm.engine.model.model.layers[1].mlp.experts.fp8
            llm.add_request([5, 17, 42, 3], SamplingParams(max_new_tokens=6, ignore_eos=True))
            while llm.has_unfinished():
                llm.step()
                out.append(llm.engine.last_logits.float().clone())
        return out

    row = logits(True)
    assert calls, "the engine never took the routed launch with fp8 experts"
    n = len(calls)
    two = logits(False)
    assert len(calls) == n
    assert len(row) == len(two)
    for a, b in zip(row, two):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item() + 1e-3


@needs_sm90
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_v3_layer_with_half_the_ring_and_its_router(fp8):
    """DeepSeek-V3's layer (D 7168, top-8 of 256 experts by its sigmoid / top-2-groups rule,
    16 of them on this rank, the shared expert's shard of 256): the h buffer takes 128 KB, so the
    launch runs with half the ring (gluon_moe.ring_stages); with its router against the router
    kernel and the launch, and against the reference."""
    from helix.layers import triton_router as tr
    from helix.layers.triton_router import RouteSpec
    E, k, inter, ws, dim = SHAPES["dsv3_ep8"]
    assert gm.ring_stages(k, inter, ws, dim, 1 if fp8 else 2) == (8 if fp8 else 4)
    spec = RouteSpec(k=8, sigmoid=True, groups=8, topk_group=4, group_rule="top2", norm=True,
                     scaling=2.5)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*s, scale=0.02, dtype=torch.bfloat16):
        return (torch.randn(*s, generator=gen, device="cuda") * scale).to(dtype)

    gate, up, down = rand(E, inter, dim), rand(E, inter, dim), rand(E, dim, inter)
    shared = (rand(ws, dim), rand(ws, dim), rand(dim, ws))
    sc = {}
    if fp8:
        (gate, gs), (up, us), (down, ds) = (_q(w) for w in (gate, up, down))
        shared, ssc = zip(*(_q(w) for w in shared))
        sc = dict(scales=(gs, us, ds), shared_scales=ssc)
    router = rand(256, dim, scale=0.05, dtype=torch.float32)
    bias = rand(256, scale=0.05, dtype=torch.float32)
    bias[32:48] += 0.5                                  # this rank's experts: chosen often
    norm_w = (1.0 + rand(dim, scale=0.1)).to(torch.bfloat16)
    first = 32                                          # experts 32..47 on this rank
    hits = 0
    for _ in range(4):
        a, res = rand(1, dim, scale=1.0), rand(1, dim, scale=1.0)
        got = gm.moe_row_routed(a, res, norm_w, 1e-6, router, bias, spec, gate, up, down,
                                first, shared, **sc)
        torch.cuda.synchronize()
        y, h, w, ids = tr.route_add_norm_triton(a, res, norm_w, 1e-6, router, bias, spec)
        want = (gm.moe_row(y, gate, up, down, w, ids, first, shared, **sc), h, y, w, ids)
        _check_routed(got, want)
        _check(got[0], gm.reference(got[2], gate, up, down, got[3], got[4], first, shared,
                                    **sc))
        hits += int(((got[4] >= first) & (got[4] < first + E)).sum())
    assert hits > 0, "no routed expert was local: only the shared expert was checked"
