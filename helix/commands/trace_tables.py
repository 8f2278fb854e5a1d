"""Tables from a torch-profiler chrome trace (the JSON `prof.export_chrome_trace` writes).

    device_ops(events)              -> the device work: kernels, copies and memsets (GPU), or
                                       the top-level CPU operators when there are none (CPU run)
    kernel_table(ops, steps)        -> per name: calls and microseconds per step, share
    critical_table(per_step)        -> per name: what each kernel adds to the step's span (its
                                       end after the end of the op before it), share
    attribute(ops, events, prefix)  -> each op's innermost enclosing `prefix*` range (by the
                                       CPU time of its launch, on the launching thread)
    phase_table(ops, steps)         -> per phase: ops and microseconds per step, share
    transfer_phases(src, dst)       -> phases of one step's op sequence copied onto another's
                                       by aligning op names (a graph replay runs the kernels an
                                       eager step launched, in the same order)

A GPU op is tied to its launch by the trace's correlation id (runtime event on the CPU thread
-> kernel on the device). Under a CUDA graph every kernel correlates to the cudaGraphLaunch,
so ranges opened inside the captured code (recorded once, at capture) attribute nothing at
replay: per-phase times under graphs come from an eager step, mapped by transfer_phases.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
NO_RANGE = "(no range)"


@dataclass
class Op:
    name: str
    dur: float                    # microseconds
    ts: float                     # launch time on the CPU (the op's own start for CPU ops)
    tid: object                   # launching thread
    start: float                  # the op's own start (device or CPU timeline)
    phase: str = NO_RANGE


def _complete(events):
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def device_ops(events: list[dict]) -> list[Op]:
    """GPU kernels / copies / memsets with their launch's CPU time; with none, the CPU
    operators not nested in another operator of their thread."""
    events = _complete(events)
    launches = {}
    for e in events:
        corr = e.get("args", {}).get("correlation")
        if e.get("cat") in LAUNCH_CATS and corr is not None:
            launches[corr] = e
    ops = []
    for e in events:
        if e.get("cat") in DEVICE_CATS:
            launch = launches.get(e.get("args", {}).get("correlation"))
            ts, tid = (launch["ts"], launch["tid"]) if launch else (e["ts"], None)
            ops.append(Op(e["name"], float(e["dur"]), float(ts), tid, float(e["ts"])))
    if ops:
        return sorted(ops, key=lambda o: o.start)
    cpu = sorted((e for e in events if e.get("cat") == "cpu_op"),
                 key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    open_end: dict = {}
    for e in cpu:
        end = open_end.get(e["tid"], float("-inf"))
        if e["ts"] >= end:                                   # not inside a running operator
            ops.append(Op(e["name"], float(e["dur"]), float(e["ts"]), e["tid"], float(e["ts"])))
            open_end[e["tid"]] = e["ts"] + e["dur"]
    return sorted(ops, key=lambda o: o.start)


def phase_name(name: str, prefix: str = "helix.") -> str:
    """'helix.layer[3].attn' -> 'layer.attn': the prefix and any [index] dropped, so the
    layers of one phase add up."""
    return re.sub(r"\[[^\]]*\]", "", name[len(prefix):] if name.startswith(prefix) else name)


def ranges(events: list[dict], prefix: str = "helix.", exclude=()) -> list[dict]:
    return [e for e in _complete(events)
            if e.get("cat") in ("user_annotation", "cpu_instant_event", "python_function")
            and e["name"].startswith(prefix) and e["name"] not in exclude]


def attribute(ops: list[Op], events: list[dict], prefix: str = "helix.",
              exclude=()) -> list[Op]:
    """Sets each op's phase to its innermost enclosing `prefix*` range (the latest-starting
    range of the launching thread that contains the launch time)."""
    by_tid: dict = {}
    for r in ranges(events, prefix, exclude):
        by_tid.setdefault(r["tid"], []).append(r)
    for op in ops:
        best = None
        for r in by_tid.get(op.tid, ()):
            if r["ts"] <= op.ts <= r["ts"] + r["dur"] and (best is None or r["ts"] >= best["ts"]):
                best = r
        op.phase = phase_name(best["name"], prefix) if best else NO_RANGE
    return ops


def split_steps(ops: list[Op], events: list[dict], step_range: str) -> list[list[Op]]:
    """The ops launched inside each `step_range` range, one list per range, in time order."""
    steps = sorted((r for r in _complete(events) if r["name"] == step_range
                    and r.get("cat") != "gpu_user_annotation"),   # its copy on the GPU's timeline
                   key=lambda r: r["ts"])
    out = [[] for _ in steps]
    for op in ops:
        for i, r in enumerate(steps):
            if r["ts"] <= op.ts <= r["ts"] + r["dur"] and (op.tid is None or op.tid == r["tid"]):
                out[i].append(op)
                break
    return out


def _table(groups: dict, steps: int, total: float) -> list[dict]:
    rows = [{"name": k, "calls_per_step": n / steps, "us_per_step": us / steps,
             "pct": 100.0 * us / total if total else 0.0} for k, (n, us) in groups.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def kernel_table(ops: list[Op], steps: int) -> list[dict]:
    groups: dict = {}
    for op in ops:
        n, us = groups.get(op.name, (0, 0.0))
        groups[op.name] = (n + 1, us + op.dur)
    return _table(groups, steps, sum(op.dur for op in ops))


def critical_table(per_step: list[list[Op]]) -> list[dict]:
    """Per name, the time each op adds to its step's span: in end order, its end minus the end
    of the op before it (the first op counts whole; a gap before an op counts to it). With
    programmatic dependent launch a kernel's programs are resident, waiting, while the kernel
    before it runs, so its own duration counts that wait too and durations add up past the
    step; these shares add up to the span from the first start to the last end, gaps
    included."""
    groups: dict = {}
    total = 0.0
    for ops in per_step:
        last = None
        for op in sorted(ops, key=lambda o: o.start + o.dur):
            end = op.start + op.dur
            add = op.dur if last is None else end - last
            last = end
            n, us = groups.get(op.name, (0, 0.0))
            groups[op.name] = (n + 1, us + add)
            total += add
    return _table(groups, max(1, len(per_step)), total)


def phase_table(ops: list[Op], steps: int) -> list[dict]:
    groups: dict = {}
    for op in ops:
        n, us = groups.get(op.phase, (0, 0.0))
        groups[op.phase] = (n + 1, us + op.dur)
    return _table(groups, steps, sum(op.dur for op in ops))


def transfer_phases(src: list[Op], dst: list[Op], unmatched: str = "(unattributed)") -> int:
    """dst[i].phase = the phase of the src op its name aligns with (longest matching blocks
    of the two name sequences); the rest get `unmatched`. Returns the ops matched."""
    sm = difflib.SequenceMatcher(None, [o.name for o in src], [o.name for o in dst],
                                 autojunk=False)
    for op in dst:
        op.phase = unmatched
    matched = 0
    for a, b, size in sm.get_matching_blocks():
        for i in range(size):
            dst[b + i].phase = src[a + i].phase
        matched += size
    return matched


def format_table(rows: list[dict], title: str, key: str, width: int = 100,
                 top: int | None = None) -> str:
    lines = [title, f"{'us/step':>10} {'calls/step':>10} {'% step':>7}  {key}"]
    for r in rows[:top]:
        name = r["name"] if len(r["name"]) <= width else r["name"][:width - 3] + "..."
        lines.append(f"{r['us_per_step']:10.1f} {r['calls_per_step']:10.2f} {r['pct']:7.1f}  "
                     f"{name}")
    if top is not None and len(rows) > top:
        rest = rows[top:]
        lines.append(f"{sum(r['us_per_step'] for r in rest):10.1f} "
                     f"{sum(r['calls_per_step'] for r in rest):10.2f} "
                     f"{sum(r['pct'] for r in rest):7.1f}  ({len(rest)} more)")
    return "\n".join(lines)
