"""profiling/bench_step_kernels.py end to end on CPU before it costs GPU time: every part with
tiny shapes (kernels in Triton's interpreter, timing and the copy rate stubbed), records and the
summary; the old / new kernel switch of part (d)."""

import json

import torch

from triton_mode import ON_GPU  # first: chooses the interpreter before triton loads

import pytest  # noqa: E402

from helix.layers import fused_moe as fm  # noqa: E402
from helix.layers import router as rt  # noqa: E402
from helix.layers import triton_router as tr  # noqa: E402
from helix.attention import triton_mla_few  # noqa: E402
from profiling import bench_step_kernels as bench  # noqa: E402


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the real bench")
def test_bench_runs_on_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench, "L2Flush", lambda: None)
    monkeypatch.setattr(bench, "graph_time_us", lambda fn, iters, flush: (fn(), 10.0)[1])
    monkeypatch.setattr(bench, "ROUTERS", {
        "v3-like": (tr.RouteSpec(2, True, 4, 2, "top2", True, 2.5), 8, 32, torch.float32)})
    monkeypatch.setattr(bench, "EXPERTS", {"tiny": (4, 16, 32, 2)})
    monkeypatch.setattr(bench, "MOE_VARIANTS", [bench.MOE_VARIANTS[0], bench.MOE_VARIANTS[6]])
    monkeypatch.setattr(bench, "MLA_SHAPE", (4, 16, 16, 16))
    monkeypatch.setattr(bench, "MLA_VARIANTS", [bench.MLA_VARIANTS[1]])
    monkeypatch.setattr(rt.Router, "forward", rt.Router.forward)       # restored afterwards
    monkeypatch.setattr(fm, "VARIANT", fm.VARIANT)
    monkeypatch.setattr(triton_mla_few, "MODE", triton_mla_few.MODE)
    out = tmp_path / "r.json"
    bench.main(["--out", str(out), "--iters", "1", "--moe-batches", "1,3",
                "--mla-contexts", "32", "--step-contexts", "32,64", "--step-steps", "2",
                "--step-model", "tiny-deepseek-v3", "--step-layers", "2"])
    recs = json.loads(out.read_text())["records"]
    parts = [r["part"] for r in recs]
    assert parts.count("router") == 2 * 4 and parts.count("moe") == 2 * 2
    assert parts.count("mla") == 2 and parts.count("step") == 2 * 3
    assert all(r["ids_equal_rows"] == 1.0 for r in recs if r["part"] == "router")
    assert all(r["rel_err"] < 2e-2 for r in recs if r["part"] == "moe" and r["variant"] != "v1")
    steps = [r for r in recs if r["part"] == "step"]
    assert all(r["kernels_per_step"] > 0 and r["floor_ms"] > 0 for r in steps)
    assert all(r["model"] == "tiny-deepseek-v3" and r["replay_ms"] is None for r in steps)
    assert [(r["mode"], r["batch"]) for r in steps] == [("before", 1), ("before", 1),
                                                        ("before", 8), ("after", 1),
                                                        ("after", 1), ("after", 8)]
    text = capsys.readouterr().out
    assert "(a) router" in text and "(d) tiny-deepseek-v3 step" in text


