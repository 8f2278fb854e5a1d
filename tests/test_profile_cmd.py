"""`helix profile`: the trace tables (kernels by correlation to their launch, innermost
`helix.*` range, steps, phases carried from an eager step to a graph step by aligning kernel
names) on hand-made traces, and the command end to end on CPU (tiny model, a Chrome trace that
loads, tables whose phases add up, sweep points, mistakes as one-line errors)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from helix.commands import profile
from helix.commands import trace_tables as tt
from helix.errors import ConfigError


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": args}


def _gpu_trace():
    """Two steps; step 1: q_proj (in helix.layer[0].qkv), attention (helix.layer[0].attn
    inside helix.layer[0]), a memcpy outside any range; step 2: the same kernels from one graph
    launch (correlation 9)."""
    return [
        _x("helix.step", "user_annotation", 0, 100),
        _x("helix.layer[0]", "user_annotation", 1, 50),
        _x("helix.layer[0].qkv", "user_annotation", 2, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 3, 1, correlation=1),
        _x("helix.layer[0].attn", "user_annotation", 20, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 21, 1, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 40, 1, correlation=3),     # layer, not attn
        _x("cudaMemcpyAsync", "cuda_runtime", 70, 1, correlation=4),
        _x("gemm", "kernel", 5, 7.0, tid=7, correlation=1),
        _x("mla_split", "kernel", 25, 20.0, tid=7, correlation=2),
        _x("norm", "kernel", 45, 3.0, tid=7, correlation=3),
        _x("Memcpy HtoD", "gpu_memcpy", 71, 2.0, tid=8, correlation=4),
        _x("helix.step", "user_annotation", 200, 100),
        _x("helix.step", "gpu_user_annotation", 214, 40, tid=7),   # the GPU timeline's copy
        _x("cudaGraphLaunch", "cuda_runtime", 210, 1, correlation=9),
        _x("gemm", "kernel", 215, 6.0, tid=7, correlation=9),
        _x("mla_split", "kernel", 222, 18.0, tid=7, correlation=9),
        _x("norm", "kernel", 241, 3.0, tid=7, correlation=9),
        _x("argmax", "kernel", 245, 1.0, tid=7, correlation=9),
    ]


def test_device_ops_attribution_and_steps():
    ev = _gpu_trace()
    ops = tt.attribute(tt.device_ops(ev), ev, exclude=("helix.step",))
    assert [(o.name, o.phase) for o in ops] == [
        ("gemm", "layer.qkv"), ("mla_split", "layer.attn"), ("norm", "layer"),
        ("Memcpy HtoD", tt.NO_RANGE), ("gemm", tt.NO_RANGE), ("mla_split", tt.NO_RANGE),
        ("norm", tt.NO_RANGE), ("argmax", tt.NO_RANGE)]
    steps = tt.split_steps(ops, ev, "helix.step")
    assert [[o.name for o in s] for s in steps] == [
        ["gemm", "mla_split", "norm", "Memcpy HtoD"], ["gemm", "mla_split", "norm", "argmax"]]
    # the graph step's kernels take the eager step's phases by name alignment
    assert tt.transfer_phases(steps[0], steps[1]) == 3
    assert [o.phase for o in steps[1]] == ["layer.qkv", "layer.attn", "layer", "(unattributed)"]
    table = tt.kernel_table(ops, steps=2)
    assert table[0]["name"] == "mla_split" and table[0]["calls_per_step"] == 1.0
    assert table[0]["us_per_step"] == pytest.approx(19.0)
    assert sum(r["pct"] for r in table) == pytest.approx(100.0)
    phases = {r["name"]: r for r in tt.phase_table(ops, steps=2)}
    assert phases["layer.attn"]["us_per_step"] == pytest.approx(19.0)
    assert phases["(unattributed)"]["us_per_step"] == pytest.approx(0.5)


def test_critical_table_counts_what_each_kernel_adds_to_the_span():
    def op(name, start, dur):
        return tt.Op(name, dur, start, 7, start)
    # b is resident (PDL) from 2 and waits under a until 10; d starts after a gap and ends
    # inside c, which began first
    step = [op("a", 0, 10), op("b", 2, 12), op("c", 15, 5), op("d", 16, 2)]
    rows = {r["name"]: r for r in tt.critical_table([step, step])}
    assert {k: r["us_per_step"] for k, r in rows.items()} == {"a": 10, "b": 4, "c": 2, "d": 4}
    assert sum(r["us_per_step"] for r in rows.values()) == pytest.approx(20.0)   # the span
    assert rows["b"]["calls_per_step"] == 1.0
    assert sum(r["pct"] for r in rows.values()) == pytest.approx(100.0)
    assert tt.critical_table([]) == []


def test_cpu_trace_uses_top_level_operators():
    ev = [_x("helix.step", "user_annotation", 0, 100),
          _x("helix.moe", "user_annotation", 10, 50),
          _x("aten::linear", "cpu_op", 11, 20), _x("aten::matmul", "cpu_op", 12, 15),
          _x("aten::mm", "cpu_op", 13, 10), _x("aten::add", "cpu_op", 40, 5),
          _x("aten::add", "cpu_op", 70, 5), _x("aten::mm", "cpu_op", 12, 3, tid=2)]
    ops = tt.attribute(tt.device_ops(ev), ev, exclude=("helix.step",))
    assert sorted((o.name, o.phase, o.tid) for o in ops) == [
        ("aten::add", tt.NO_RANGE, 1), ("aten::add", "moe", 1), ("aten::linear", "moe", 1),
        ("aten::mm", tt.NO_RANGE, 2)]


def test_phase_names_and_table_text():
    assert tt.phase_name("helix.layer[12].attn") == "layer.attn"
    assert tt.phase_name("helix.decode_graph[8]") == "decode_graph"
    rows = [{"name": "k" * 200, "us_per_step": 5.0, "calls_per_step": 1.0, "pct": 50.0},
            {"name": "b", "us_per_step": 3.0, "calls_per_step": 2.0, "pct": 30.0},
            {"name": "c", "us_per_step": 2.0, "calls_per_step": 1.0, "pct": 20.0}]
    text = tt.format_table(rows, "title", "kernel", width=20, top=1)
    assert "k" * 17 + "..." in text and "(2 more)" in text and "50.0" in text


def _parse(argv):
    ap = argparse.ArgumentParser()
    profile.add_parser(ap.add_subparsers())
    return ap.parse_args(["profile", *argv])


def test_profile_end_to_end_cpu(tmp_path, monkeypatch, capsys):
    """A tiny MLA + MoE model on CPU with `helix.attn` ranges around attention: the trace loads
    as Chrome JSON, the kernel table has the step's operators, and the attention phase gets
    the operators launched inside it."""
    from torch.profiler import record_function
    from helix.layers.attention_mla import MLAAttention
    real = MLAAttention.forward

    def ranged(self, *a, **kw):
        with record_function("helix.attn"):
            return real(self, *a, **kw)

    monkeypatch.setattr(MLAAttention, "forward", ranged)
    out, js = tmp_path / "trace.json", tmp_path / "s.json"
    args = _parse(["--model", "tiny-deepseek-v3", "--device", "cpu", "--layers", "2",
                   "--batch", "2", "--context", "40", "--steps", "2", "--warmup", "1",
                   "--out", str(out), "--json", str(js), "--top", "5"])
    assert args.func is profile.run and args.func(args) == 0
    trace = json.loads(out.read_text())
    assert any(e.get("name") == "helix.step" for e in trace["traceEvents"])
    s = json.loads(js.read_text())
    assert s["batch"] == 2 and s["context"] == 40 and s["steps"] == 2
    names = {r["name"] for r in s["kernels"]}
    assert "aten::einsum" in names and s["ops_per_step"] > 10
    phases = {r["name"]: r for r in s["phases"]}
    assert phases["attn"]["us_per_step"] > 0 and phases[tt.NO_RANGE]["us_per_step"] > 0
    assert sum(r["us_per_step"] for r in s["phases"]) == pytest.approx(
        s["device_ms_per_step"] * 1e3)
    text = capsys.readouterr().out
    assert "(a) per kernel" in text and "(b) per phase" in text


def test_profile_sweep_point(tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("model: tiny-llama\nlayers: 1\ndevice: cpu\nbatches: [1, 3]\n"
                     "contexts: [24, 48]\nmax_batch_tokens: 100\n")
    # points in sweep order: (1, 24), (1, 48), (3, 24); (3, 48) is over the token budget
    s, model, layout, batch, context = profile._point(_parse(["--sweep", str(sweep),
                                                              "--point", "2", "--steps", "3"]))
    assert (model, batch, context) == ("tiny-llama", 3, 24)
    assert s.batches == (3,) and s.contexts == (24,) and s.decode_steps >= 3 * 3
    with pytest.raises(ConfigError, match="give 0 .. 2"):
        profile._point(_parse(["--sweep", str(sweep), "--point", "3"]))
    with pytest.raises(ConfigError, match="--model"):
        profile._point(_parse([]))
    with pytest.raises(ConfigError, match="--steps"):
        profile._point(_parse(["--model", "tiny-llama", "--steps", "0"]))


def test_profile_cli_defaults_follow_the_device():
    s, *_ = profile._point(_parse(["--model", "tiny-llama", "--device", "cpu"]))
    assert s.runtime["attention_backend"] == "torch" and s.runtime["dtype"] == "float32"
    if torch.cuda.is_available():
        s, *_ = profile._point(_parse(["--model", "tiny-llama"]))
        assert s.runtime["attention_backend"] == "triton"
