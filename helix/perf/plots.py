"""Plots of sweep records (matplotlib, the `plot` extra):

- TTL view: decode step time (time per output token) against context, one line per
  (layout, batch), one panel per model, with each layout's roofline floor dashed when recorded;
- Pareto view (the Helix paper's): tokens/s per user against tokens/s per GPU, one line per
  layout through its batch sizes, one panel per (model, context).
"""

from __future__ import annotations

import os
import re

from helix.errors import HelixError


def require_pyplot():
    """matplotlib.pyplot on the Agg backend, or a one-line error naming the install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HelixError("plots need matplotlib: pip install 'helix-decode[plot]' "
                         "(or pip install matplotlib)") from None
    return plt


def layout_name(lay: dict) -> str:
    name = "TP-%d" % lay["tpa"] if lay["kvp"] == 1 else f"Helix kvp {lay['kvp']} x tpa {lay['tpa']}"
    return name + (f", ep {lay['ep']}" if lay.get("ep", 1) > 1 else "")


def _title(recs: list[dict], what: str) -> str:
    r = recs[0]
    graphs = "graphs on" if all(x.get("cuda_graphs") for x in recs) else "graphs off"
    return f"{what}{r['model']}, {r.get('layers') or 'all'} layers, {r.get('dtype')}, {graphs}"


def ttl_figure(records: list[dict]):
    plt = require_pyplot()
    models = sorted({r["model"] for r in records})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    batches = sorted({r["batch"] for r in records})
    for ax, model in zip(axes[0], models):
        recs = [r for r in records if r["model"] == model]
        series: dict[tuple[str, int], list] = {}
        for r in recs:
            series.setdefault((layout_name(r["layout"]), r["batch"]), []).append(r)
        for (lay, batch), pts in sorted(series.items()):
            pts.sort(key=lambda r: r["context"])
            color = f"C{batches.index(batch) % 10}"
            style = "-" if lay.startswith("Helix") else "--"
            ax.plot([r["context"] for r in pts], [r["step_ms_median"] for r in pts], marker="o",
                    linestyle=style, color=color, label=f"{lay}, B={batch}")
            floors = [(r["context"], r["floor_ms"]) for r in pts if r.get("floor_ms")]
            if floors:
                ax.plot(*zip(*floors), linestyle=":", color=color, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context per request (tokens)")
        ax.set_ylabel("decode step = time per output token, ms (dotted: floor)")
        ax.set_title(_title(recs, ""), fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def pareto_figure(records: list[dict]):
    plt = require_pyplot()
    panels = sorted({(r["model"], r["context"]) for r in records})
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.3 * rows), squeeze=False)
    for ax, (model, context) in zip(axes.flat, panels):
        recs = [r for r in records if r["model"] == model and r["context"] == context]
        series: dict[str, list] = {}
        for r in recs:
            series.setdefault(layout_name(r["layout"]), []).append(r)
        for lay, pts in sorted(series.items()):
            pts.sort(key=lambda r: r["batch"])
            x = [1e3 / r["step_ms_median"] for r in pts]
            y = [r["batch"] * 1e3 / r["step_ms_median"] / (r["layout"]["kvp"] * r["layout"]["tpa"])
                 for r in pts]
            ax.plot(x, y, marker="o", linestyle="-" if lay.startswith("Helix") else "--", label=lay)
            for xi, yi, r in zip(x, y, pts):
                ax.annotate(f"B{r['batch']}", (xi, yi), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xlabel("tokens/s per user (interactivity)")
        ax.set_ylabel("tokens/s per GPU (throughput)")
        ax.set_title(_title(recs, f"context {context}: "), fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_sweep(records: list[dict], out_dir: str, stem: str = "sweep") -> list[str]:
    """Write <stem>_ttl.png and <stem>_pareto.png into out_dir; returns their paths."""
    if not records:
        return []
    os.makedirs(out_dir, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(stem))   # a sweep named by its path
    paths = []
    for name, make in (("ttl", ttl_figure), ("pareto", pareto_figure)):
        fig = make(records)
        path = os.path.join(out_dir, f"{stem}_{name}.png")
        fig.savefig(path, dpi=110)
        require_pyplot().close(fig)
        paths.append(path)
    return paths
