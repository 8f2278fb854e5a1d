"""profiling/ncu_stalls.py: stall totals and hot instructions from an Nsight Compute source
export (a small synthetic one, plain and gzipped)."""

from __future__ import annotations

import csv
import gzip
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from profiling import ncu_stalls  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "stall_long_sb", "stall_barrier",
          "stall_long_sb (Not Issued)"]
ROWS = [
    ["0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR40+0x38538], R10", "2", "2", "0", "2", "0"],
    ["0x20", "@!P1  BRA 0x30", "30", "30", "29", "1", "29"],
    ["0x30", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR32], R152", "5", "3", "0", "0", "0"],
    ["0x40", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "13", "13", "0", "13", "0"],
]


def _export(path, gz: bool) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", "mla_decode_kernel"])
    w.writerow(HEADER)
    w.writerows(ROWS)
    name = str(path / ("sass.csv.gz" if gz else "sass.csv"))
    with (gzip.open(name, "wt") if gz else open(name, "w")) as f:
        f.write(buf.getvalue())
    return name


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_summary_counts_reasons_and_ranks_instructions(tmp_path, gz):
    out = ncu_stalls.summarize(_export(tmp_path, gz), top=2)
    assert out["samples"] == 50 and out["instructions"] == 4
    # the "(Not Issued)" columns are not counted twice
    assert out["by_reason"] == {"stall_long_sb": 29, "stall_barrier": 16}
    first, second = out["hot"]
    assert first["index"] == 1 and first["main_reason"] == "stall_long_sb"
    assert first["share"] == pytest.approx(30 / 50)
    assert first["before"] == [ROWS[0][1]]               # the wait loop's TRYWAIT names the barrier
    assert second["sass"].startswith("WARPGROUP.DEPBAR")
    assert second["main_reason"] == "stall_barrier"
    assert second["before"] == [ROWS[1][1], ROWS[2][1]]


def test_cli_writes_json(tmp_path, capsys):
    import json
    src = _export(tmp_path, False)
    dst = tmp_path / "stalls.json"
    ncu_stalls.main([src, "--top", "3", "--json", str(dst)])
    assert "50 samples over 4 instructions" in capsys.readouterr().out
    assert len(json.loads(dst.read_text())["hot"]) == 3
