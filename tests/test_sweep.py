"""YAML latency sweeps: records for every point, KV accounting per rank, and one-line errors for
bad sweep files (from the API and from the CLI, before any process starts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helix.errors import ConfigError
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


def test_sweep_records_every_point_with_kv_per_rank(tmp_path):
    sweep = load_sweep(_write(tmp_path, GOOD))
    records = run_sweep(sweep)
    assert [(r["layout"]["kvp"], r["batch"], r["context"]) for r in records] == [(1, 2, 9), (2, 2, 9)]
    for r in records:
        assert r["step_ms_median"] > 0 and r["step_ms_p90"] >= r["step_ms_median"]
        # each request wrote its prompt and one token per decode step (warm-up included)
        assert sum(r["kv_tokens_per_rank"]) == 2 * (9 + 4)
    assert records[1]["kv_tokens_per_rank"] == [14, 12]    # positions 0..12 round-robin on 2 ranks


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
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_sweep(_write(tmp_path, text))


def test_cli_rejects_an_invalid_layout_before_running(tmp_path):
    path = _write(tmp_path, "model: tiny-llama\ndevice: cpu\nlayouts: [{kvp: 3, tpa: 1}]\n")
    res = subprocess.run([sys.executable, "-m", "helix.cli", "sweep", path],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("helix: error:") and "divisible" in lines[0]
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
