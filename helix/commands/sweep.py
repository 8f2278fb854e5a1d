"""`helix sweep FILE`: decode latency over a YAML sweep (configs/sweeps/), read by people.

    helix sweep configs/sweeps/tiny-cpu.yaml --out results.json [--csv results.csv]
                [--plot DIR] [--resume]

Prints a header (models, layouts, points, device, the rates measured for the floors), a progress
bar, and one line per point; writes the JSON records after every point (an interrupted sweep
keeps what it measured), a CSV beside them (one flat row per record, with `speedup_vs_tp`,
`floor_ms`, `floor_ratio`), and with --plot the TTL and Pareto figures. --resume skips the points
already in --out (same sweep name, model, layout, batch and context).
"""

from __future__ import annotations

import argparse
import os
import sys

from helix.errors import HelixError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="decode latency over a YAML sweep (configs/sweeps/)")
    p.add_argument("file", help="sweep YAML: models, layouts, batches, contexts, ...")
    p.add_argument("--out", default=None, help="JSON file for the records")
    p.add_argument("--csv", default=None, help="CSV file (default: --out with .csv)")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write TTL and Pareto plots into DIR (needs matplotlib)")
    p.add_argument("--resume", action="store_true",
                   help="skip the points already recorded in --out")
    p.set_defaults(func=run)
    return p


def _layout(lay: dict) -> str:
    s = f"kvp={lay['kvp']} tpa={lay['tpa']}"
    return s + (f" ep={lay['ep']}" if lay.get("ep", 1) > 1 else "")


def _header(sweep, todo, skipped_budget: int, resumed: int, rates, out) -> None:
    rt = sweep.runtime
    print(f"helix sweep {sweep.name}: {', '.join(sweep.models)} "
          f"({rt['layers'] or 'all'} layers), {rt['device']} {rt['dtype']}, attention "
          f"{rt['attention_backend']}, graphs {'requested' if rt['cuda_graphs'] else 'off'}, "
          f"prefill {sweep.prefill}")
    print(f"  layouts: {' | '.join(_layout(lay.as_dict()) for lay in sweep.layouts)}")
    total = len(todo) + resumed
    extra = [f"{skipped_budget} over max_batch_tokens" if skipped_budget else "",
             f"{resumed} already in {out}" if resumed else ""]
    print(f"  points: {len(todo)} to run of {total}"
          + "".join(f", {e}" for e in extra if e)
          + f" ({sweep.warmup_steps} warm-up + {sweep.decode_steps} timed steps each)")
    if rates is not None:
        r = rates.as_record()
        print(f"  rates ({r['device']}, measured now): copy {r['copy_gbps']:.1f} GB/s, read "
              f"{r['read_gbps']:.1f} GB/s, {r['dtype']} matmul {r['matmul_tflops']:.3f} TFLOP/s: "
              f"floor = sum over phases of max(bytes / read, FLOPs / matmul)", flush=True)


def _line(rec: dict) -> str:
    floor = (f"floor {rec['floor_ms']:8.3f} ms ({rec['floor_ratio']:5.2f}x)"
             if rec.get("floor_ms") else "floor -")
    vs = f"  vs TP {rec['speedup_vs_tp']:.2f}x" if rec.get("speedup_vs_tp") else ""
    graphs = "" if rec["cuda_graphs"] else "  [eager]"
    return (f"{rec['model']:>18} {_layout(rec['layout']):<16} B={rec['batch']:<4} "
            f"ctx={rec['context']:<8} step {rec['step_ms_median']:8.3f} ms "
            f"(p90 {rec['step_ms_p90']:.3f})  {floor}  {rec['tokens_per_s']:9.1f} tok/s"
            f"{vs}{graphs}")


def _speedups(records: list[dict]) -> None:
    """One line per Helix layout: its speedup over the TP baseline at every point."""
    by_layout: dict[str, list[str]] = {}
    for r in records:
        if r["layout"]["kvp"] > 1 and r.get("speedup_vs_tp"):
            by_layout.setdefault(f"{r['model']} {_layout(r['layout'])}", []).append(
                f"B={r['batch']} ctx={r['context']} {r['speedup_vs_tp']:.2f}x")
    if by_layout:
        print("speedup over the TP baseline on the same GPUs (TP step / Helix step):")
    for name, cells in by_layout.items():
        print(f"  {name}: {', '.join(cells)}")


def run(args) -> int:
    from tqdm import tqdm

    from helix.perf.plots import plot_sweep, require_pyplot
    from helix.perf.rates import measure
    from helix.perf.records import (add_speedup_vs_tp, read_records, record_key, write_csv,
                                    write_json)
    from helix.sweep import check, load_sweep, planned_points, points, run_sweep

    sweep = load_sweep(args.file)
    if args.plot:
        require_pyplot()                      # before the sweep, not after an hour of it
    if args.resume and not args.out:
        raise HelixError("--resume reads the records of --out: give --out FILE")
    check(sweep)
    previous = read_records(args.out) if args.resume else []
    done = frozenset(record_key(r) for r in previous)
    todo = planned_points(sweep, done)
    resumed = len(planned_points(sweep)) - len(todo)
    budget = len(sweep.models) * len(sweep.layouts) * (
        len(sweep.batches) * len(sweep.contexts) - len(points(sweep)))
    csv_path = args.csv or (os.path.splitext(args.out)[0] + ".csv" if args.out else None)
    rates = measure(sweep.runtime["device"], sweep.runtime["dtype"]) if todo else None
    _header(sweep, todo, budget, resumed, rates, args.out)
    records = list(previous)

    def save():
        add_speedup_vs_tp(records)
        if args.out:
            write_json(records, args.out)
        if csv_path:
            write_csv(records, csv_path)

    bar = tqdm(total=len(todo), unit="point", file=sys.stderr, dynamic_ncols=True,
               disable=None)                 # a bar on a terminal, none in a log file

    def report(rec):
        records.append(rec)
        save()                                # after every point: an interrupted sweep keeps data
        bar.write(_line(rec), file=sys.stdout)
        sys.stdout.flush()
        bar.update(1)

    try:
        run_sweep(sweep, report, rates=rates, done=done)
    finally:
        bar.close()
    save()
    _speedups([r for r in records if r.get("sweep") == sweep.name])
    written = [p for p in (args.out, csv_path) if p]
    if args.plot:
        mine = [r for r in records if r.get("sweep") == sweep.name]
        written += plot_sweep(mine, args.plot, stem=sweep.name)
    if written:
        print(f"wrote {', '.join(written)} ({len(records)} records)")
    return 0
