"""profiling/bench_prefix_cache.py on a tiny preset on the CPU: per turn and mode one record;
with the cache on a turn after the first prefills only what earlier turns did not write, off it
prefills its whole prompt."""

import json

from profiling import bench_prefix_cache


def test_records_and_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_prefix_cache.main(["--model", "tiny-llama", "--device", "cpu", "--system", "40",
                                    "--turns", "3", "--question", "7", "--answer", "4",
                                    "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["prefix_caching"], r["turn"]) for r in records] == \
        [(False, t) for t in range(3)] + [(True, t) for t in range(3)]
    off, on = records[:3], records[3:]
    assert [r["prompt_tokens"] for r in on] == [47, 58, 69] == [r["prompt_tokens"] for r in off]
    assert all(r["cached_tokens"] == 0 and r["prefilled_tokens"] == r["prompt_tokens"]
               for r in off)
    # 16-position blocks: turn 1 finds turn 0's 47 + 3 written positions' 3 blocks, turn 2
    # turn 1's 58 + 3
    assert [r["cached_tokens"] for r in on] == [0, 48, 48]
    assert all(r["prefilled_tokens"] == r["prompt_tokens"] - r["cached_tokens"] for r in on)
    assert capsys.readouterr().out.count("\n") == 4
    assert bench_prefix_cache.main(["--turns", "0", "--device", "cpu"]) == 2


def test_host_mode_recovers_what_the_pool_dropped(tmp_path):
    """A pool of 20 pages and a distracting request between turns: the cache alone keeps part
    of the conversation, its host tier all of it (what the earlier turns wrote, whole blocks)."""
    out = tmp_path / "r.json"
    assert bench_prefix_cache.main(["--model", "tiny-llama", "--device", "cpu", "--system", "200",
                                    "--turns", "3", "--question", "20", "--answer", "5",
                                    "--distract", "150", "--num-pages", "20",
                                    "--host-cache-gb", "0.01", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    cached = {m: [r["cached_tokens"] for r in records if r["mode"] == m]
              for m in ("off", "on", "host")}
    assert cached["off"] == [0, 0, 0] and cached["host"] == [0, 224, 240]
    assert all(a < b for a, b in zip(cached["on"][1:], cached["host"][1:]))
