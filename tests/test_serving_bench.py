"""profiling/bench_serve.py end to end on CPU (--smoke: tiny-llama, 4 streaming clients) before
it costs GPU time: the direct and the HTTP runs give the same tokens, the JSON holds the ratio
and the client-side percentiles, no page is left held."""

import json

import pytest

pytest.importorskip("uvicorn")


def test_bench_serve_smoke(tmp_path, capsys):
    from profiling import bench_serve
    out = tmp_path / "bench.json"
    bench_serve.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    (r,) = result["rounds"]
    assert r["same_tokens"] and r["http"]["tokens"] == 4 * 8 and not r["http"]["errors"]
    assert r["ratio"] > 0 and {"p50", "p90", "p99"} <= set(r["http"]["ttft_s"])
    assert result["pages_used_after"] == [0]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("summary: 4 streaming")
    assert r["http"]["slowest_step"]["ms"] > 0 and r["http"]["slowest_step"]["tokens"] > 0


def test_bench_host_step_runs_the_decode_path():
    """profiling/bench_host_step.py: decode steps at the batch asked for, every phase timed,
    the model's work stubbed (what is left is host work)."""
    from profiling import bench_host_step
    rec = bench_host_step.measure(batch=3, steps=4, repeats=2)
    assert rec["batch"] == 3 and len(rec["host_ms_runs"]) == 2 and rec["host_ms_per_step"] > 0
    assert set(rec["phase_ms_last_run"]) == {"schedule", "prepare", "graph inputs", "resolve"}
