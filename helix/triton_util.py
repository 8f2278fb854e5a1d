"""What every Helix Triton kernel module shares: whether Triton is importable, the one launch
point (profiling/kernel_resources.py and tests patch `run_kernel` in the modules that import it,
to record or compile launches without a GPU), programmatic dependent launch, the power-of-two
rounding of block sizes, and the persistent arrival counters of one-launch kernels whose last
program finishes the work.

Programmatic dependent launch (PDL, sm_90+). A decode step at small batch is hundreds of short
kernels in a row, each paying its launch and the ramp of its first wave before any work. A
kernel launched with PDL may start while the kernel before it on the stream is still running:
its programs become resident and wait in `pdl_sync`, which returns once the previous kernel
has finished and its writes are visible (griddepcontrol.wait), and then lets the NEXT kernel
start the same way (griddepcontrol.launch_dependents). The rule, written once here:
  - a kernel opts in by declaring `PDL: tl.constexpr = False` and calling `pdl_sync(PDL)`
    before its first load or store (so it reads nothing an earlier kernel writes, and writes
    nothing an earlier kernel still reads, before the wait). The one exception: loads of bytes
    NO kernel of a step writes (weights) may come first, as in the one-tile GEMV
    (skinny_gemm._gemv_kernel) and router, whose weight tiles stream under the previous kernel;
  - `run_kernel` launches such a kernel with PDL=True and launch_pdl where `pdl_enabled`
    (CUDA, compute capability >= 9, HELIX_PDL not "0"); everywhere else PDL=False, the call
    compiles away, and the launch is an ordinary one.
A kernel without the parameter, or one from torch / cuBLAS, is launched and waited for as
before; under CUDA-graph capture the PDL launches become programmatic edges of the graph.

The PDL value a kernel gets is a set of bits (PDL_ON, PDL_EARLY, PDL_PREFETCH; module flag
FLAGS, from HELIX_PDL, benches switch it):
  - PDL_EARLY: `pdl_sync` lets the next kernel launch BEFORE it waits, so a chain of kernels
    can be resident ahead of the one running (as far as SM resources allow). Still exact:
    every kernel waits before its first access, and a kernel cannot finish before the one it
    waits for, so waiting for the previous kernel implies every earlier one has finished.
    What a kernel reads BEFORE its wait must then be written by no kernel at all, not only by
    no kernel of the last two: a counter shared with an earlier launch is not such a read
    (gluon_route.choose waits first under PDL_EARLY for that reason).
  - PDL_PREFETCH: a kernel may, before `pdl_sync`, ask L2 for bytes that NO kernel of the step
    writes (weights) with `prefetch_l2`; a projection resident under the previous kernel then
    streams its weights while that kernel runs, and reads them from L2 once it may start.
"1" / "wait" is PDL_ON alone. The default, "auto", adds PDL_EARLY in one-row decode steps
of MLA models (`decode_flags`, module flag EARLY_ONE_ROW). At one row an MLA layer is a chain
of short latency-bound launches (the kv row with W_UK, the split merge, W_UV: 2 MB, o_proj:
8 MB), so a launch that lets its successor start before it waits has the successor's weight
tile stream under it; where the launches stream tens of MB each (Llama's projections) the
early residents' weight loads compete with the running kernel's instead. Measured on the
H200, whole steps, same process (profiling/results/step_twelfth.md): DeepSeek-V2-Lite one row
2-3 % faster (1 x 32K 2.112-2.118 -> 2.066-2.075 ms) and eight rows 1.5 % slower;
Llama-3.1-8B one row 1.1-2.6 % slower; the Qwen3 shape's one row equal, eight rows 1.3 %
slower. (The first measurement, profiling/results/pdl.md with older kernels: 6-8 % slower at
every batch.)
Re-measured on an H100 (profiling/results/fp8_row.md, eighteenth session): DeepSeek-V2-Lite
one row 1 x 1K 2.213-2.230 -> 2.161-2.170 ms, 1 x 32K 2.609-2.624 -> 2.569-2.577. PDL_EARLY at
one row once exposed a race (the one-row MoE launch's router partition read its route counter
before the grid wait; gluon_route.choose waits first since); the GPU tests pass under "auto"
since (gpu_test_logs, 602f552). "early" / "prefetch" / "full" set their bits at every batch
(HELIX_PDL, benches switch FLAGS).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import torch

try:
    import triton  # noqa: F401  (re-exported: kernel modules import it from here when optional)
    import triton.language as tl  # noqa: F401
    HAS_TRITON = True
except ImportError:                      # pragma: no cover - triton is the optional "kernels" extra
    triton = tl = pdl_sync = prefetch_l2 = prefetching = cache_cast = None
    HAS_TRITON = False


PDL_ON, PDL_EARLY, PDL_PREFETCH = 1, 2, 4
PDL_MODES = {"0": 0, "1": PDL_ON, "wait": PDL_ON, "auto": PDL_ON,
              "early": PDL_ON | PDL_EARLY, "prefetch": PDL_ON | PDL_PREFETCH,
              "full": PDL_ON | PDL_EARLY | PDL_PREFETCH}
_mode = os.environ.get("HELIX_PDL", "auto")
if _mode not in PDL_MODES:
    raise SystemExit(f"HELIX_PDL={_mode!r}: use one of {', '.join(PDL_MODES)}")
FLAGS = PDL_MODES[_mode]                # read at launch: benches switch it
PDL = FLAGS != 0                         # the switch alone (FLAGS keeps the mode bits)
EARLY_ONE_ROW = _mode == "auto"          # decode_flags' rule (benches switch it)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")   # fixed at import


def run_kernel(kernel, grid, *args, cluster: int = 1, **meta):
    """kernel[grid](*args, **meta), with programmatic dependent launch where the kernel takes
    a PDL parameter and pdl_enabled holds for the device of its first tensor argument.

    cluster > 1 (sm_90): the programs along grid axis 0 run in thread-block clusters of that
    many, which the hardware places on one GPC together. The kernel is compiled for one CTA
    (its `CLUSTER` constexpr, set here, keys a binary of its own) and launched with the
    cluster dimension: the launcher takes gridDimX = grid[0] / cluster times the binary's
    num_ctas, so that binary's packed launch metadata says `cluster` (Triton 3.6's launcher,
    backends/nvidia/driver.py). program_id(0) still counts every program of axis 0."""
    if _takes_pdl(kernel) and "PDL" not in meta:
        on = pdl_enabled(next((a.device for a in args if isinstance(a, torch.Tensor)), None))
        meta["PDL"] = FLAGS if on else 0
        if on:
            meta["launch_pdl"] = True
    if cluster > 1:
        assert grid[0] % cluster == 0, (grid, cluster)
        meta["CLUSTER"] = cluster
        grid = (grid[0] // cluster, *grid[1:])
        compiled = kernel.warmup(*args, grid=grid, **meta)
        nw, ctas, shared = compiled.packed_metadata
        assert ctas in (1, cluster), compiled.packed_metadata
        compiled.packed_metadata = (nw, cluster, shared)
    return kernel[grid](*args, **meta)


def decode_flags(rows: int, mla: bool) -> int:
    """The PDL bits of a decode step of `rows` rows of a model with (mla) or without MLA
    attention: FLAGS, with PDL_EARLY at one row of an MLA model under EARLY_ONE_ROW (module
    doc)."""
    if EARLY_ONE_ROW and rows == 1 and mla and FLAGS:
        return FLAGS | PDL_EARLY
    return FLAGS


@contextlib.contextmanager
def launch_flags(flags: int):
    """Within: run_kernel launches with PDL bits `flags` (FLAGS restored after)."""
    global FLAGS
    saved, FLAGS = FLAGS, flags
    try:
        yield
    finally:
        FLAGS = saved


def pdl_enabled(device: torch.device | None) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA (not the interpreter), compute
    capability >= 9, and HELIX_PDL (module flag PDL) on."""
    if not (PDL and FLAGS) or device is None or device.type != "cuda":
        return False
    if _INTERPRETED:
        return False
    return _capability(device.index if device.index is not None
                       else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _takes_pdl(kernel) -> bool:
    fn = getattr(kernel, "fn", kernel)
    try:
        return "PDL" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


if HAS_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_sync(PDL: tl.constexpr):
        """A PDL kernel's first access waits here for the previous kernel (its writes
        visible); the next kernel may launch after the wait, or before it with PDL_EARLY.
        Nothing with PDL=0."""
        if PDL & 2:                        # PDL_EARLY
            gdc_launch_dependents()
            gdc_wait()
        elif PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def last_to_arrive(cnt_ptr, programs):
        """Count this program in at `cnt_ptr` (one of arrival_counters) after its stores, and
        return whether it is the last of `programs` to arrive. Ordering: a CTA barrier after
        the stores, one acq_rel GPU-scope atomic; the last program reads the others' parts
        through L2 (.cg loads) and resets the counter to 0 (tl.store(cnt_ptr, 0)) when done."""
        tl.debug_barrier()
        return tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1

    @triton.jit
    def prefetching(PDL: tl.constexpr):
        """Whether a kernel launched with this PDL value issues its prefetch_l2 calls."""
        return (PDL & 4) != 0              # PDL_PREFETCH

    @triton.jit
    def prefetch_l2(ptrs, nbytes, mask):
        """Ask L2 for nbytes from each pointer of `ptrs` where `mask` (one bulk prefetch
        each, sm_90 only: cp.async.bulk.prefetch.L2, widened to the 16-byte granules that hold
        the range, which stay inside the allocation). A hint: no data moves to the program,
        nothing waits for it. Before `pdl_sync` only for bytes no kernel of the step writes
        (weights), and only under `if prefetching(PDL)`."""
        a = ptrs.to(tl.int64)
        lo = a & -16
        size = tl.where(mask & (nbytes > 0), ((a + nbytes + 15) & -16) - lo, 0)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [lo, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def cache_cast(x, DTYPE: tl.constexpr):
        """x as a KV cache of dtype DTYPE stores it (helix/kv/quant.py). fp8 (e4m3) saturates at
        +-448 and rounds to nearest even in fp32 arithmetic first (normal values: the fp32 bits at
        3 mantissa bits; below 2^-6: to a multiple of 2^-9, by an fp32 add), so the conversion
        itself is exact on every target: the interpreter's own fp8 rounding drops a mantissa carry
        (7.94 -> 4.0) and does not saturate."""
        if DTYPE == tl.float8e4nv:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
            a = tl.abs(x)
            small = (a + 16384.0) - 16384.0          # 2^14: one fp32 ulp is 2^-9
            x = tl.where(a < 0.015625, tl.where(x < 0, -small, small),
                         bits.to(tl.float32, bitcast=True))
        return x.to(DTYPE)


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
