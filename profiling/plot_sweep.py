"""Plot `helix sweep --out` records: decode step time against context, one line per (layout,
batch), one panel per model; several sweep files may be given (one panel each).

    python profiling/plot_sweep.py profiling/results/sweep_llama70b_2gpu.json \
        profiling/results/sweep_deepseek_v3_2gpu.json --out profiling/results/sweep_2gpu.png
"""

from __future__ import annotations

import argparse
import json

from profiling.plotting import pyplot, save


def layout_name(lay: dict) -> str:
    name = "TP-%d" % lay["tpa"] if lay["kvp"] == 1 else f"Helix kvp {lay['kvp']} x tpa {lay['tpa']}"
    return name + (f", ep {lay['ep']}" if lay.get("ep", 1) > 1 else "")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--out", default=None, help="PNG path (default: the first JSON with .png)")
    args = p.parse_args()
    plt = pyplot()
    if plt is None:
        return
    files = [json.load(open(f)) for f in args.json]
    fig, axes = plt.subplots(1, len(files), figsize=(6 * len(files), 4.5), squeeze=False)
    for ax, recs in zip(axes[0], files):
        series: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for r in recs:
            series.setdefault((layout_name(r["layout"]), r["batch"]), []).append(
                (r["context"], r["step_ms_median"]))
        for i, ((lay, batch), pts) in enumerate(sorted(series.items())):
            pts.sort()
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o",
                    linestyle="-" if lay.startswith("Helix") else "--",
                    color=f"C{sorted({b for _, b in series}).index(batch)}",
                    label=f"{lay}, B={batch}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context per request (tokens)")
        ax.set_ylabel("decode step, ms (median)")
        r0 = recs[0]
        ax.set_title(f"{r0['model']}, {r0['layers']} layers, {r0['dtype']}, "
                     f"graphs {'on' if r0['cuda_graphs'] else 'off'}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    save(fig, args.json[0], args.out)


if __name__ == "__main__":
    main()
