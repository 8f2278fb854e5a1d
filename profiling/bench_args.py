"""What the whole-model benchmarks (bench_prefix_cache, bench_sampling_extras, bench_speculative)
share: their common arguments and the end of a run."""

from __future__ import annotations

import argparse


def parser(doc: str) -> argparse.ArgumentParser:
    """--model (a preset or checkpoint), --layers (first n decoder layers, 0: all), --device
    (default cuda where present) and --out (a JSON file for the records)."""
    import torch
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=0, help="first n decoder layers (0: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="JSON file for the records")
    return ap


def finish(records: list[dict], out: str | None, text: str) -> int:
    """Write the records (when asked), print the table; the exit status."""
    from helix.perf.records import write_json
    if out:
        write_json(records, out)
    print(text)
    return 0
