"""profiling/bench_sampling_extras.py on a tiny preset on the CPU: one record per (batch,
context, mode), the modes really set their fields, and the table divides by the plain step."""

import json

from profiling import bench_sampling_extras


def test_records_and_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_sampling_extras.main(["--model", "tiny-llama", "--batches", "1,2",
                                       "--contexts", "16", "--steps", "3", "--device", "cpu",
                                       "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    modes = list(bench_sampling_extras.MODES)
    assert [(r["batch"], r["mode"]) for r in records] == [(b, m) for b in (1, 2) for m in modes]
    assert records[1]["sampling"] == {"logprobs": 5}
    assert records[3]["sampling"] == {"logit_bias": 100}
    assert all(r["step_ms_median"] > 0 and r["context"] == 16 for r in records)
    lines = capsys.readouterr().out.splitlines()
    assert "x plain" in lines[0]
    plain = [line.split() for line in lines[1:] if line.split()[2] == "plain"]
    assert [row[-1] for row in plain] == ["1.000", "1.000"]          # plain against itself
    assert bench_sampling_extras.main(["--modes", "plain,nope", "--device", "cpu"]) == 2
