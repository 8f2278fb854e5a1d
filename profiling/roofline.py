"""The ceilings of one GPU, measured in the run that uses them, and CUDA-graph timing.

- copy bandwidth, read bandwidth, matmul rate: helix.perf.rates (re-exported here, so the
  profiling scripts keep their imports);
- `graph_time_us`: median time of one replay of a captured CUDA graph of fn, with L2 flushed
  before every replay (so small working sets are not served from the 60 MB L2).
"""

from __future__ import annotations

import torch

from helix.perf.rates import copy_bandwidth, event_median, matmul_rate, read_bandwidth

_event_median = event_median        # the name the profiling scripts used
__all__ = ["L2Flush", "copy_bandwidth", "graph_time_us", "matmul_rate", "read_bandwidth"]


class L2Flush:
    def __init__(self, mib: int = 256):
        self.buf = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.zero_()


def graph_time_us(fn, iters: int = 20, flush: L2Flush | None = None) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph (warmed up eagerly
    first, so Triton compiles outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    sec = _event_median(graph.replay, iters, before=flush)
    del graph
    return sec * 1e6
