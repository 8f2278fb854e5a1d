"""profiling/bench_prefill_graphs.py end to end on CPU (--smoke: a tiny preset, tiny sizes)
before it costs GPU time: every point in both modes, the graphs each step replayed, the JSON
records and the summary table last."""

import json

from profiling import bench_prefill_graphs as bench


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "p.json"
    bench.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    points = data["points"]
    assert [(p["length"], p["batch"]) for p in points] == [(8, 1), (8, 2), (20, 1), (20, 2)]
    assert all(p["same_tokens"] and len(p["graphs_ms"]["all"]) == 2 for p in points)
    assert points[-1]["graphs_per_step"] == [["local", 32], ["local", 16]]   # 40 tokens, 32 a step
    assert data["meta"]["graphs_captured"] == len(data["meta"]["buckets"])
    last = capsys.readouterr().out.rstrip().splitlines()[-1].split()
    assert last[:3] == ["20", "2", "40"]
