"""The planner (helix.perf.planner), hardware files (helix.perf.hardware) and `helix plan`:
ranking sanity where the physics is clear, capacity, HOP-B exposure, one-line YAML errors, and
the command's output in-process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import pytest

from helix.config import Layout
from helix.errors import ConfigError, HelixError
from helix.loader import read_model_config
from helix.perf.hardware import HARDWARE_DIR, load_hardware
from helix.perf.planner import candidate_layouts, plan, predict


@pytest.fixture(scope="module")
def h200():
    return load_hardware("h200")


def _best(rows, helix: bool):
    return min((r for r in rows if (r.layout.kvp > 1) == helix), key=lambda r: r.step_ms)


def test_mla_on_8_gpus_at_long_context_helix_beats_tp(h200):
    """TP-8 reads the whole latent cache on every GPU; Helix KVP 8 reads 1/8 of it: faster, and
    8x the KV capacity (8 full-width DeepSeek-V3 layers fit 8 H200s in bf16)."""
    cfg = read_model_config("deepseek-v3", 8)[0]
    rows = plan(cfg, 8, batch=8, context=262144, hw=h200)
    helix, tp = _best(rows, True), _best(rows, False)
    assert helix.layout.kvp == 8 and tp.layout.tpa == 8
    assert helix.step_ms < 0.8 * tp.step_ms
    assert helix.max_batch >= 7 * tp.max_batch
    assert rows[0].layout.kvp == 8                                # ranked first


def test_gqa_with_8_kv_heads_on_8_gpus_at_short_context_tp_is_no_worse(h200):
    """TP-8 splits 8 KV heads without copies: Helix reads the same bytes and adds an exchange."""
    cfg = read_model_config("llama-3.1-70b")[0]
    rows = plan(cfg, 8, batch=8, context=4096, hw=h200)
    assert _best(rows, False).step_ms <= _best(rows, True).step_ms
    assert rows[0].layout.kvp == 1


def test_tp_baseline_replicates_kv_beyond_the_kv_heads(h200):
    cfg = read_model_config("llama-3.1-70b")[0]                    # 8 KV heads
    tp = predict(cfg, Layout(kvp=1, tpa=16), 1, 32768, h200)       # each head held twice
    helix = predict(cfg, Layout(kvp=2, tpa=8, kv_interleave=64), 1, 32768, h200)
    assert tp.kv_gib == pytest.approx(2 * helix.kv_gib)
    with pytest.raises(ConfigError, match="divide"):
        predict(cfg, Layout(kvp=2, tpa=16), 1, 32768, h200)       # validated like any layout


def test_candidate_layouts_are_the_valid_ones():
    cfg = read_model_config("tiny-llama")[0]                       # 8 heads, 2 KV heads
    got = {(x.kvp, x.tpa) for x in candidate_layouts(cfg, 4)}
    assert got == {(1, 4), (2, 2), (4, 1)}                         # Helix tpa must divide 2 heads
    moe = read_model_config("tiny-deepseek-v3")[0]                 # MLA: tpa = 1 unless kvp = 1
    assert {(x.kvp, x.tpa, x.ep) for x in candidate_layouts(moe, 2)} == {
        (1, 2, 1), (1, 2, 2), (2, 1, 1), (2, 1, 2)}


def test_hopb_hides_the_exchange_under_long_attention(h200):
    cfg = read_model_config("deepseek-v3", 4)[0]
    lay = Layout(kvp=8, tpa=1, ep=8, kv_interleave=64)
    one = predict(cfg, lay, 16, 1 << 20, h200, hopb=1)
    two = predict(cfg, lay, 16, 1 << 20, h200, hopb=2)
    assert two.comm_ms < one.comm_ms                               # half the exchanges hidden
    # short attention: nothing to hide behind, the extra micro-batch only adds its fixed costs
    short1 = predict(cfg, lay, 16, 1024, h200, hopb=1)
    short4 = predict(cfg, lay, 16, 1024, h200, hopb=4)
    assert short4.step_ms > short1.step_ms
    with pytest.raises(ConfigError, match="hopb=4 needs at least 4 requests"):
        predict(cfg, lay, 2, 1024, h200, hopb=4)


def test_capacity_marks_what_does_not_fit(h200):
    cfg = read_model_config("deepseek-v3")[0]                      # 671B in bf16: 8 H200s are short
    rows = plan(cfg, 8, 1, 4096, h200)
    assert rows and not any(r.fits for r in rows) and not any(r.weights_fit for r in rows)
    cfg = read_model_config("llama-3.1-8b")[0]
    p = predict(cfg, Layout(), 1, 8192, h200)
    assert p.fits and p.max_context > 8192
    q = predict(cfg, Layout(), p.max_batch + 1, 8192, h200)
    assert not q.fits and q.max_context < 8192


# -- hardware files ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(HARDWARE_DIR)))
def test_committed_hardware_files_load(name):
    hw = load_hardware(name)
    assert hw.hbm_gib > hw.reserve_gib > 0 and hw.read_bps > 0 and hw.nvlink.domain_gpus >= 8


def _hw_variant(tmp_path, edit):
    text = open(os.path.join(HARDWARE_DIR, "h200.yaml")).read()
    path = tmp_path / "hw.yaml"
    path.write_text(edit(text))
    return str(path)


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace("kernel_us:", "kernel_usec:"), r"hw.yaml:\d+: unknown key 'kernel_usec'"),
    (lambda t: t.replace("matmul_tflops: 790", "matmul_tflops: fast"),
     r"hw.yaml:\d+: 'matmul_tflops' must be a non-negative number"),
    (lambda t: t.replace("  hop_us: 1.5", "  hops_us: 1.5", 1), r"unknown key 'nvlink.hops_us'"),
    (lambda t: t.replace("  domain_gpus: 8", "  domain_gpus: 8.5"),
     r"'domain_gpus' must be a non-negative integer"),
    (lambda t: t.replace("mla_attention_efficiency: 0.44", "mla_attention_efficiency: 44"),
     r"fraction of the peak"),
    (lambda t: "\n".join(x for x in t.splitlines() if not x.startswith("copy_tbps")),
     r"missing key 'copy_tbps'"),
    (lambda t: re.sub(r"nvlink:\n(  .*\n)+", "nvlink: 400\n", t),
     r"hw.yaml:\d+: 'nvlink' must be a mapping"),
    (lambda t: t + "\nbad: [1,\n", r"hw.yaml:\d+:\d+: invalid YAML"),
])
def test_hardware_errors_are_one_line_with_the_key_and_line(tmp_path, edit, words):
    with pytest.raises(ConfigError, match=words) as e:
        load_hardware(_hw_variant(tmp_path, edit))
    assert "\n" not in str(e.value)


def test_unknown_hardware_name_lists_the_presets():
    with pytest.raises(ConfigError, match="h200"):
        load_hardware("tpu-v9")


# -- helix plan --------------------------------------------------------------------------------

def _plan(*argv):
    from helix.commands import plan as plan_cmd
    p = argparse.ArgumentParser()
    plan_cmd.add_parser(p.add_subparsers())
    args = p.parse_args(["plan", *argv])
    return args.func(args)


def test_plan_table(capsys):
    assert _plan("--model", "deepseek-v3", "--layers", "8", "--gpus", "8", "--batch", "8",
                 "--context", "262144") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("helix plan: deepseek-v3 on 8 x NVIDIA H200")
    rows = [x for x in out if x[:5].strip().rstrip("*").isdigit()]
    assert rows[0].split()[1:3] == ["kvp=8", "tpa=1"]
    tp = [x for x in rows if x[4] == "*"]
    assert len(tp) == 1 and "1.00x" in tp[0]                      # the baseline is always shown
    assert all(x.rstrip().endswith("yes") for x in rows)


def test_plan_json_keeps_the_tp_baseline_when_cut(capsys):
    assert _plan("--model", "tiny-llama", "--gpus", "4", "--batch", "4", "--context", "4096",
                 "--hardware", "b200", "--top", "1", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["name"] == "NVIDIA B200"
    assert any(r["tp_baseline"] for r in out["rows"])
    assert [r["rank"] for r in out["rows"]] == sorted(r["rank"] for r in out["rows"])
    for r in out["rows"]:
        assert r["tokens_per_s_gpu"] == pytest.approx(4 * 1e3 / r["step_ms"] / 4)


def test_plan_user_errors(tmp_path):
    with pytest.raises(HelixError, match="--batch must be >= 1"):
        _plan("--model", "tiny-llama", "--gpus", "2", "--batch", "0", "--context", "64")
    with pytest.raises(ConfigError, match="no layout of 3 GPUs"):
        _plan("--model", "tiny-llama", "--gpus", "3", "--batch", "1", "--context", "64")
    with pytest.raises(ConfigError, match="not found"):
        _plan("--model", "tiny-llama", "--gpus", "2", "--batch", "1", "--context", "64",
              "--hardware", str(tmp_path / "none.yaml"))


def test_kernel_constant_moves_the_prediction(h200):
    cfg = read_model_config("llama-3.1-8b", 4)[0]
    base = predict(cfg, Layout(), 1, 1024, h200)
    slower = predict(cfg, Layout(), 1, 1024,
                     dataclasses.replace(h200, kernel_us=h200.kernel_us + 1))
    # one more microsecond per kernel, times the step's kernels, times the graph factor
    from helix.perf.cost import step_cost
    n = step_cost(cfg, Layout(), 1, 1024).kernels
    assert slower.step_ms - base.step_ms == pytest.approx(1e-3 * n * h200.graph_step_factor)


def test_fp8_experts_stream_at_their_measured_fraction(h200):
    """With fp8 weights the MoE phase's bytes stream at fp8_expert_efficiency of the read
    rate (the one-row launch's measured rate against bf16's, profiling/results/fp8_row.md);
    the other phases and every 16-bit phase are untouched by it."""
    from helix.layers import fp8
    from helix.perf.cost import step_cost
    cfg = read_model_config("deepseek-v2-lite")[0]
    es = fp8.element_bytes("fp8", 2)
    full = dataclasses.replace(h200, fp8_expert_efficiency=1.0)
    got = predict(cfg, Layout(), 1, 32768, h200, weight_es=es)
    ref = predict(cfg, Layout(), 1, 32768, full, weight_es=es)
    moe = next(p for p in step_cost(cfg, Layout(), 1, 32768, weight_es=es).phases
               if p.name == "moe")
    eff = h200.fp8_expert_efficiency
    assert eff < 1
    extra = moe.count * moe.nbytes / h200.read_bps * (1 / eff - 1)       # bytes-bound phase
    assert got.phases_ms["moe"] - ref.phases_ms["moe"] == pytest.approx(1e3 * extra)
    for name in got.phases_ms:
        if name != "moe":
            assert got.phases_ms[name] == pytest.approx(ref.phases_ms[name])
    assert (predict(cfg, Layout(), 1, 32768, h200).step_ms
            == pytest.approx(predict(cfg, Layout(), 1, 32768, full).step_ms))
