"""A breakable graph: one function captured as CUDA-graph segments separated by eager breaks.

The function is ordinary code `fn(ctx)`. Where it must run something eagerly at every replay
(host-side planning, dynamic shapes, a kernel that cannot be captured, or debugging), it calls

    out = ctx.graph_break("attention", attend, q, k_cache, v_cache)

On CUDA, capture then splits there: the current torch.cuda.CUDAGraph segment ends, `attend` runs
eagerly, and capture resumes in a new segment that reads `out`. At replay each segment is
replayed and each break calls its function again *on the same argument objects*, copying its
fresh outputs into the tensors it returned at capture (unless it wrote those in place), so the
next segment finds them at the addresses it captured. All segments share one memory pool.

A break is a call, not a `with` block, because the eager code must be re-run at replay without
re-running the Python around it; a captured segment's Python runs only once, at capture.

Breaks are named; only names in `breaks` split the graph. A disabled break is called inline and
captured into the surrounding segment, so one function serves "all captured" and, say,
"attention eager" for debugging. Captured means frozen: host values a disabled break reads
(a Python float, a list length) keep their capture-time values at every replay.

On CPU (or any non-CUDA device) nothing is captured: `capture` runs fn once recording its
plan (the order of segments and breaks), `replay` runs fn eagerly and checks that it took the
same plan. Results are the same; tests check the structure.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

import torch

_EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"


@dataclass(frozen=True)
class Segment:
    """A captured stretch of the function (one CUDAGraph on CUDA), in program order."""
    index: int                     # 0, 1, ... within one graph
    inlined: tuple[str, ...] = ()  # disabled breaks that were captured inside this segment


@dataclass(frozen=True)
class Break:
    """An enabled break: runs eagerly between two segments."""
    name: str


Step = Union[Segment, Break]


def flatten_tensors(out: Any, where: str) -> list[torch.Tensor]:
    """The tensors of a break's result (None, a tensor, or lists/tuples/dicts of them).

    Any other leaf is refused: the captured code after the break would have baked its value in,
    so a changed value at replay would be silently ignored.
    """
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flatten_tensors(o, where)]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flatten_tensors(v, where)]
    raise TypeError(f"break {where!r} returned a {type(out).__name__}; a break may return only "
                    "tensors (or None, or lists/tuples/dicts of tensors)")


class _EagerCall:
    """An enabled break as replayed: call fn on the captured args, land outputs where captured."""

    __slots__ = ("name", "fn", "args", "kwargs", "outputs")

    def __init__(self, name: str, fn: Callable, args: tuple, kwargs: dict,
                 outputs: list[torch.Tensor]):
        self.name, self.fn, self.args, self.kwargs, self.outputs = name, fn, args, kwargs, outputs

    def __call__(self) -> None:
        fresh = flatten_tensors(self.fn(*self.args, **self.kwargs), self.name)
        if len(fresh) != len(self.outputs):
            raise RuntimeError(f"break {self.name!r} returned {len(fresh)} tensors at replay, "
                               f"{len(self.outputs)} at capture")
        for src, dst in zip(fresh, self.outputs):
            if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape:
                continue  # written in place
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise RuntimeError(f"break {self.name!r} output changed from {tuple(dst.shape)} "
                                   f"{dst.dtype} to {tuple(src.shape)} {src.dtype}")
            dst.copy_(src)


class _SegmentCapture:
    """Captures consecutive segments on the current stream into CUDA graphs sharing one pool."""

    def __init__(self, pool, capture_error_mode: str):
        self.pool, self.mode = pool, capture_error_mode
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.empty: list[bool] = []  # no node captured: skipped at replay
        self._active: torch.cuda.CUDAGraph | None = None

    def begin_segment(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool, capture_error_mode=self.mode)
        self._active = g

    def end_segment(self) -> None:
        """End capture; replay the segment once so the break (or caller) after it sees real
        values rather than the uninitialised memory capture leaves behind."""
        g, self._active = self._active, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            g.capture_end()
        empty = False
        for w in caught:
            if _EMPTY_GRAPH_WARNING in str(w.message):
                empty = True  # a break right after another, or at the start or end
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if not empty:
            g.replay()
        self.graphs.append(g)
        self.empty.append(empty)

    def abort(self) -> None:
        """End a capture that failed, so the stream leaves capture mode; keep the first error.
        Segments already captured are freed."""
        if self._active is not None:
            g, self._active = self._active, None
            try:
                g.capture_end()
            except Exception:
                pass
        for g in self.graphs:
            g.reset()
        self.graphs, self.empty = [], []


class GraphContext:
    """Handed to the captured function: `graph_break` marks eager regions; records the plan."""

    def __init__(self, breaks: frozenset[str], capture: _SegmentCapture | None = None):
        self.breaks = breaks
        self._capture = capture
        self._steps: list[Step] = []
        self._inlined: list[str] = []
        self._segments = 0
        self._calls: list[_EagerCall] = []
        self._in_break = False
        self._done = False

    @property
    def capturing(self) -> bool:
        """True while CUDA capture is under way: Python outside breaks will not run at replay."""
        return self._capture is not None

    def graph_break(self, name: str, fn: Callable, *args, **kwargs):
        """Run `fn(*args, **kwargs)` eagerly between segments when `name` is enabled, else inline.

        `args` are kept and passed again at every replay, so tensors among them must be static
        (outputs of earlier segments, static buffers); Python values are frozen at capture. fn
        may read current host state through a closure (e.g. a per-step plan). Returns fn's
        result: tensors only (see flatten_tensors), at addresses fixed from capture on.
        Anything later segments read must come back through this return value: a tensor that
        fn stashes elsewhere (an attribute, a closure) is a new allocation at every replay, and
        the captured segments would keep reading the one from capture.
        """
        if self._done:
            raise RuntimeError("graph_break called after the captured function returned")
        if name not in self.breaks:
            self._inlined.append(name)
            return fn(*args, **kwargs)
        if self._in_break:
            raise RuntimeError(f"graph_break({name!r}) inside an enabled break: breaks do not nest")
        self._close_segment()
        self._steps.append(Break(name))
        self._in_break = True
        try:
            if self._capture is not None:
                self._capture.end_segment()
            out = fn(*args, **kwargs)
            outputs = flatten_tensors(out, name)
            if self._capture is not None:
                self._calls.append(_EagerCall(name, fn, args, kwargs, outputs))
                self._capture.begin_segment()
        finally:
            self._in_break = False
        return out

    def finish(self) -> tuple[Step, ...]:
        """Close the last segment; the plan: segments and breaks in program order."""
        self._close_segment()
        self._done = True
        return tuple(self._steps)

    def _close_segment(self) -> None:
        self._steps.append(Segment(self._segments, tuple(self._inlined)))
        self._segments += 1
        self._inlined = []


class BreakableGraph:
    """`fn(ctx)` captured once, replayed many times; `breaks` names the enabled breaks.

    device: CUDA captures graphs; anything else runs eagerly (same API, same plan).
    pool, stream: share these across graphs (one pool for all buckets; the capture side stream).
    eager: run eagerly even on CUDA (the CPU behaviour), e.g. to debug a suspected graph issue.
    The output of `capture`/`replay` is the function's result, at fixed addresses on CUDA:
    the next replay overwrites it, so consume or clone it first.
    """

    def __init__(self, fn: Callable[[GraphContext], Any], *, breaks: Iterable[str] = (),
                 device: torch.device | str = "cpu", pool=None,
                 stream: torch.cuda.Stream | None = None, capture_error_mode: str = "global",
                 eager: bool = False):
        self.fn = fn
        self.breaks = frozenset(breaks)
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" and not eager
        self.pool, self.stream = pool, stream
        self.capture_error_mode = capture_error_mode
        self.plan: tuple[Step, ...] | None = None   # set by capture
        self.last_trace: tuple[Step, ...] = ()        # steps the last replay executed
        self.output: Any = None
        self.segment_graphs: list[torch.cuda.CUDAGraph] = []
        self._actions: list[Callable[[], None]] = []

    @property
    def captured(self) -> bool:
        return self.plan is not None

    def capture(self, warmup: int = 2) -> Any:
        """Warm up (CUDA: `warmup` eager runs on the side stream), capture, return fn's output.

        On CUDA every segment is replayed once during capture, so when this returns the function
        has effectively run once more and its output holds real values.
        """
        if self.captured:
            raise RuntimeError("already captured; close() before capturing again")
        with torch.no_grad():
            if not self.use_graphs:
                ctx = GraphContext(self.breaks)
                self.output = self.fn(ctx)
                self.plan = ctx.finish()
            else:
                self._capture_cuda(warmup)
        return self.output

    def _capture_cuda(self, warmup: int) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for _ in range(warmup):  # lazy inits (cuBLAS, NCCL, Triton autotune) outside capture
                ctx = GraphContext(self.breaks)
                self.fn(ctx)
                ctx.finish()
            self.stream.synchronize()
            seg = _SegmentCapture(self.pool, self.capture_error_mode)
            ctx = GraphContext(self.breaks, seg)
            seg.begin_segment()
            try:
                out = self.fn(ctx)
                seg.end_segment()
            except BaseException:
                seg.abort()
                raise
        torch.cuda.synchronize(self.device)
        self.plan = ctx.finish()
        self.output = out
        self.segment_graphs = seg.graphs
        calls = iter(ctx._calls)
        for step in self.plan:
            if isinstance(step, Break):
                self._actions.append(next(calls))
            elif not seg.empty[step.index]:
                self._actions.append(seg.graphs[step.index].replay)

    def replay(self) -> Any:
        """Run the captured steps in order on the current stream; returns the static output."""
        if not self.captured:
            raise RuntimeError("replay before capture")
        with torch.no_grad():
            if not self.use_graphs:
                ctx = GraphContext(self.breaks)
                out = self.fn(ctx)
                trace = ctx.finish()
                if trace != self.plan:
                    raise RuntimeError(f"break structure changed since capture: {trace} vs "
                                       f"{self.plan}; under CUDA graphs the captured one would run")
                self.last_trace = trace
                return out
            for action in self._actions:
                action()
        self.last_trace = self.plan
        return self.output

    def close(self) -> None:
        """Free every segment's graph and drop held tensors (idempotent)."""
        for g in self.segment_graphs:
            g.reset()
        self.segment_graphs = []
        self._actions = []
        self.output = None
        self.plan = None
        self.last_trace = ()
