"""Per-step cost accounting (helix.perf.cost): bytes, FLOPs and collectives per phase against
hand-computed numbers for the tiny presets, the TP baseline's KV replication rule, MLA, and the
weights / KV cache a rank really allocates (the built model is the oracle)."""

from __future__ import annotations

import itertools

import pytest
import torch

from helix.config import Layout
from helix.loader import read_model_config
from helix.perf.cost import expected_experts_hit, step_cost, weight_bytes


@pytest.fixture(scope="module")
def llama():
    return read_model_config("tiny-llama")[0]  # D 256, H 8, Hkv 2, d 32, I 512, V 1000, 4 layers


@pytest.fixture(scope="module")
def mla():
    return read_model_config("tiny-deepseek-v3")[0]  # D 256, H 8, q_lora 64, lora 64 + rope 16


def _phase(cost, name):
    p = cost.phase(name)
    assert p is not None, name
    return p


def test_gqa_tp_baseline_replicates_one_kv_head_per_rank(llama):
    # TP-4 on 2 KV heads: each rank keeps a copy of the one KV head its 2 query heads read
    c = step_cost(llama, Layout(kvp=1, tpa=4), batch=2, context=100, dtype_bytes=2)
    proj = _phase(c, "attn_proj")
    assert proj.count == 4
    assert proj.nbytes == (256 + 256 * (2 + 2 * 1) * 32) * 2          # norm + q, k, v columns
    assert proj.flops == 2 * 2 * 256 * 128
    att = _phase(c, "attention")
    assert att.nbytes == 2 * 100 * (2 * 1 * 32 * 2)                  # B x T x (K + V of one head)
    assert att.flops == 2 * 2 * 2 * 100 * (32 + 32)                  # QK and PV, 2 local q heads
    assert att.comms == ()                                            # no exchange at kvp = 1
    o = _phase(c, "o_proj")
    assert o.nbytes == 2 * 32 * 256 * 2 and o.flops == 2 * 2 * 2 * 32 * 256
    assert [(x.kind, x.ranks, x.nbytes) for x in o.comms] == [("all_reduce", 4, 2 * 256 * 2)]
    ffn = _phase(c, "ffn")
    assert ffn.count == 4 and ffn.nbytes == (256 + 3 * 256 * 128) * 2
    lm = _phase(c, "lm_head")
    assert lm.nbytes == 256 * 2 + 250 * 256 * 2 + 2 * 1000 * 4       # norm, shard, fp32 logits
    assert [(x.kind, x.nbytes) for x in lm.comms] == [("all_gather", 2 * 250 * 4)]
    assert c.kv_bytes_per_position == 4 * 2 * 32 * 2                  # 4 layers x (K, V) x d x bf16


def test_gqa_helix_reads_its_kvp_share_and_exchanges_o_and_lse(llama):
    c = step_cost(llama, Layout(kvp=2, tpa=2), batch=2, context=100, dtype_bytes=2)
    att = _phase(c, "attention")
    assert att.nbytes == 2 * 50 * (2 * 1 * 32 * 2)                   # KVP rank 0 owns 50 of 100
    assert att.flops == 2 * 2 * 4 * 50 * 64                          # 4 local q heads
    (a2a,) = att.comms
    assert (a2a.kind, a2a.ranks, a2a.nbytes) == ("all_to_all", 2, 2 * 4 * (32 * 2 + 4))
    assert _phase(c, "attn_proj").nbytes == (256 + 256 * (4 + 2) * 32) * 2
    # interleave 16: KVP rank 0 owns positions 0-15 and 32-39 of 40, rank 1 only 16-31
    c = step_cost(llama, Layout(kvp=2, tpa=2, kv_interleave=16), batch=1, context=40)
    assert _phase(c, "attention").nbytes == 24 * (2 * 32 * 2)        # positions 0-15 and 32-39


def test_mla_helix_and_tp_baseline(mla):
    helix = step_cost(mla, Layout(kvp=2, tpa=1, ep=2), batch=1, context=64, dtype_bytes=2)
    tp = step_cost(mla, Layout(kvp=1, tpa=2, ep=2), batch=1, context=64, dtype_bytes=2)
    gemm = 256 * 64 + 64 * 8 * 48 + 8 * 32 * 64 + 256 * (64 + 16)  # q_a, q_b, W_UK, kv_a
    assert _phase(helix, "attn_proj").nbytes == (256 + 64 + 64 + gemm) * 2
    assert _phase(helix, "attn_proj").flops == 2 * gemm
    h_att, t_att = _phase(helix, "attention"), _phase(tp, "attention")
    assert h_att.nbytes == 32 * (64 + 16) * 2                         # half the latent rows
    assert t_att.nbytes == 64 * (64 + 16) * 2                         # TP: the whole latent cache
    assert h_att.flops == t_att.flops == 2 * 8 * 32 * (80 + 64)      # 8 heads x 32 = 4 heads x 64
    assert h_att.comms[0].nbytes == 8 * (64 * 2 + 4)                  # latent O + LSE, 8 heads
    assert _phase(helix, "o_proj").nbytes == (4 * 32 * 64 + 4 * 32 * 256) * 2   # W_UV + o_proj
    assert helix.kv_bytes_per_position == tp.kv_bytes_per_position == 4 * 80 * 2
    moe = _phase(helix, "moe")
    assert moe.count == 3 and _phase(helix, "ffn").count == 1        # first_k_dense_replace 1
    # one token, top-2 of 8 experts, 4 of them on this EP rank: 1 expected; shared sharded over 2
    expert, shared = 3 * 256 * 128, 3 * 256 * 64
    assert moe.nbytes == pytest.approx(256 * 2 + 8 * 256 * 4 + 1.0 * expert * 2 + shared * 2)


