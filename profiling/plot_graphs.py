"""Plot bench_graphs.py's JSON: per (model, batch), the decode step time eager / graphed /
graphed with the attention break, with the graph replay time and the sum of kernel times.

    python profiling/plot_graphs.py profiling/results/graphs.json
"""

from __future__ import annotations

import argparse
import json

from profiling.plotting import pyplot, save

MODES = ("eager", "graphed", "graphed_attention_break")


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
    width = 0.16
    for i, (model, batch) in enumerate(groups):
        for j, mode in enumerate(MODES):
            r = rec.get((model, batch, mode))
            if r:
                ax.bar(i + (j - 1.5) * width, r["step_ms"], width, color=f"C{j}",
                       label=f"step, {mode}" if i == 0 else None)
        g = rec.get((model, batch, "graphed"))
        if g:
            ax.bar(i + 1.5 * width, g["replay_ms"], width / 2, color="C3",
                   label="graph replay (GPU)" if i == 0 else None)
            ax.bar(i + 2 * width, g["kernel_ms"], width / 2, color="C7",
                   label="sum of kernel times" if i == 0 else None)
    ax.set_xticks(range(len(groups)), [f"{m}\n{data['records'][0]['layers']} layers, B={b}"
                                       for m, b in groups], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode step, eager vs CUDA graphs ({data['meta']['device']})")
    ax.legend(fontsize=7)
    save(fig, args.json, args.out)


if __name__ == "__main__":
    main()