def test_kernel_switch(monkeypatch):
    monkeypatch.setattr(rt.Router, "forward", rt.Router.forward)
    monkeypatch.setattr(fm, "VARIANT", fm.VARIANT)
    monkeypatch.setattr(triton_mla_few, "MODE", triton_mla_few.MODE)
    monkeypatch.setattr(fm, "FOLD_SHARED", fm.FOLD_SHARED)
    bench.set_kernels("before")
    assert fm.VARIANT == "v1" and not triton_mla_few.routes(16)
    assert rt.Router.forward is bench._legacy_forward
    bench.set_kernels("after-nofew")
    assert fm.VARIANT == "auto" and not triton_mla_few.routes(16)
    assert rt.Router.forward is bench._NEW_FORWARD
    bench.set_kernels("after")
    assert triton_mla_few.routes(16) and fm.VARIANT == "auto" and fm.FOLD_SHARED
    bench.set_kernels("after-nofold")
    assert triton_mla_few.routes(16) and fm.VARIANT == "auto" and not fm.FOLD_SHARED
    bench.set_kernels("after-v1moe")
    assert fm.VARIANT == "v1" and triton_mla_few.routes(16)
    assert rt.Router.forward is bench._NEW_FORWARD
    from helix.attention import triton_backend
    bench.set_kernels("after-gluon-simple")         # the previous Gluon MLA variant, else "after"
    assert triton_backend.GLUON_VARIANT == "simple" and triton_mla_few.routes(16)
    bench.set_kernels("after")
    assert triton_backend.GLUON_VARIANT == "seesaw"
    from helix import triton_util
    monkeypatch.setattr(triton_util, "PDL", True)
    monkeypatch.setattr(bench, "_PDL", True)
    from helix.layers import skinny_gemm
    monkeypatch.setattr(skinny_gemm, "ENABLED", True)
    monkeypatch.setattr(bench, "_SKINNY", True)
    bench.set_kernels("after-nopdl")                # the same kernels launched without PDL
    assert not triton_util.PDL and triton_mla_few.routes(16) and skinny_gemm.ENABLED
    bench.set_kernels("after-cublas")               # the projections in cuBLAS
    assert triton_util.PDL and not skinny_gemm.ENABLED
    bench.set_kernels("after-nopdl-cublas")
    assert not triton_util.PDL and not skinny_gemm.ENABLED
    monkeypatch.setattr(triton_util, "FLAGS", triton_util.PDL_MODES["full"])
    monkeypatch.setattr(bench, "_FLAGS", triton_util.PDL_MODES["full"])
    bench.set_kernels("after-pdl-wait")             # one PDL mode, then back to the default
    assert triton_util.PDL and triton_util.FLAGS == triton_util.PDL_ON
    bench.set_kernels("after-pdl-prefetch")
    assert triton_util.FLAGS == triton_util.PDL_ON | triton_util.PDL_PREFETCH
    from helix.layers import fused_mla
    assert fused_mla.FUSE_ABSORB
    bench.set_kernels("after-noabsorbrow")         # W_UK and the kv row: two launches
    assert not fused_mla.FUSE_ABSORB and skinny_gemm.ENABLED
    monkeypatch.setattr(skinny_gemm, "GEMV", True)
    monkeypatch.setattr(bench, "_GEMV", True)
    assert skinny_gemm.GEMV and skinny_gemm.GEMV_EARLY
    bench.set_kernels("after-nogemv")              # the split-K skinny kernel at <= 4 rows
    assert not skinny_gemm.GEMV and skinny_gemm.ENABLED
    bench.set_kernels("after-gemv-late")           # the GEMV's weights after the wait
    assert skinny_gemm.GEMV and not skinny_gemm.GEMV_EARLY
    from helix.layers import triton_router
    monkeypatch.setattr(triton_router, "ONE_TILE", True)
    bench.set_kernels("after-router-chunked")      # the router over D in chunks
    assert not triton_router.ONE_TILE and skinny_gemm.GEMV
    monkeypatch.setattr(skinny_gemm, "NORM_IN_GEMV", True)
    bench.set_kernels("after-nonormgemv")          # the input norms: their own launches
    assert not skinny_gemm.NORM_IN_GEMV and skinny_gemm.GEMV and triton_router.ONE_TILE
    bench.set_kernels("after-noonetile")           # neither one-tile kernel
    assert not skinny_gemm.GEMV and not triton_router.ONE_TILE and skinny_gemm.ENABLED
    bench.set_kernels("after")
    assert triton_util.PDL and skinny_gemm.ENABLED and triton_router.ONE_TILE
    assert skinny_gemm.NORM_IN_GEMV and skinny_gemm.GEMV
    assert triton_util.FLAGS == triton_util.PDL_MODES["full"]
    assert fused_mla.FUSE_ABSORB and skinny_gemm.GEMV and skinny_gemm.GEMV_EARLY
    from helix.attention import triton_decode
    assert triton_decode.FUSED_MERGE
    bench.set_kernels("after-gqa-twolaunch")       # the GQA decode of b840cd1
    assert not triton_decode.FUSED_MERGE
    bench.set_kernels("after")
    assert triton_decode.FUSED_MERGE
    default = (triton_decode.GQA_WAVES, triton_decode.FUSED_MERGE_ELEMENTS)
    bench.set_kernels("after-gqa-waves1")           # GQA splits aimed at one wave
    assert triton_decode.GQA_WAVES == 1.0
    bench.set_kernels("after-gqa-merge8192")        # the one-launch merge's bound of 1efc800
    assert triton_decode.FUSED_MERGE_ELEMENTS == 8192 and triton_decode.GQA_WAVES == default[0]
    bench.set_kernels("after")
    assert (triton_decode.GQA_WAVES, triton_decode.FUSED_MERGE_ELEMENTS) == default == (2.0, 4096)
    from helix.attention import gluon_mla
    few = gluon_mla.MIN_SPLIT_TOKENS
    bench.set_kernels("after-few-min4")             # "few" splits of at least 4 KV tiles
    assert gluon_mla.MIN_SPLIT_TOKENS["few"] == 4 * gluon_mla.BLOCK_N
    assert gluon_mla.MIN_SPLIT_TOKENS["seesaw"] == few["seesaw"] and few["few"] == gluon_mla.BLOCK_N
    bench.set_kernels("after")
    assert gluon_mla.MIN_SPLIT_TOKENS == few
    with pytest.raises(SystemExit):
        bench.set_kernels("later")


