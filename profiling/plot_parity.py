"""Plot parity.py's JSON: per (model, layout), the logits error against the fp32 single-rank
oracle, fp32 layouts and --dtype layouts side by side (log scale).

    python profiling/plot_parity.py profiling/results/parity_2xh200.json
"""

from __future__ import annotations

from profiling.plotting import pyplot, save

import argparse
import json


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--out", default=None, help="PNG path (default: the JSON path with .png)")
    args = p.parse_args()
    plt = pyplot()
    if plt is None:
        return
    with open(args.json) as f:
        data = json.load(f)
    recs = data["records"]
    dtype = recs[0]["dtype"]
    labels = [f"{r['model']}\n{r['layout']}" for r in recs]
    fp32 = [max(r["fp32"]["max_logits_rel_err_vs_fp32"], 1e-9) for r in recs]
    low = [r[dtype]["prefill_logits_rel_err_vs_fp32"] for r in recs]
    xs = range(len(recs))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(recs)), 4.5))
    ax.bar([x - 0.2 for x in xs], fp32, 0.4, label="fp32 layout, max over steps")
    ax.bar([x + 0.2 for x in xs], low, 0.4, label=f"{dtype} layout, prefill")
    ax.axhline(1e-4, color="C0", ls="--", lw=0.8, label="fp32 tolerance 1e-4")
    ax.axhline(2e-2, color="C1", ls="--", lw=0.8, label=f"{dtype} tolerance 2e-2")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("logits relative error vs fp32 single rank")
    ax.set_title(f"Layout parity on {data['meta'].get('device')} x{data['meta'].get('gpus')}")
    ax.legend(fontsize=7)
    save(fig, args.json, args.out)


if __name__ == "__main__":
    main()
