"""profiling/bench_serve.py end to end on CPU (--smoke: tiny-llama, 4 streaming clients) before
it costs GPU time: the direct and the HTTP runs give the same tokens, the JSON holds the ratio
and the client-side percentiles, no page is left held."""

import json

import pytest

pytest.importorskip("uvicorn")


def test_bench_serve_smoke(tmp_path, capsys):
    from profiling import bench_serve
    out = tmp_path / "bench.json"
    bench_serve.main(["--smoke", "--client-procs", "1,2", "--out", str(out)])
    result = json.loads(out.read_text())
    (r,) = result["rounds"]
    for procs in (1, 2):                  # one client in a thread; two client processes
        http = r[f"http_{procs}"]
        assert r[f"same_tokens_{procs}"] and http["tokens"] == 4 * 8 and not http["errors"]
        assert r[f"ratio_{procs}"] > 0 and {"p50", "p90", "p99"} <= set(http["ttft_s"])
        assert http["slowest_step"]["ms"] > 0 and http["slowest_step"]["tokens"] > 0
        assert len(http["client_cpu"]) == procs and http["server_cpu"] > 0
        assert http["engine_steps"] >= 8 and http["engine_idle_ms"] >= 0
    assert r["ratio"] == r["ratio_1"]
    assert result["pages_used_after"] == [0]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("summary: 4 streaming")


def test_bench_host_step_runs_the_decode_path():
    """profiling/bench_host_step.py: decode steps at the batch asked for, every phase timed,
    the model's work stubbed (what is left is host work)."""
    from profiling import bench_host_step
    rec = bench_host_step.measure(batch=3, steps=4, repeats=2)
    assert rec["batch"] == 3 and len(rec["host_ms_runs"]) == 2 and rec["host_ms_per_step"] > 0
    assert set(rec["phase_ms_last_run"]) == {"schedule", "prepare", "graph inputs", "resolve"}
