"""Plot bench_graphs.py's JSON: per (model, batch), the decode step time of each mode (wall time
per step, or the median step of older files), with the graph replay time and the sum of kernel
times.

    python profiling/plot_graphs.py profiling/results/graphs.json
"""

from __future__ import annotations

import argparse
import json

from profiling.plotting import pyplot, save

MODES = ("eager", "eager_no_overlap", "graphed_no_overlap", "graphed", "graphed_attention_break")


def step_time(r: dict) -> float:
    return r.get("wall_ms_per_step", r["step_ms"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    plt = pyplot()
    if plt is None:
        return
    with open(args.json) as f:
        data = json.load(f)
    groups = sorted({(r["model"], r["batch"]) for r in data["records"]})
    rec = {(r["model"], r["batch"], r["mode"]): r for r in data["records"]}
    fig, ax = plt.subplots(figsize=(2.2 * len(groups) + 2, 4.5))
    modes = [m for m in MODES if any(k[2] == m for k in rec)]
    width = 0.8 / (len(modes) + 1)
    for i, (model, batch) in enumerate(groups):
        for j, mode in enumerate(modes):
            r = rec.get((model, batch, mode))
            if r:
                ax.bar(i + (j - len(modes) / 2) * width, step_time(r), width, color=f"C{j}",
                       label=f"step, {mode}" if i == 0 else None)
        g = rec.get((model, batch, "graphed"))
        if g:
            x = i + (len(modes) / 2) * width
            ax.bar(x - width / 4, g["replay_ms"], width / 2, color="C8",
                   label="upload + graph replay (GPU)" if i == 0 else None)
            ax.bar(x + width / 4, g["kernel_ms"], width / 2, color="C7",
                   label="sum of kernel times" if i == 0 else None)
    ax.set_xticks(range(len(groups)), [f"{m}\n{data['records'][0]['layers']} layers, B={b}"
                                       for m, b in groups], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode step, eager vs CUDA graphs ({data['meta']['device']})")
    ax.legend(fontsize=7)
    save(fig, args.json, args.out)


if __name__ == "__main__":
    main()