def test_expected_experts_hit_matches_enumeration():
    E, k, local = 4, 2, 2
    picks = list(itertools.combinations(range(E), k))
    for tokens in (1, 2, 3):
        hits = [len({e for p in choice for e in p if e < local})
                for choice in itertools.product(picks, repeat=tokens)]
        assert expected_experts_hit(E, k, tokens, local) == pytest.approx(sum(hits) / len(hits))


def test_floor_is_a_per_phase_max_summed(llama):
    c = step_cost(llama, Layout(kvp=1, tpa=1), batch=4, context=256)
    read, mm = 1e9, 1e9
    want = sum(p.count * max(p.nbytes / read, p.flops / mm) for p in c.phases)
    assert c.floor_s(read, mm) == pytest.approx(want)
    assert c.floor_s(read, mm) < c.nbytes / read + c.flops / mm     # not a sum of the two
    assert c.floor_s(read, 1e30) == pytest.approx(c.nbytes / read)  # memory-bound limit


class _Stub:
    """A comm that only answers sizes and the mesh: enough to build one rank's modules."""

    def __init__(self, layout):
        from helix.parallel.mesh import Mesh
        self.mesh = Mesh(layout, 0)

    def size(self, axis):
        lay = self.mesh.layout
        return {"world": lay.world_size, "kvp": lay.kvp, "tpf": lay.tpf}[axis]


@pytest.mark.parametrize("model, layout", [
    ("tiny-llama", Layout(kvp=1, tpa=1)), ("tiny-llama", Layout(kvp=1, tpa=8)),
    ("tiny-llama", Layout(kvp=4, tpa=2)), ("tiny-llama-h6", Layout(kvp=3, tpa=1)),
    ("tiny-deepseek-v3", Layout(kvp=1, tpa=2, ep=2)),
    ("tiny-deepseek-v3", Layout(kvp=4, tpa=1, ep=2)),
    ("tiny-qwen3-moe", Layout(kvp=2, tpa=2, ep=4)),
])
def test_weights_and_kv_match_the_built_rank(model, layout):
    """Rank 0's parameters and KV cache shapes, built on the meta device, are the oracle."""
    from helix.models import build_model
    cfg = read_model_config(model)[0]
    layout.validate(cfg)
    with torch.device("meta"):
        m = build_model(cfg, _Stub(layout), torch.bfloat16, 128)
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    assert weight_bytes(cfg, layout, 2) == params
    per_pos = sum(torch.Size(s).numel() for shapes in m.kv_cache_shapes(1, 1) for s in shapes) * 2
    assert step_cost(cfg, layout, 1, 8).kv_bytes_per_position == per_pos


def test_cpu_rates_are_measured():
    from helix.perf.rates import measure
    r = measure("cpu", "float32")
    assert r.copy_bps > 0 and r.read_bps > 0 and r.matmul_flops > 0
    assert r.hbm_bps == max(r.copy_bps, r.read_bps)
    rec = r.as_record()
    assert rec["device"] == "cpu" and rec["dtype"] == "float32" and rec["read_gbps"] > 0


@pytest.mark.gpu
def test_gpu_rates_are_measured():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from helix.perf.rates import measure
    r = measure("cuda", "bfloat16")
    # an HBM GPU reads and copies at hundreds of GB/s and multiplies at tens of TFLOP/s at least
    assert r.copy_bps > 1e11 and r.read_bps > 1e11 and r.matmul_flops > 1e13
    assert 0.5 < r.read_bps / r.copy_bps < 2.0


@pytest.mark.parametrize("record", ["moe_route/route_dsv2_4362244.json",
                                    "step_small/ropeappend_llama_f1c926a_h200.json",
                                    "moe_route/route_qwen_4362244.json"])
def test_kernel_counts_match_the_profiled_steps(record):
    """The kernels a step launches (cost.Phase.kernels) against whole-model decode steps at one
    row profiled on the H200 (bench_step_kernels part d, graphs on, mode "after"): every
    kernel the profiler saw, less the host staging copies. DeepSeek-V2-Lite's input norms ride
    in its x projection's GEMV (all but layer 0's), Llama-3.1-8B's and Qwen3's do not; GQA's KV
    append rides in the rotation's launch, its split merge in the split launch for Llama at
    1K (8 splits of a 4-head group) and not for Qwen3 (16 heads); the MoE layers of both MoE
    models are gluon_moe's one launch, the router with its add + norm inside. Not at 8 rows:
    projections there run on cuBLAS (skinny_gemm.SKINNY_MAX_WEIGHT_ELEMENTS), whose split-K
    reduce launches the model does not count."""
    import json
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "profiling", "results", record)
    data = json.load(open(path))
    model = data["meta"]["args"]["step_model"]
    layers = data["meta"]["args"]["step_layers"]
    seen = 0
    for r in data["records"]:
        if r["mode"] != "after" or r["batch"] != 1:
            continue
        launched = sum(k["calls_per_step"] for k in r["top_kernels"]
                       if not k["name"].startswith(("Memcpy", "Memset")))
        cfg = read_model_config(model, layers)[0]
        assert step_cost(cfg, Layout(), r["batch"], r["context"]).kernels == launched, r["batch"]
        seen += 1
    assert seen >= 1
