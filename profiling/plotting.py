"""Shared by the plot scripts: matplotlib on the Agg backend, or None when it is not installed
(plots are optional; the JSON records are the evidence)."""

from __future__ import annotations


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None
    return plt


def png_path(json_path: str, out: str | None) -> str:
    return out or json_path.rsplit(".", 1)[0] + ".png"
