"""Named ranges for Nsight Systems and the torch profiler.

- `nvtx_range(name)`: a step-level range (helix.prepare, helix.decode_graph[B], helix.readback,
  ...), always on: a handful per step.
- `phase(name)`: a per-layer phase (helix.qkv, helix.attn, helix.a2a, helix.merge, helix.oproj,
  helix.ffn / helix.moe, with the micro-batch under HOP-B). Off by default, and then a shared
  null context: nothing is recorded and nothing allocated. `record_phases(True)` (what `helix
  profile` and HELIX_PHASES=1 do) turns them on as NVTX ranges and torch profiler
  record_function ranges, so a trace shows them either way.

NVTX goes through the `nvtx` package when installed (the `profiling` extra), else torch's own
bindings when CUDA is present, else nowhere. Inside a captured CUDA graph ranges are recorded
once, at capture, not at every replay: per-phase timing wants eager steps (--no-cuda-graphs).
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import nvtx as _nvtx
except ImportError:
    _nvtx = None

_NULL = contextlib.nullcontext()
_phases = os.environ.get("HELIX_PHASES", "") not in ("", "0")


def nvtx_range(name: str):
    if _nvtx is not None:
        return _nvtx.annotate(name, domain="helix")
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return _NULL


def record_phases(on: bool) -> None:
    global _phases
    _phases = on


@contextlib.contextmanager
def _both(name: str):
    with nvtx_range(name), torch.profiler.record_function(name):
        yield


def phase(name: str):
    """`with phase("attn"):` -> a range named helix.attn while phases are recorded."""
    return _both(f"helix.{name}") if _phases else _NULL
