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


def save(fig, json_path: str, out: str | None) -> None:
    """Write the figure next to its JSON (same name, .png) unless `out` names a path."""
    path = out or json_path.rsplit(".", 1)[0] + ".png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
