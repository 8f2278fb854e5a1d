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
from helix.layers import gluon_moe as gm
from helix.layers.fused_moe import fused_moe_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (top-k, I, shared width, D): DeepSeek-V2-Lite, Qwen3-235B (no shared experts), a small one
SHAPES = [(6, 1408, 2816, 2048), (8, 1536, 0, 4096), (3, 256, 512, 256)]


@pytest.mark.parametrize("topk,inter,ws,dim", SHAPES)
def test_plan_covers_every_feature_once_gate_up_first(topk, inter, ws, dim):
    p = gm.plan(topk, inter, ws, dim, 132)
    slots = ([topk] if ws else []) + list(range(topk))
    width = {s: ws if s == topk else inter for s in slots}
    up, down = {}, {}
    for lst in p.items:
        kinds = [it[0] for it in lst]
        assert kinds == sorted(kinds), "a down item before a gate/up item"
        for kind, s, n0, k0, tiles, c in lst:
            if kind == 0:
                assert (k0, tiles) == (0, dim // gm.BK)
                up[(s, n0)] = up.get((s, n0), 0) + 1
            else:
                assert p.chunk_slot[c] == s and tiles >= 1
                down[(s, n0, k0)] = (down.get((s, n0, k0), 0) + 1, tiles)
    assert up == {(s, n0): 1 for s in slots for n0 in range(0, width[s], gm.BN)}
    for s in slots:                         # the chunks tile [0, width) once per feature block
        for n0 in range(0, dim, 2 * gm.BN):
            ks = sorted((k0, t) for (s2, n2, k0), (cnt, t) in down.items()
                        if (s2, n2) == (s, n0) and cnt == 1)
            assert ks[0][0] == 0
            for (a, ta), (b, _) in zip(ks, ks[1:]):
                assert b == a + ta * gm.BK
            assert ks[-1][0] + ks[-1][1] * gm.BK >= width[s] > ks[-1][0] + (ks[-1][1] - 1) * gm.BK
    assert p.blocks == dim // (2 * gm.BN)
    assert p.programs <= 132


def test_plan_balances_the_programs_work():
    """DeepSeek-V2-Lite: 352 gate/up items of 16 tiles, 512 down items of <= 6 tiles over 132
    programs: the most loaded program within 5 % of the mean (tiles + 1 an item)."""
    p = gm.plan(6, 1408, 2816, 2048, 132)
    loads = [sum(it[4] + 1 for it in lst) for lst in p.items]
    assert p.programs == 132
    assert max(loads) <= 1.05 * sum(loads) / len(loads)


def test_tables_pad_with_skipped_items():
    p = gm.plan(3, 256, 512, 256, 132)
    items, chunk_slot = gm._tables(p, 3, torch.device("cpu"))
    assert items.shape == (p.programs, p.max_items, gm.FIELDS)
    n = [len(lst) for lst in p.items]
    for g in range(p.programs):
        assert (items[g, n[g]:, 0] == -1).all() and (items[g, n[g]:, 1] == 3).all()
        assert items[g, :n[g], :6].tolist() == [list(it) for it in p.items[g]]
    assert chunk_slot.tolist() == list(p.chunk_slot)


def _replay(p, x, gate, up, down, weights, ids, first, shared):
    """The kernel's item arithmetic in torch (fp32, h rounded to x's dtype as the kernel
    stores it): gate/up items -> h, down items -> y chunks, the combine in chunk order."""
    topk = ids.shape[-1]
    E, inter, dim = gate.shape
    ws = shared[0].shape[0] if shared is not None else 0
    xf = x.reshape(-1).float()
    h = torch.zeros(topk + 1, max(inter, ws))
    y = torch.zeros(len(p.chunk_slot), dim)
    idl = ids.reshape(-1).tolist()

    def local(s):
        if s == topk:
            return True, 0
        e = idl[s] - first
        return 0 <= e < E, e

    def rows(s, e, kind):
        if s == topk:
            return shared[0 if kind == "g" else 1 if kind == "u" else 2].float()
        return {"g": gate, "u": up, "d": down}[kind][e].float()

    order = sorted((it for lst in p.items for it in lst), key=lambda it: it[0])
    for kind, s, n0, k0, tiles, c in order:
        ok, e = local(s)
        if not ok:
            continue
        width = ws if s == topk else inter
        if kind == 0:
            g = rows(s, e, "g")[n0:n0 + gm.BN] @ xf
            u = rows(s, e, "u")[n0:n0 + gm.BN] @ xf
            h[s, n0:n0 + gm.BN] = (F.silu(g) * u).to(x.dtype).float()
        else:
            k1 = min(k0 + tiles * gm.BK, width)
            w = 1.0 if s == topk else weights.reshape(-1)[s].float()
            y[c, n0:n0 + 2 * gm.BN] = w * (rows(s, e, "d")[n0:n0 + 2 * gm.BN, k0:k1]
                                           @ h[s, k0:k1])
    keep = torch.tensor([local(s)[0] for s in p.chunk_slot])
    return y[keep].sum(0, keepdim=True)


@pytest.mark.parametrize("ids,first", [([[9, 2, 6]], 4), ([[1, 0, 7]], 0)])
@pytest.mark.parametrize("with_shared", [True, False])
def test_replayed_plan_matches_the_reference(ids, first, with_shared):
    gen = torch.Generator().manual_seed(0)
    E, inter, dim, ws = 8, 256, 256, 512

    def rand(*s):
        return (torch.randn(*s, generator=gen) * 0.05).to(torch.bfloat16)

    gate, up, down = rand(E, inter, dim), rand(E, inter, dim), rand(E, dim, inter)
    shared = (rand(ws, dim), rand(ws, dim), rand(dim, ws)) if with_shared else None
    x = rand(1, dim) * 20
    ids = torch.tensor(ids, dtype=torch.int32)
    w = torch.tensor([[0.5, 0.3, 0.2]])
    p = gm.plan(3, inter, ws if with_shared else 0, dim, 16)
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


def test_unsupported_names_the_reason():
    bf = torch.bfloat16
    x = torch.zeros(1, 256, dtype=bf)
    g, d = torch.zeros(4, 256, 256, dtype=bf), torch.zeros(4, 256, 256, dtype=bf)
    assert "CUDA" in gm.unsupported(x, g, g, d)

    class Fake:              # a CUDA-looking row for the shape rules (no GPU needed)
        device = torch.device("cuda")

        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

    assert "rows" in gm.unsupported(Fake(torch.zeros(2, 256, dtype=bf)), g, g, d)
    assert "dtype" in gm.unsupported(Fake(torch.zeros(1, 256)), g, g, d)
    assert "dims" in gm.unsupported(Fake(torch.zeros(1, 192, dtype=bf)),
                                    torch.zeros(4, 256, 192, dtype=bf),
                                    torch.zeros(4, 256, 192, dtype=bf),
                                    torch.zeros(4, 192, 256, dtype=bf))
    assert "contiguous" in gm.unsupported(Fake(x), g.transpose(1, 2), g, d)
    assert gm.unsupported(Fake(x), g, g, d) is None
    assert not gm.available(torch.device("cpu"))


@pytest.mark.sm90
def test_compiles_for_sm90(tmp_path):
    """DeepSeek-V2-Lite's and Qwen3-235B's layers compile for sm_90 (no GPU): no spills, one
    block under the shared-memory limit (the ring of 8 x 2 boxes of 32 x 128), four TMA loads
    each for routed and shared tiles, [32, 128] unswizzled boxes, a 40-register producer, and
    under PDL two waits (the producer before the routed tiles, the consumer before x) and one
    launch of the next kernel."""
    import json
    out = tmp_path / "moe.json"
    code = ("import json, sys; sys.path.insert(0, 'profiling'); import gluon_resources as g; "
            "recs = [g.check_moe(1), g.check_moe(1, topk=8, experts=16, inter=1536, dim=4096, "
            "shared=0)]; "
            f"open({str(out)!r}, 'w').write(json.dumps(recs, default=str))")
    sm90_compile.run(tmp_path, ["-c", code])
    for r in json.loads(out.read_text()):
        assert r["ok"], r.get("error", "")[-3000:]
        assert r["stack_bytes"] == 0 and r["local_loads"] == r["local_stores"] == 0
        assert r["shared_bytes"] <= 232448
        assert r["tma_loads"] == 8
        assert all(m["block_size"] == [32, 128] and m["swizzle"] == 0
                   for m in r["tensordesc_meta"])
        assert "setmaxnreg.dec.sync.aligned.u32 40" in r["setmaxnreg"]
        assert (r["gdc_waits"], r["gdc_launches"]) == (2, 1)
