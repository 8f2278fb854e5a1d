"""What every Helix Triton kernel module shares: whether Triton is importable, the one launch
point (profiling/kernel_resources.py and tests patch `run_kernel` in the modules that import it,
to record or compile launches without a GPU) and the power-of-two rounding of block sizes."""

from __future__ import annotations

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
