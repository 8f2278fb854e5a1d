"""NVTX ranges for Nsight Systems / the torch profiler: `with nvtx_range("helix.forward"): ...`.

Uses the `nvtx` package when installed (the `profiling` extra), else torch's own NVTX bindings
when CUDA is present, else nothing. Ranges mark host-side phases of a step; inside a captured
CUDA graph they are recorded once, at capture, not at every replay.
"""

from __future__ import annotations

import contextlib

import torch

try:
    import nvtx as _nvtx
except ImportError:
    _nvtx = None


def nvtx_range(name: str):
    if _nvtx is not None:
        return _nvtx.annotate(name, domain="helix")
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()
