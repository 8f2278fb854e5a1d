"""The ceilings of the device a run uses, measured in that run.

- copy bandwidth: a device-to-device copy of a multi-GB buffer, (bytes read + written) / time;
- read bandwidth: a sum over a multi-GB buffer, bytes read / time (decode steps mostly read:
  on an H200 reads run faster than the copy's read + write rate);
- matmul rate: an n^3 GEMM in the run's dtype, 2 n^3 / time.

`measure(device, dtype)` returns all three. On CPU it takes a quick measurement (a 64 MiB copy
and sum, a 512^3 GEMM; well under a second): a CPU roofline, for CPU runs only.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Rates:
    copy_bps: float          # device-to-device copy, read + write bytes per second
    read_bps: float          # streaming read, bytes per second
    matmul_flops: float      # FLOP per second of a large GEMM in `dtype`
    device: str              # what was measured (e.g. "NVIDIA H200", "cpu")
    dtype: str

    @property
    def hbm_bps(self) -> float:
        """The rate a step's reads are held to: the faster of the two measured."""
        return max(self.copy_bps, self.read_bps)

    def as_record(self) -> dict:
        d = asdict(self)
        return {"copy_gbps": round(d.pop("copy_bps") / 1e9, 1),
                "read_gbps": round(d.pop("read_bps") / 1e9, 1),
                "matmul_tflops": round(d.pop("matmul_flops") / 1e12, 3), **d}


def event_median(run, iters: int, before=None) -> float:
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


def _wall_median(run, iters: int) -> float:
    run()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(gib: float = 4.0, iters: int = 10) -> float:
    """Bytes per second of a device-to-device copy, read + write counted."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sec = event_median(functools.partial(dst.copy_, src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / sec


def read_bandwidth(gib: float = 4.0, iters: int = 10) -> float:
    """Bytes per second of a sum over a bf16 buffer (reads only; the result is one number)."""
    n = int(gib * 2**30) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    torch.sum(src, 0, dtype=torch.float32, out=out)
    sec = event_median(functools.partial(torch.sum, src, 0, dtype=torch.float32, out=out),
                       iters)
    del src
    torch.cuda.empty_cache()
    return 2 * n / sec


def matmul_rate(n: int = 8192, iters: int = 10, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP per second of an n x n x n GEMM on random data."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    sec = event_median(lambda: a @ b, iters)
    return 2 * n**3 / sec


def _cpu_rates(dtype: torch.dtype) -> Rates:
    n = 64 * 2**20
    src = torch.ones(n // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = 2 * n / _wall_median(lambda: dst.copy_(src), 5)
    read = n / _wall_median(lambda: src.sum(), 5)
    m = 512
    a, b = torch.randn(m, m, dtype=dtype), torch.randn(m, m, dtype=dtype)
    mm = 2 * m**3 / _wall_median(lambda: a @ b, 5)
    return Rates(copy, read, mm, "cpu", str(dtype).removeprefix("torch."))


def measure(device: str, dtype: str | torch.dtype = "bfloat16") -> Rates:
    """Copy, read and matmul rates of `device` ("cuda" or "cpu") in `dtype`."""
    from helix.config import parse_dtype
    dt = parse_dtype(dtype)
    if device != "cuda":
        return _cpu_rates(dt)
    return Rates(copy_bandwidth(), read_bandwidth(), matmul_rate(dtype=dt),
                 torch.cuda.get_device_name(), str(dt).removeprefix("torch."))
