"""Process-tree probes for the tests that check no rank outlives a run (Linux /proc)."""

from __future__ import annotations

import os


def children(pid: int) -> set[int]:
    """The direct children of pid (empty once it is gone)."""
    out = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out |= {int(c) for c in f.read().split()}
        except OSError:
            pass
    return out


def descendants(pid: int) -> set[int]:
    """Every descendant of pid (local workers are children of the fork server, a child of the
    driver)."""
    out, todo = set(), [pid]
    while todo:
        kids = children(todo.pop()) - out
        out |= kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Running (or stopped), not a zombie and not gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
