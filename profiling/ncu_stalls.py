"""Where a kernel's warps wait, from an Nsight Compute source export
(`ncu -i REP --page source --csv --print-source sass > sass.csv`, plain or gzipped): the total
of each stall reason over the kernel, and the instructions with the most samples, each with its
two preceding instructions (a wait loop's branch follows its TRYWAIT, which names the barrier).

    python profiling/ncu_stalls.py sass.csv.gz --top 25 --json stalls.json
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, instruction rows) of the export (its first line names the kernel)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    return rows[1], rows[2:]


def summarize(path: str, top: int) -> dict:
    header, rows = read_rows(path)
    col = {name: i for i, name in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [h for h in header if h.startswith("stall_") and "(" not in h]

    def count(row, i):
        return int(row[i] or 0)

    total = sum(count(r, samples) for r in rows)
    by_reason = {s: sum(count(r, col[s]) for r in rows) for s in reasons}
    order = sorted(range(len(rows)), key=lambda i: -count(rows[i], samples))[:top]
    hot = []
    for i in order:
        r = rows[i]
        main = max(reasons, key=lambda s: count(r, col[s]))
        hot.append(dict(index=i, sass=r[1].strip(), samples=count(r, samples),
                        share=count(r, samples) / max(total, 1), main_reason=main,
                        before=[rows[j][1].strip() for j in range(max(0, i - 2), i)]))
    return dict(source=path, samples=total, instructions=len(rows),
                by_reason=dict(sorted(by_reason.items(), key=lambda kv: -kv[1])), hot=hot)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sass_csv")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = summarize(args.sass_csv, args.top)
    print(f"{out['samples']} samples over {out['instructions']} instructions")
    for reason, n in list(out["by_reason"].items())[:8]:
        print(f"  {reason:24} {n:8} {100 * n / max(out['samples'], 1):5.1f} %")
    for h in out["hot"]:
        print(f"  #{h['index']:<5} {100 * h['share']:5.1f} % {h['main_reason']:18} {h['sass'][:60]}"
              f"   after: {' | '.join(b[:40] for b in h['before'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
