"""What every Helix Triton kernel module shares: whether Triton is importable, the one launch
point (profiling/kernel_resources.py and tests patch `run_kernel` in the modules that import it,
to record or compile launches without a GPU), the power-of-two rounding of block sizes, and the
persistent arrival counters of one-launch kernels whose last program finishes the work."""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401  (re-exported: kernel modules import it from here when optional)
    import triton.language as tl  # noqa: F401
    HAS_TRITON = True
except ImportError:                      # pragma: no cover - triton is the optional "kernels" extra
    triton = tl = None
    HAS_TRITON = False


def run_kernel(kernel, grid, *args, **meta):
    """kernel[grid](*args, **meta)."""
    return kernel[grid](*args, **meta)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


# -- arrival counters of one-launch kernels -------------------------------------------------

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []      # outgrown buffers, kept alive (see arrival_counters)
MIN_COUNTERS = 4096


def arrival_counters(device: torch.device | str, n: int) -> torch.Tensor:
    """A persistent int32 buffer of >= n counters on `device`, all zero between launches.

    One-launch kernels (the fused router, the MoE decode kernel's fused combine) count the
    programs that have written their part in this buffer; the program that arrives
    last merges and resets its counter to 0, so the buffer is all zero again after every
    launch. No memset per call, nothing allocated per call: CUDA-graph safe.

    - Zeroed once, allocated outside any CUDA graph capture. A launch that needs more counters
      than the buffer has grows it (eagerly; the device is synchronised once so the zero fill is
      complete before any stream uses it). Growing during a capture raises: run one eager call
      of the largest shape first (Helix's graph runner warms every bucket up eagerly before it
      captures, largest first, so this does not happen there).
    - An outgrown buffer is never freed: graphs captured earlier still point at it, and its
      memory must not be handed to anything else (it stays all zero, being reset by every
      launch that uses it).
    - One buffer per device, shared by every launch on it: launches that may run CONCURRENTLY
      (on different streams) must not use it, since their counters would mix. Helix launches
      every kernel that uses it on the compute stream (HOP-B's side stream runs only the
      exchange), so launches are ordered.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if _capturing(device):
        have = 0 if buf is None else buf.numel()
        raise RuntimeError(
            f"the split kernels' arrival-counter buffer on {device} holds {have} counters and "
            f"this launch needs {n}; it cannot be allocated during CUDA graph capture: run one "
            "eager call of this (or a larger) shape before capturing")
    size = max(MIN_COUNTERS, triton.next_power_of_2(max(1, n)))
    new = torch.zeros(size, dtype=torch.int32, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if buf is not None:
        _RETIRED.append(buf)
    _COUNTERS[device] = new
    return new


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is capturing a CUDA graph."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()
