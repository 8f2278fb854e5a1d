"""profiling/bench_prefill.py end to end on CPU before it costs GPU time: every part on tiny
presets (the kernels in Triton's interpreter, the engines on the torch backend), its records'
fields, --append and the summary."""

import json

from triton_mode import ON_GPU  # first: chooses the interpreter before triton loads

import pytest  # noqa: E402

from helix.perf.rates import Rates  # noqa: E402
from profiling import bench_prefill as bench  # noqa: E402


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the real bench")
def test_bench_prefill_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda *a: Rates(1e10, 1e10, 1e10, "cpu", "float32"))
    out = tmp_path / "prefill.json"
    bench.main(["--smoke", "--quick", "--iters", "1", "--parts", "a,b", "--out", str(out)])
    bench.main(["--smoke", "--quick", "--iters", "1", "--parts", "c,d", "--out", str(out),
                "--append"])
    data = json.loads(out.read_text())
    recs = data["records"]
    assert data["rates"]["matmul_tflops"] > 0
    gqa = [r for r in recs if r.get("kernel") == "gqa"]
    assert gqa and all(r["sdpa_ratio"] > 0 and r["choice"] == "triton" and r["err_triton"] < 1e-4
                       for r in gqa)
    mla = [r for r in recs if r.get("kernel", "").startswith("mla-")]
    assert len(mla) == 2 and all(r["err_forms"] < 1e-4 and r["floor_fraction"] > 0 for r in mla)
    ttft = [r for r in recs if r["part"] in ("b", "c")]
    assert {(r["part"], r["engine"]) for r in ttft} == {("b", "transformers"), ("b", "helix"),
                                                        ("c", "helix")}
    assert all(r["ttft_s"] > 0 and 0 < r["floor_fraction"] and r["model"] and r["prompt_tokens"]
               for r in ttft)
    join = [r for r in recs if r["part"] == "d"]
    assert [r["mode"] for r in join] == ["alone", "join"]
    assert all(r["tpot_p50_ms"] > 0 and r["tpot_p99_ms"] >= r["tpot_p50_ms"] for r in join)
    text = capsys.readouterr().out
    assert "TTFT" in text and "sdpa_ratio" in text
    # every prompt past hf_max (the 256K run): Helix only
    only = tmp_path / "only.json"
    bench.main(["--smoke", "--iters", "1", "--parts", "b", "--ttft-prompts", "40", "--out",
                str(only)])
    assert [(r["engine"], r["prompt_tokens"]) for r in json.loads(only.read_text())["records"]
            ] == [("helix", 40)]