def test_step_moe_overrides_reach_every_moe_decode_launch(monkeypatch):
    """--step-moe-configs: the engine's moe_decode launches take the tunables (explicit configs
    still win); {} restores the defaults."""
    from unittest import mock
    from helix.layers import moe_decode as md
    monkeypatch.setattr(md, "moe_decode_config", md.moe_decode_config)
    default = md.moe_decode_config(1, 6, 64, 1408, 2048, torch.bfloat16, 132)
    bench.overrides({"K_SPLITS": 3, "FUSED_COMBINE": False})
    try:
        c = md.moe_decode_config(1, 6, 64, 1408, 2048, torch.bfloat16, 132, None, 2)
        assert c["K_SPLITS"] == 3 and not c["FUSED_COMBINE"]
        c = md.moe_decode_config(1, 6, 64, 1408, 2048, torch.bfloat16, 132, {"K_SPLITS": 1})
        assert c["K_SPLITS"] == 1
        x = torch.randn(2, 32)
        w = [torch.randn(4, 16, 32), torch.randn(4, 16, 32), torch.randn(4, 32, 16)]
        kernels = []
        with mock.patch.object(md, "run_kernel", lambda k, *a, **kw: kernels.append(k)):
            md.moe_decode(x, *w, torch.rand(2, 2), torch.tensor([[0, 1], [2, 3]]), 0)
        assert kernels[-1] is md._combine_kernel            # the unfused k-sum: a third launch
    finally:
        bench.overrides({})
    assert md.moe_decode_config is bench._MOE_CONFIG
    assert md.moe_decode_config(1, 6, 64, 1408, 2048, torch.bfloat16, 132) == default


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the real bench")
def test_step_floor_is_the_sweeps(monkeypatch, tmp_path):
    """Part (d)'s floor is helix sweep's (helix.sweep.floor_fields at rates measured in the
    run), not a rule of its own: every step record carries that call's floor and rates."""
    import helix.sweep as sweep_mod
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench, "L2Flush", lambda: None)
    seen = []
    real = sweep_mod.floor_fields

    def recorded(llm, layout, batch, context, step_ms, rates):
        out = real(llm, layout, batch, context, step_ms, rates)
        seen.append((batch, context, out))
        return out

    monkeypatch.setattr(sweep_mod, "floor_fields", recorded)
    out = tmp_path / "r.json"
    bench.main(["--out", str(out), "--parts", "d", "--step-contexts", "32", "--step-steps", "2",
                "--step-modes", "after", "--step-model", "tiny-deepseek-v3",
                "--step-layers", "2"])
    steps = [r for r in json.loads(out.read_text())["records"] if r["part"] == "step"]
    assert [(r["batch"], r["context"]) for r in steps] == [(b, c) for b, c, _ in seen]
    for r, (_, _, f) in zip(steps, seen):
        assert r["floor_ms"] == f["floor_ms"] > 0 and r["vs_floor"] == f["floor_ratio"]
        assert r["rates"] == f["rates"] and r["rates"]["device"] == "cpu"


def test_step_trace_reads_the_last_step_launches_relative_to_the_previous_end():
    """--step-trace's reading of gluon_moe.TRACES: launches of the last step only (an older one
    is left out), in start order, each stamp from the previous launch's last program's end."""
    import torch

    from helix.layers import gluon_moe

    def launch(t0, progs=5):
        t = torch.zeros(progs, 8, dtype=torch.int64)
        for i in range(8):
            t[:, i] = t0 + 1000 * i + torch.arange(progs) * 100       # ns; program p 100p later
        return t

    gluon_moe.TRACES[:] = [launch(0), launch(50_000), launch(10_000), launch(30_000)]
    try:
        rec = bench.step_trace(step_ms=0.045)       # 45 us: the launch at 0 ends too early
        assert len(gluon_moe.TRACES) == 4           # kept: a graph's buffers serve every replay
    finally:
        gluon_moe.TRACES.clear()
    assert rec["launches"] == 3 and rec["layer_us"] == 20.0
    # the previous end is t0 - 20 us + 6.4 us (its last program); stamp i of program p is
    # t0 + i us + 0.1 p us: median over programs p = 2, max p = 4
    assert rec["start"] == [13.8, 14.0]
    assert rec["up"] == [17.8, 18.0]
    assert rec["end"] == [19.8, 20.0]
