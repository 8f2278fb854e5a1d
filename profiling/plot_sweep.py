"""Plot `helix sweep --out` records (helix.perf.plots): decode step time against context, one
line per (layout, batch), one panel per model (floors dotted when the records have them), and
the Pareto view (tokens/s per user against tokens/s per GPU) next to it as <out>_pareto.png.
Several sweep files may be given.

    python profiling/plot_sweep.py profiling/results/sweep_llama70b_2gpu.json \
        profiling/results/sweep_deepseek_v3_2gpu.json --out profiling/results/sweep_2gpu.png
"""

from __future__ import annotations

import argparse
import json

from helix.errors import HelixError
from helix.perf.plots import pareto_figure, require_pyplot, ttl_figure


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--out", default=None, help="PNG path (default: the first JSON with .png)")
    args = p.parse_args()
    try:
        plt = require_pyplot()
    except HelixError as e:
        print(e)
        return
    records = [r for path in args.json for r in json.load(open(path))]
    out = args.out or args.json[0].rsplit(".", 1)[0] + ".png"
    for path, make in ((out, ttl_figure), (out.rsplit(".", 1)[0] + "_pareto.png", pareto_figure)):
        fig = make(records)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
