"""The one-row Gluon MoE launch (helix/layers/gluon_moe.py) without a GPU: its work plan (every
feature of every slot once, gate/up before down in every program's list, the down chunks and
the combine's order, the balance across programs), the plan's arithmetic replayed in torch
against the fp32 reference (the kernel's item math: offsets, K chunks, the width mask, the
non-local slots), the shapes it refuses and why, and (marked sm90) its compile for Hopper."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import sm90_compile
from helix.layers import fp8
from helix.layers import gluon_moe as gm
from helix.layers.fused_moe import fused_moe_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (top-k, I, shared width, D): DeepSeek-V2-Lite, Qwen3-235B (no shared experts), a small one
SHAPES = [(6, 1408, 2816, 2048), (8, 1536, 0, 4096), (3, 288, 576, 512)]


@pytest.mark.parametrize("topk,inter,ws,dim", SHAPES)
def test_plan_covers_every_feature_once_gate_up_first(topk, inter, ws, dim):
    p = gm.plan(topk, inter, ws, dim, 132)
    slots = ([topk] if ws else []) + list(range(topk))
    width = {s: ws if s == topk else inter for s in slots}
    up, down = [], []
    for lst, (lead, n_up, n_down) in zip(p.items, p.counts(topk)):
        kinds = [it[0] for it in lst]
        assert kinds == sorted(kinds), "a down item before a gate/up item"
        assert (n_up, n_down) == (kinds.count(0), kinds.count(1))
        assert all(it[1] == topk for it in lst[:lead]) and ws or lead == 0
        assert all(it[1] != topk for it in lst[lead:n_up]), "shared items lead the gate/up"
        up += [it[1:] for it in lst if it[0] == 0]
        down += [it[2] for it in lst if it[0] == 1]
    assert sorted(up) == sorted((s, n0) for s in slots for n0 in range(0, width[s], gm.BN))
    assert sorted(down) == list(range(0, dim, 2 * gm.BN))
    assert p.programs <= 132
    assert p.h_rows == 2 * gm.k_steps(ws) + topk * 2 * gm.k_steps(inter)


@pytest.mark.parametrize("topk,inter,ws,dim", SHAPES[:2])
def test_plan_balances_each_phase(topk, inter, ws, dim):
    """Down items wait for the last gate/up item, so the gate/up work is balanced on its own
    (programs differ by one item at most), and the whole within 10 % of the mean
    (DeepSeek-V2-Lite: 1408 gate/up items of 4 stages, 128 down items of 24, on 132 programs:
    gate/up 40 or 44 stages a program, the most loaded 68 against a mean of 65.9)."""
    p = gm.plan(topk, inter, ws, dim, 132)
    slots = ([topk] if ws else []) + list(range(topk))
    cost = {0: gm.k_steps(dim),
            1: sum(gm.k_steps(ws if s == topk else inter) for s in slots)}
    ups = [sum(cost[0] for it in lst if it[0] == 0) for lst in p.items]
    loads = [sum(cost[it[0]] for it in lst) for lst in p.items]
    assert p.programs == 132
    assert max(ups) - min(ups) <= cost[0]
    assert max(loads) <= 1.10 * sum(loads) / len(loads)


def test_tables_hold_the_plan():
    p = gm.plan(3, 256, 512, 512, 16)
    items, counts = gm._tables(p, 3, torch.device("cpu"))
    assert items.shape == (p.programs, p.max_items, gm.FIELDS)
    for g, lst in enumerate(p.items):
        assert items[g, :len(lst), :3].tolist() == [list(it) for it in lst]
    assert counts.tolist() == [list(c) for c in p.counts(3)]


def _replay(p, x, gate, up, down, weights, ids, first, shared):
    """The kernel's item arithmetic in torch (fp32): phase A's items -> the weighted h buffer
    (rows of BK, the shared slot first), phase B's items over every local slot's down stages
    (two BK-wide K steps each, past a slot's width 0) -> out."""
    topk = ids.shape[-1]
    E, inter, dim = gate.shape
    ws = shared[0].shape[0] if shared is not None else 0
    slots = ([topk] if ws else []) + list(range(topk))
    xf = x.reshape(-1).float()
    idl = ids.reshape(-1).tolist()
    h = torch.full((p.h_rows * gm.BK,), float("nan"))

    def local(s):
        if s == topk:
            return True, 0
        e = idl[s] - first
        return 0 <= e < E, e

    def width(s):
        return ws if s == topk else inter

    def row0(s):
        return 0 if s == topk else 2 * gm.k_steps(ws) + s * 2 * gm.k_steps(inter)

    def mats(s, e):
        if s == topk:
            return [m.float() for m in shared]
        return gate[e].float(), up[e].float(), down[e].float()

    items = [it for lst in p.items for it in lst]
    for kind, s, n0 in (it for it in items if it[0] == 0):
        ok, e = local(s)
        if ok:
            g, u, _ = mats(s, e)
            w = 1.0 if s == topk else weights.reshape(-1)[s].float()
            hv = w * F.silu(g[n0:n0 + gm.BN] @ xf) * (u[n0:n0 + gm.BN] @ xf)
            h[row0(s) * gm.BK + n0:row0(s) * gm.BK + n0 + gm.BN] = hv
    out = torch.full((dim,), float("nan"))
    for kind, _, n0 in (it for it in items if it[0] == 1):
        acc = torch.zeros(2 * gm.BN)
        for s in slots:
            ok, e = local(s)
            if not ok:
                continue
            d = mats(s, e)[2]
            for t in range(gm.k_steps(width(s))):
                for half in range(2):
                    k = (2 * t + half) * gm.BK
                    hk = h[row0(s) * gm.BK + k:row0(s) * gm.BK + k + gm.BK].clone()
                    valid = torch.arange(k, k + gm.BK) < width(s)
                    hk = torch.where(valid, hk, 0.0)            # _stage_h's mask
                    wk = torch.zeros(2 * gm.BN, gm.BK)           # TMA: 0 past the last column
                    cols = d[n0:n0 + 2 * gm.BN, k:min(k + gm.BK, width(s))]
                    wk[:, :cols.shape[1]] = cols
                    acc += wk @ hk
        out[n0:n0 + 2 * gm.BN] = acc
    return out.view(1, dim)


@pytest.mark.parametrize("ids,first", [([[9, 2, 6]], 4), ([[1, 0, 7]], 0)])
@pytest.mark.parametrize("with_shared", [True, False])
def test_replayed_plan_matches_the_reference(ids, first, with_shared):
    gen = torch.Generator().manual_seed(0)
    E, inter, dim, ws = 8, 256 + 32, 512, 512 + 64

    def rand(*s):
        return (torch.randn(*s, generator=gen) * 0.05).to(torch.bfloat16)

    gate, up, down = rand(E, inter, dim), rand(E, inter, dim), rand(E, dim, inter)
    shared = (rand(ws, dim), rand(ws, dim), rand(dim, ws)) if with_shared else None
    x = rand(1, dim) * 20
    ids = torch.tensor(ids, dtype=torch.int32)
    w = torch.tensor([[0.5, 0.3, 0.2]])
    p = gm.plan(3, inter, ws if with_shared else 0, dim, 16)
    assert inter % (2 * gm.BK) and ws % (2 * gm.BK)       # partial last down stages
    got = _replay(p, x, gate, up, down, w, ids, first, shared)
    ref = gm.reference(x, gate, up, down, w, ids, first, shared)
    torch.testing.assert_close(got, ref, atol=2e-3 * ref.abs().max().item(), rtol=2e-2)


def test_reference_is_fused_moe_torch_plus_the_shared_mlp():
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(4, 32, 16, generator=gen), torch.randn(4, 32, 16, generator=gen)
    down = torch.randn(4, 16, 32, generator=gen)
    sh = (torch.randn(64, 16, generator=gen), torch.randn(64, 16, generator=gen),
          torch.randn(16, 64, generator=gen))
    x = torch.randn(1, 16, generator=gen)
    ids, w = torch.tensor([[3, 6]]), torch.tensor([[0.7, 0.3]])
    want = (fused_moe_torch(x, gate, up, down, w, ids, 2)
            + (F.silu(x @ sh[0].t()) * (x @ sh[1].t())) @ sh[2].t())
    torch.testing.assert_close(gm.reference(x, gate, up, down, w, ids, 2, sh), want)


class _Cuda:
    """A CUDA-looking row for the shape rules (no GPU needed)."""
    device = torch.device("cuda")

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_unsupported_names_the_reason():
    bf = torch.bfloat16
    x = torch.zeros(1, 256, dtype=bf)
    g, d = torch.zeros(4, 256, 256, dtype=bf), torch.zeros(4, 256, 256, dtype=bf)
    assert gm.BK == 256 and gm.BN == 8

    def why(row, *w, topk=3, **kw):
        return gm.unsupported(row, *w, topk=topk, **kw)

    Fake = _Cuda
    assert "CUDA" in why(x, g, g, d)
    assert "rows" in why(Fake(torch.zeros(2, 256, dtype=bf)), g, g, d)
    assert "dtype" in why(Fake(torch.zeros(1, 256)), g, g, d)
    assert "dims" in why(Fake(torch.zeros(1, 192, dtype=bf)), torch.zeros(4, 256, 192, dtype=bf),
                         torch.zeros(4, 256, 192, dtype=bf), torch.zeros(4, 192, 256, dtype=bf))
    assert "dims" in why(Fake(x), torch.zeros(4, 20, 256, dtype=bf),
                         torch.zeros(4, 20, 256, dtype=bf), torch.zeros(4, 256, 20, dtype=bf))
    assert "contiguous" in why(Fake(x), g.transpose(1, 2), g, d)
    assert why(Fake(x), g, g, d) is None
    assert "block scales" in why(Fake(x), g, g, d, scales=(g, g, d))
    assert not gm.available(torch.device("cpu"))
    assert not gm.available(torch.device("cpu"), scaled=True)


def test_unsupported_fp8_weights_need_their_scales():
    """fp8 experts take the launch with their block scales (contiguous fp32 grids of the
    weights' shapes, the shared experts' too); widths of fp8 down rows must be whole 16 bytes."""
    bf, f8 = torch.bfloat16, fp8.DTYPE
    x = _Cuda(torch.zeros(1, 512, dtype=bf))
    E, inter, dim, ws = 4, 384, 512, 256
    gate, down = torch.zeros(E, inter, dim, dtype=f8), torch.zeros(E, dim, inter, dtype=f8)
    sg, sd = torch.ones(E, 3, 4), torch.ones(E, 4, 3)
    shared = (torch.zeros(ws, dim, dtype=f8),) * 2 + (torch.zeros(dim, ws, dtype=f8),)
    ss = (torch.ones(2, 4), torch.ones(2, 4), torch.ones(4, 2))

    def why(*w, **kw):
        return gm.unsupported(x, *w, topk=2, **kw)

    assert why(gate, gate, down, scales=(sg, sg, sd)) is None
    assert why(gate, gate, down, shared, scales=(sg, sg, sd), shared_scales=ss) is None
    assert "without their block scales" in why(gate, gate, down)
    assert "shared experts without" in why(gate, gate, down, shared, scales=(sg, sg, sd))
    assert "want contiguous float32 (4, 3, 4)" in why(gate, gate, down, scales=(sd, sg, sd))
    assert "float32" in why(gate, gate, down, scales=(sg.double(), sg, sd))
    assert "contiguous" in why(gate, gate, down, scales=(sg, sg, sd.transpose(1, 2)
                                                         .contiguous().transpose(1, 2)))
    assert "one dtype" in why(gate, gate, down, tuple(w.to(bf) for w in shared),
                              scales=(sg, sg, sd), shared_scales=ss)
    odd = torch.zeros(E, 200, dim, dtype=f8), torch.zeros(E, dim, 200, dtype=f8)
    assert "16 bytes" in why(odd[0], odd[0], odd[1],
                             scales=(torch.ones(E, 2, 4), torch.ones(E, 2, 4),
                                     torch.ones(E, 4, 2)))


def test_shared_memory_rule():
    """smem_bytes matches the compiled launches (DeepSeek-V2-Lite 200996 bytes, DeepSeek-V3's
    layer 278820 with the full ring) within SMEM_SLACK; DeepSeek-V3's layer (D 7168, top-8,
    I 2048: a 128 KB h buffer) runs with half the ring (ring_stages: 4 of 8, 8 of 16 in fp8),
    DeepSeek-V2-Lite's and Qwen3's with the full one; a layer that does not fit even then is
    refused (moe_decode's two launches take it)."""
    assert 200996 <= gm.smem_bytes(6, 1408, 2816, 2048, 2, 2) <= 200996 + gm.SMEM_SLACK
    assert 278820 <= gm.smem_bytes(8, 2048, 2048, 7168, 2, 2) <= 278820 + gm.SMEM_SLACK
    assert gm.smem_bytes(6, 1408, 2816, 2048, 1, 2) == gm.smem_bytes(6, 1408, 2816, 2048, 2, 2)
    for wb, full in ((2, gm.STAGES), (1, gm.STAGES_FP8)):
        assert gm.ring_stages(8, 2048, 2048, 7168, wb) == full // 2
        assert gm.ring_stages(8, 2048, 256, 7168, wb) == full // 2
        assert gm.ring_stages(6, 1408, 2816, 2048, wb) == full
        assert gm.ring_stages(8, 1536, 0, 4096, wb) == full
        assert gm.layer_unfit(8, 7168, 2048, 2048, wb) is None
        assert "shared memory" in gm.layer_unfit(16, 7168, 4096, 0, wb)
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = _Cuda(torch.zeros(1, 7168, dtype=torch.bfloat16))
    g, d = torch.empty(4, 4096, 7168, **meta), torch.empty(4, 7168, 4096, **meta)
    assert "shared memory" in gm.unsupported(x, g, g, d, topk=16)
    assert gm.unsupported(x, g, g, d, topk=4) is None


@pytest.mark.sm90
def test_compiles_for_sm90(tmp_path):
    """DeepSeek-V2-Lite's and Qwen3-235B's layers compile for sm_90 (no GPU), 16-bit and fp8
    weights: no spills, 128 registers a thread at launch, one block under the shared-memory
    limit and within gluon_moe.smem_bytes (the ring of 8 x 4 boxes of 8 x 256, 16 x 4 in fp8,
    x and the h buffer), unswizzled [8, 256] boxes, a 40-register producer,
    and under PDL two waits (the producer before the routed tiles, the consumer before x) and
    one launch of the next kernel."""
    import json
    out = tmp_path / "moe.json"
    code = ("import json, sys; sys.path.insert(0, 'profiling'); import gluon_resources as g; "
            "recs = [g.check_moe(1), g.check_moe(1, topk=8, experts=16, inter=1536, dim=4096, "
            "shared=0), g.check_moe(1, fp8=True), g.check_moe(1, fp8=True, topk=8, experts=16, "
            "inter=1536, dim=4096, shared=0)]; "
            f"open({str(out)!r}, 'w').write(json.dumps(recs, default=str))")
    sm90_compile.run(tmp_path, ["-c", code])
    for r in json.loads(out.read_text()):
        assert r["ok"], r.get("error", "")[-3000:]
        assert r["stack_bytes"] == 0 and r["local_loads"] == r["local_stores"] == 0
        assert r["registers"] == 128
        assert r["shared_bytes"] <= 232448
        shape = (r.get("topk", 6), r.get("inter", 1408), r.get("shared", 2816),
                 r.get("dim", 2048), 1 if r.get("fp8") else 2, 2)
        assert gm.smem_bytes(*shape) - gm.SMEM_SLACK <= r["shared_bytes"] <= gm.smem_bytes(*shape)
        assert all(m["block_size"] == [8, 256] and m["swizzle"] == 0
                   for m in r["tensordesc_meta"])
        assert "setmaxnreg.inc.sync.aligned.u32 40" in r["setmaxnreg"]        # the producer
        assert (r["gdc_waits"], r["gdc_launches"]) == (2, 1)


def test_route_unsupported_names_the_reason():
    from helix.layers.triton_router import RouteSpec
    bf = torch.bfloat16
    spec = RouteSpec(k=6, sigmoid=False, groups=1, topk_group=1, group_rule="none", norm=False,
                     scaling=1.0)
    a, nw, rw = torch.zeros(1, 256, dtype=bf), torch.zeros(256, dtype=bf), torch.zeros(64, 256)
    assert gm.route_unsupported(a, a, nw, rw, None, spec) is None
    assert gm.route_unsupported(a, a, nw, rw.to(bf), None, spec) is None   # Qwen3: the dtype's
    assert "residual" in gm.route_unsupported(a, torch.zeros(1, 128, dtype=bf), nw, rw, None,
                                              spec)
    assert "dtype" in gm.route_unsupported(a, a, nw.float(), rw, None, spec)
    assert "contiguous" in gm.route_unsupported(a, a, nw, rw.t().contiguous().t(), None, spec)
    assert "router weight" in gm.route_unsupported(a, a, nw, rw.half(), None, spec)
    assert "bias" in gm.route_unsupported(a, a, nw, rw, torch.zeros(64, dtype=bf), spec)
    grouped = RouteSpec(k=6, sigmoid=False, groups=3, topk_group=1, group_rule="max",
                        norm=False, scaling=1.0)
    assert "groups" in gm.route_unsupported(a, a, nw, rw, None, grouped)
    big = torch.zeros(2048, 256)
    assert "experts" in gm.route_unsupported(a, a, nw, big, None, spec)


@pytest.mark.sm90
def test_deepseek_v3_layer_compiles_with_half_the_ring(tmp_path):
    """DeepSeek-V3's layer at EP 8 (D 7168, top-8, I 2048, the shared expert's shard of 256),
    plain and with its router, 16-bit and fp8: compiles for sm_90 within the shared-memory limit
    and gluon_moe.smem_bytes at ring_stages' depth (half the ring), 128 registers. Its 28 rows
    of x (D 7168) spill a little in the prologue (the bound below is what triton 3.6 gives:
    8 / 24 bytes plain, up to 488 with the router's rows; none in the weight loop)."""
    import json
    out = tmp_path / "moe.json"
    v3 = dict(k=8, sigmoid=True, groups=8, topk_group=4, group_rule="top2", norm=True,
              scaling=2.5, experts=256)
    code = ("import json, sys; sys.path.insert(0, 'profiling'); import gluon_resources as g; "
            "s = dict(topk=8, experts=16, inter=2048, dim=7168, shared=256); "
            f"v3 = {v3!r}; "
            "recs = [g.check_moe(1, fp8=f, **s) for f in (False, True)] + "
            "[g.check_moe(1, fp8=f, route=v3, **s) for f in (False, True)]; "
            f"open({str(out)!r}, 'w').write(json.dumps(recs, default=str))")
    sm90_compile.run(tmp_path, ["-c", code], timeout=600)
    for r in json.loads(out.read_text()):
        assert r["ok"], r.get("error", "")[-3000:]
        wb = 1 if r["fp8"] else 2
        stages = gm.ring_stages(8, 2048, 256, 7168, wb)
        want = gm.smem_bytes(8, 2048, 256, 7168, wb, 2, stages)
        assert want - gm.SMEM_SLACK <= r["shared_bytes"] <= min(want, gm.SMEM_LIMIT)
        assert r["registers"] == 128
        assert r["stack_bytes"] <= (512 if r.get("route") else 32)


# the routing rules of the router's launch inside gluon_moe (RouteSpec fields, all experts)
ROUTE_RULES = {
    "dsv2lite": dict(k=6, sigmoid=False, groups=1, topk_group=1, group_rule="none", norm=False,
                     scaling=1.0, experts=64),
    "v2_groups": dict(k=6, sigmoid=False, groups=8, topk_group=3, group_rule="max", norm=False,
                      scaling=16.0, experts=160),
    "v3_sigmoid": dict(k=8, sigmoid=True, groups=8, topk_group=4, group_rule="top2", norm=True,
                       scaling=2.5, experts=256),
}


@pytest.mark.sm90
def test_routed_launch_compiles_for_sm90(tmp_path):
    """The launch with its router (gluon_route) compiles for sm_90 at DeepSeek-V2-Lite's layer
    with each routing rule (softmax; V2's group-limited greedy; V3's sigmoid, bias and top-2
    groups) and at Qwen3's (a bf16 router, no shared experts): no spills, still 128 registers
    a thread and the shared-memory limit, and under PDL ONE wait for the previous kernel (the
    consumer's, after its router rows are loaded; the producer waits for its own consumer's
    choice instead) and one launch of the next kernel. With PDL_EARLY (DeepSeek-V2-Lite's
    rule, PDL value 3) the router partition waits too, before it reads the route counter
    (gluon_route.choose): two waits. The same with fp8 experts (DeepSeek-V2-Lite's layer,
    softmax and V3's rule)."""
    import json
    out = tmp_path / "moe.json"
    rules = {n: dict(r) for n, r in ROUTE_RULES.items()}
    code = ("import json, sys, torch; sys.path.insert(0, 'profiling'); "
            "import gluon_resources as g; "
            f"rules = {rules!r}; "
            "recs = [g.check_moe(1, topk=r['k'], route=r) for r in rules.values()]; "
            "q = dict(k=8, sigmoid=False, groups=1, topk_group=1, group_rule='none', "
            "norm=True, scaling=1.0, experts=128, router_dtype=torch.bfloat16); "
            "recs.append(g.check_moe(1, topk=8, experts=16, inter=1536, dim=4096, shared=0, "
            "route=q)); "
            "recs.append(g.check_moe(3, topk=6, route=rules['dsv2lite'])); "
            "recs.append(g.check_moe(1, topk=6, route=rules['dsv2lite'], fp8=True)); "
            "recs.append(g.check_moe(1, topk=8, route=rules['v3_sigmoid'], fp8=True)); "
            f"open({str(out)!r}, 'w').write(json.dumps(recs, default=str))")
    sm90_compile.run(tmp_path, ["-c", code], timeout=600)
    recs = json.loads(out.read_text())
    for r in recs:
        assert r["ok"], r.get("error", "")[-3000:]
        assert r["stack_bytes"] == 0 and r["local_loads"] == r["local_stores"] == 0
        assert r["registers"] == 128
        assert r["shared_bytes"] <= 232448
        assert (r["gdc_waits"], r["gdc_launches"]) == ((2, 1) if r["pdl"] == 3 else (1, 1))
    assert recs[-3]["pdl"] == 3 and recs[-1]["fp8"]
