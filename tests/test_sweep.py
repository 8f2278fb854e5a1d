"""YAML latency sweeps: records for every point, KV accounting per rank, what really ran, floors,
the CSV with the speedup over the TP baseline, --resume, and one-line errors for bad sweep files
(from the API and from the CLI, before any process starts). One sweep run (three layouts) is
shared by the tests of its output."""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import os
import subprocess
import sys

import pytest

from helix.config import RuntimeConfig
from helix.errors import ConfigError, HelixError
from helix.sweep import load_sweep, run_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GOOD = """
name: t
model: tiny-llama
device: cpu
layouts: [{kvp: 1, tpa: 1}, {kvp: 2, tpa: 1}]
batches: [2]
contexts: [9]
decode_steps: 3
warmup_steps: 1
"""


def _write(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return str(path)


THREE = GOOD.replace("layouts: [{kvp: 1, tpa: 1}, {kvp: 2, tpa: 1}]",
                     "layouts: [{kvp: 1, tpa: 1}, {kvp: 2, tpa: 1}, {kvp: 1, tpa: 2}]")


def sweep_cmd(*argv: str) -> tuple[int, str]:
    """`helix sweep ...` in this process; returns (exit code, stdout)."""
    from helix.commands import sweep as sweep_command
    p = argparse.ArgumentParser()
    sweep_command.add_parser(p.add_subparsers())
    args = p.parse_args(["sweep", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.func(args)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One run of the sweep command over 3 layouts (world 1, Helix KVP 2, TP-2)."""
    d = tmp_path_factory.mktemp("sweep")
    path = d / "sweep.yaml"
    path.write_text(THREE)
    out = d / "records.json"
    code, stdout = sweep_cmd(str(path), "--out", str(out))
    assert code == 0
    return {"yaml": str(path), "out": str(out), "csv": str(d / "records.csv"), "stdout": stdout,
            "records": json.loads(out.read_text())}


def _by_layout(records):
    return {(r["layout"]["kvp"], r["layout"]["tpa"]): r for r in records}


def test_sweep_records_every_point_with_kv_per_rank(swept):
    records = swept["records"]
    assert [(r["layout"]["kvp"], r["layout"]["tpa"], r["batch"], r["context"]) for r in records] \
        == [(1, 1, 2, 9), (2, 1, 2, 9), (1, 2, 2, 9)]
    for r in records:
        assert r["step_ms_median"] > 0 and r["step_ms_p90"] >= r["step_ms_median"]
        # each request wrote its prompt and one token per decode step (warm-up included), and
        # the TP baseline writes every position on both ranks
        assert sum(r["kv_tokens_per_rank"]) == r["layout"]["tpa"] * 2 * (9 + 4)
    by = _by_layout(records)
    assert by[(2, 1)]["kv_tokens_per_rank"] == [14, 12]   # positions 0..12 round-robin on 2 ranks


def test_records_say_what_ran(swept):
    for r in swept["records"]:
        # requested (the sweep default) but CPU steps never replay a captured graph
        assert r["cuda_graphs"] is False and r["graph_breaks"] == []
        assert r["attention_backend"] == "torch" and r["overlap"] is False
        assert r["world_size"] == r["layout"]["kvp"] * r["layout"]["tpa"]
        assert r["rates"]["device"] == "cpu" and r["rates"]["read_gbps"] > 0
        assert r["floor_ms"] > 0
        assert r["floor_ratio"] == pytest.approx(r["step_ms_median"] / r["floor_ms"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / r["world_size"])
        # intervals between returns include the driver's broadcast: never below the engine's own
        assert r["step_ms_median"] >= 0.9 * r["engine_ms_median"]
    lines = swept["stdout"].splitlines()
    assert lines[0].startswith("helix sweep t: tiny-llama") and "rates (cpu" in lines[3]
    assert sum("step" in x and "floor" in x for x in lines) == 3


def test_speedup_vs_tp_and_csv(swept):
    by = _by_layout(swept["records"])
    assert by[(1, 2)]["speedup_vs_tp"] == 1.0
    assert by[(2, 1)]["speedup_vs_tp"] == pytest.approx(
        by[(1, 2)]["step_ms_median"] / by[(2, 1)]["step_ms_median"])
    assert by[(1, 1)]["speedup_vs_tp"] == 1.0                  # world 1 is its own TP baseline
    want = f"  tiny-llama kvp=2 tpa=1: B=2 ctx=9 {by[(2, 1)]['speedup_vs_tp']:.2f}x"
    assert want in swept["stdout"].splitlines()                # the closing summary
    with open(swept["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    cols = list(rows[0])
    assert cols[:4] == ["sweep", "model", "layout.kvp", "layout.tpa"]
    for c in ("speedup_vs_tp", "floor_ms", "floor_ratio", "cuda_graphs", "rates.read_gbps"):
        assert c in cols
    for row, rec in zip(rows, swept["records"]):
        assert float(row["step_ms_median"]) == pytest.approx(rec["step_ms_median"])
        assert row["kv_tokens_per_rank"] == ";".join(map(str, rec["kv_tokens_per_rank"]))


def test_speedup_is_empty_without_a_tp_baseline():
    from helix.perf.records import add_speedup_vs_tp
    recs = [{"sweep": "s", "model": "m", "layout": {"kvp": 2, "tpa": 1}, "batch": 1, "context": 8,
             "step_ms_median": 1.0}]
    assert add_speedup_vs_tp(recs)[0]["speedup_vs_tp"] is None


def test_resume_runs_only_the_missing_points(swept, tmp_path):
    out = tmp_path / "partial.json"
    kept = [r for r in swept["records"] if r["layout"]["tpa"] == 1 and r["layout"]["kvp"] == 2]
    out.write_text(json.dumps(kept))
    only_world_1 = THREE.replace("{kvp: 1, tpa: 2}", "{kvp: 2, tpa: 1}").replace(
        ", {kvp: 2, tpa: 1}, {kvp: 2, tpa: 1}", ", {kvp: 2, tpa: 1}")
    path = tmp_path / "sweep.yaml"
    path.write_text(only_world_1)
    code, stdout = sweep_cmd(str(path), "--out", str(out), "--csv", str(tmp_path / "x.csv"),
                             "--resume")
    assert code == 0
    assert "points: 1 to run of 2, 1 already in" in stdout
    got = json.loads(out.read_text())
    strip = lambda r: {k: v for k, v in r.items() if k != "speedup_vs_tp"}  # noqa: E731
    assert strip(got[0]) == strip(kept[0])                     # kept as measured, first
    assert got[0]["speedup_vs_tp"] is None                     # its TP-2 peer is not in this sweep
    assert [(r["layout"]["kvp"], r["layout"]["tpa"]) for r in got] == [(2, 1), (1, 1)]
    code, stdout = sweep_cmd(str(path), "--out", str(out), "--resume")   # nothing left
    assert code == 0 and "points: 0 to run of 2" in stdout and len(json.loads(out.read_text())) == 2


def test_sweep_command_user_errors(tmp_path, monkeypatch):
    path = tmp_path / "s.yaml"
    path.write_text(GOOD)
    with pytest.raises(HelixError, match="--resume reads the records of --out"):
        sweep_cmd(str(path), "--resume")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"not\": \"a list\"}")
    with pytest.raises(ConfigError, match="not a list of sweep records"):
        sweep_cmd(str(path), "--out", str(bad), "--resume")
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # as if not installed
    out = tmp_path / "r.json"
    with pytest.raises(HelixError, match=r"pip install 'helix-decode\[plot\]'"):
        sweep_cmd(str(path), "--out", str(out), "--plot", str(tmp_path / "plots"))
    assert not out.exists()                                  # refused before running anything


def test_plots_of_the_records(swept, tmp_path):
    pytest.importorskip("matplotlib")
    from helix.perf.plots import plot_sweep
    paths = plot_sweep(swept["records"], str(tmp_path), stem="t")
    assert [os.path.basename(p) for p in paths] == ["t_ttl.png", "t_pareto.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_yaml_syntax_errors_name_line_and_column(tmp_path):
    with pytest.raises(ConfigError, match=r"sweep.yaml:3:1: invalid YAML"):
        load_sweep(_write(tmp_path, "model: tiny-llama\nbatches: [1\n"))


def test_hopb_key_follows_the_runtime(tmp_path):
    path = _write(tmp_path, "model: tiny-llama\ndevice: cpu\nhopb: 2\n")
    if "hopb" in {f.name for f in dataclasses.fields(RuntimeConfig)}:
        assert load_sweep(path).runtime["hopb"] == 2
    else:
        with pytest.raises(ConfigError, match="unknown key.*hopb"):
            load_sweep(path)


@pytest.mark.parametrize("text, words", [
    ("model: tiny-llama\nbatches: [1\n", "invalid YAML"),
    ("model: tiny-llama\nbatchez: [1]\n", "unknown key(s) batchez"),
    ("model: tiny-llama\nlayouts: [{kvp: 2, tp: 1}]\n", "unknown layout key(s) tp"),
    ("model: tiny-llama\nbatches: [0]\n", "'batches' must be a non-empty list"),
    ("model: tiny-llama\nlayers: many\n", "'layers' must be a non-negative integer"),
    ("model: tiny-llama\ndtype: float8\n", "unknown dtype"),
    ("batches: [1]\n", "give 'model: NAME'"),
    ("- 1\n- 2\n", "a sweep is a mapping"),
])
def test_bad_sweep_files_fail_with_one_line(tmp_path, text, words):
    with pytest.raises(ConfigError,
                       match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_sweep(_write(tmp_path, text))


def test_cli_rejects_an_invalid_layout_before_running(tmp_path):
    path = _write(tmp_path, "model: tiny-llama\ndevice: cpu\nlayouts: [{kvp: 3, tpa: 1}]\n")
    res = subprocess.run([sys.executable, "-m", "helix.cli", "sweep", path],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith("helix: error:")
            and "use one of 1, 2, 4, 8" in lines[0])
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_points_over_the_token_budget_are_skipped(tmp_path):
    sweep = load_sweep(_write(tmp_path, "model: tiny-llama\ndevice: cpu\nbatches: [1, 2]\n"
                                        "contexts: [9, 20]\nmax_batch_tokens: 20\ndecode_steps: 1\n"
                                        "warmup_steps: 0\n"))
    points = [(r["batch"], r["context"]) for r in run_sweep(sweep)]
    assert points == [(1, 9), (1, 20), (2, 9)]


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "configs", "sweeps"))))
def test_committed_sweeps_load_and_their_layouts_hold(name):
    """Every sweep file in configs/sweeps/ parses, and each of its layouts is valid for each of
    its models (what `helix sweep` checks before starting any process)."""
    from helix.sweep import check
    sweep = load_sweep(os.path.join(ROOT, "configs", "sweeps", name))
    check(sweep)
    assert sweep.models and sweep.layouts
