"""The two ceilings of one GPU, measured in the run that uses them, and CUDA-graph timing.

- copy bandwidth: a device-to-device copy of a multi-GB buffer, (bytes read + written) / time;
- bf16 matmul rate: an 8192^3 GEMM, 2 n^3 / time;
- `graph_time_us`: median time of one replay of a captured CUDA graph of fn, with L2 flushed
  before every replay (so small working sets are not served from the 60 MB L2).
"""

from __future__ import annotations

import statistics

import torch


def _event_median(run, iters: int, before=None) -> float:
    """Median seconds of run() over iters, timed with CUDA events; before() runs untimed."""
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_bandwidth(gib: float = 4.0, iters: int = 10) -> float:
    """Bytes per second of a device-to-device copy, read + write counted."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sec = _event_median(lambda: dst.copy_(src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / sec


def matmul_rate(n: int = 8192, iters: int = 10) -> float:
    """FLOP per second of a bf16 n x n x n GEMM on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sec = _event_median(lambda: a @ b, iters)
    return 2 * n**3 / sec


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
