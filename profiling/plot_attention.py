"""Plot bench_attention.py's JSON: per kernel, roofline fraction vs per-rank context, one line
per batch (and torch SDPA's, dashed, where measured). Needs matplotlib; without it, says so and
exits 0.

    python profiling/plot_attention.py profiling/results/attention_h200.json --out attention.png
"""

from __future__ import annotations

from profiling.plotting import pyplot, save

import argparse
import json
from collections import defaultdict


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("json", help="records written by bench_attention.py --out")
    p.add_argument("--out", default=None, help="PNG path (default: the JSON path with .png)")
    args = p.parse_args()
    plt = pyplot()
    if plt is None:
        return
    with open(args.json) as f:
        records = json.load(f)
    kernels = sorted({r["kernel"] for r in records})
    fig, axes = plt.subplots(1, len(kernels), figsize=(6.5 * len(kernels), 4.5), squeeze=False)
    for ax, kernel in zip(axes[0], kernels):
        lines, sdpa = defaultdict(list), defaultdict(list)
        for r in sorted((r for r in records if r["kernel"] == kernel), key=lambda r: r["context"]):
            lines[r["batch"]].append((r["context"], r["roofline_fraction"]))
            if r.get("sdpa_us"):
                sdpa[r["batch"]].append((r["context"], r["floor_us"] / r["sdpa_us"]))
        for i, batch in enumerate(sorted(lines)):
            color = f"C{i % 10}"
            xs, ys = zip(*lines[batch])
            ax.plot(xs, ys, "o-", color=color, label=f"B={batch}")
            if sdpa.get(batch):
                xs, ys = zip(*sdpa[batch])
                ax.plot(xs, ys, "x--", color=color, alpha=0.6)
        shape = next(r["shape"] for r in records if r["kernel"] == kernel)
        ax.set(xscale="log", xlabel="context per rank (tokens)", ylabel="roofline fraction",
               title=f"{kernel}\n{shape}", ylim=(0, 1.1))
        ctxs = sorted({c for pts in lines.values() for c, _ in pts})
        ax.set_xticks(ctxs, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctxs])
        ax.minorticks_off()
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="dashed: torch SDPA" if sdpa else None, title_fontsize=8)
    rec = records[0]
    fig.suptitle(f"{rec.get('device', '')}: copy {rec['copy_GBps']:.0f} GB/s, "
                 f"bf16 matmul {rec['matmul_TFLOPs']:.0f} TFLOP/s", fontsize=10)
    save(fig, args.json, args.out)


if __name__ == "__main__":
    main()
