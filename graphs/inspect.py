"""Inspect captured graphs: node count and node types of each segment.

Two sources, best first:
- cuda-python (`cuda.bindings.runtime`, or the older `cuda.cudart`) on the segment's raw
  cudaGraph_t, which torch exposes through `CUDAGraph.raw_cuda_graph()` when the graph was made
  with keep_graph=True (BreakableGraph/GraphRunner with inspectable=True);
- torch's `debug_dump(path)` (Graphviz DOT written by cudaGraphDebugDotPrint), which needs
  `enable_debug_mode()` before capture (what inspectable=True does on torch without keep_graph).
Imports cleanly without cuda-python and without CUDA; only the calls need them.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import torch

from graphs.breakable import Break, BreakableGraph

# DOT node types as cudaGraphDebugDotPrint labels them, mapped to cuda-python's short names
_DOT_TYPES = {"KERNEL": "Kernel", "MEMCPY": "Memcpy", "MEMSET": "Memset", "HOST": "Host",
              "CHILD_GRAPH": "Graph", "EMPTY": "Empty", "WAIT_EVENT": "WaitEvent",
              "EVENT_RECORD": "EventRecord", "EXT_SEMAS_SIGNAL": "ExtSemasSignal",
              "EXT_SEMAS_WAIT": "ExtSemasWait", "MEM_ALLOC": "MemAlloc", "MEM_FREE": "MemFree",
              "CONDITIONAL": "Conditional", "BATCH_MEM_OP": "BatchMemOp"}
_DOT_NODE = re.compile(r'^\s*"?(\w*node_?\d+)"?\s*\[(.*)$')


@dataclass(frozen=True)
class GraphSummary:
    """Structure of one captured segment."""
    num_nodes: int
    node_types: dict[str, int] = field(default_factory=dict)  # e.g. {"Kernel": 40, "Memcpy": 2}
    source: str = ""                                          # "cuda-python" or "debug_dump"


def cuda_runtime():
    """cuda-python's runtime bindings module, or None when cuda-python is not installed."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def summarize(graph: torch.cuda.CUDAGraph, dump_path: str | None = None) -> GraphSummary:
    """Node count and types of one CUDAGraph (see the module doc for what each source needs)."""
    rt = cuda_runtime()
    if rt is not None and hasattr(graph, "raw_cuda_graph"):
        try:
            raw = graph.raw_cuda_graph()
        except RuntimeError:  # made without keep_graph=True
            raw = 0
        if raw:
            return _summarize_raw(rt, raw)
    return _summarize_dot(graph, dump_path)


def describe(graph: BreakableGraph) -> str:
    """One line per step of a captured BreakableGraph: segments with node counts, breaks."""
    if graph.plan is None:
        return "(not captured)"
    lines = []
    for step in graph.plan:
        if isinstance(step, Break):
            lines.append(f"break {step.name} (eager)")
            continue
        inlined = f", inlined {', '.join(step.inlined)}" if step.inlined else ""
        if not graph.use_graphs:
            lines.append(f"segment {step.index} (eager{inlined})")
            continue
        s = summarize(graph.segment_graphs[step.index])
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.node_types.items()))
        lines.append(f"segment {step.index}: {s.num_nodes} nodes ({kinds}){inlined}")
    return "\n".join(lines)


def _check(rt, result):
    """cuda-python returns (err, *values): raise on err, return the value(s)."""
    err, *values = result
    if int(err) != int(rt.cudaError_t.cudaSuccess):
        raise RuntimeError(f"cuda-python call failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


def _summarize_raw(rt, raw: int) -> GraphSummary:
    try:
        _, num = _check(rt, rt.cudaGraphGetNodes(raw, numNodes=0))
    except TypeError:  # bindings that want a handle object rather than an int
        raw = rt.cudaGraph_t(init_value=raw)
        _, num = _check(rt, rt.cudaGraphGetNodes(raw, numNodes=0))
    types: Counter[str] = Counter()
    if num:
        nodes, num = _check(rt, rt.cudaGraphGetNodes(raw, numNodes=num))
        for node in nodes[:num]:
            t = _check(rt, rt.cudaGraphNodeGetType(node))
            types[getattr(t, "name", str(t)).removeprefix("cudaGraphNodeType")] += 1
    return GraphSummary(int(num), dict(types), "cuda-python")


def _summarize_dot(graph: torch.cuda.CUDAGraph, dump_path: str | None) -> GraphSummary:
    """Count nodes in torch's DOT dump; types read from the labels (best effort)."""
    own = dump_path is None
    if own:
        fd, dump_path = tempfile.mkstemp(suffix=".dot")
        os.close(fd)
    try:
        graph.debug_dump(dump_path)
        with open(dump_path) as f:
            text = f.read()
    finally:
        if own:
            os.unlink(dump_path)
    if not text.strip():
        raise RuntimeError("no graph structure available: install cuda-python and capture with "
                           "inspectable=True (keep_graph), or enable_debug_mode() before capture")
    types: Counter[str] = Counter()
    for line in text.splitlines():
        m = _DOT_NODE.match(line)
        if m:
            label = m.group(2)
            kind = next((v for k, v in _DOT_TYPES.items() if re.search(rf"\b{k}\b", label)),
                        "unknown")
            types[kind] += 1
    return GraphSummary(sum(types.values()), dict(types), "debug_dump")
