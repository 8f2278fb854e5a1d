"""GraphRunner: a step function captured per bucket, replayed with per-rank padded inputs.

    with GraphRunner(step, BucketLadder(64), buffers, breaks={"plan"}) as runner:
        runner.capture_all()                       # largest bucket first, one shared pool
        out = runner.run(n, {"ids": ids, "slots": slots}, agree=dist_reduce_max(group))
        logits = out[:n]                           # padded rows are the caller's to drop

`step(bucket, buffers, ctx)` reads its inputs from `buffers.view(name, bucket)` and returns its
outputs (tensors at fixed addresses once captured). `close()` (or leaving the `with`) frees all
graphs and the pool; do it before destroying process groups: a process that destroyed its NCCL
group with captured graphs alive was seen to hang at exit.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch

from graphs.breakable import BreakableGraph, GraphContext, Step
from graphs.buckets import BucketLadder, ReduceMax, agreed_rows
from graphs.static import StaticBuffers

StepFn = Callable[[int, StaticBuffers, GraphContext], Any]


class EagerFallbackWarning(UserWarning):
    """A step needed more rows than the largest bucket and ran without graphs."""


class GraphRunner:
    """Captures `fn` for every bucket of `ladder` and replays the one a step needs.

    buffers: the static inputs, at least `ladder.max` rows, on the device to run on.
    breaks: names of the breaks to run eagerly (others are captured inline).
    enabled: False runs every step eagerly through the same code path (also what non-CUDA
        devices do), for A/B checks of graphs against eager.
    warmup: eager runs per bucket before its capture (CUDA only).
    inspectable: keep raw graphs for graphs.inspect.
    check_addresses: verify at every run that no static buffer moved (a few dict lookups).
    """

    def __init__(self, fn: StepFn, ladder: BucketLadder, buffers: StaticBuffers, *,
                 breaks: Iterable[str] = (), enabled: bool = True, warmup: int = 2,
                 capture_error_mode: str = "global", inspectable: bool = False,
                 check_addresses: bool = True):
        if buffers.max_rows < ladder.max:
            raise ValueError(f"static buffers hold {buffers.max_rows} rows, the largest bucket "
                             f"needs {ladder.max}: allocate StaticBuffers(ladder.max, ...)")
        self.fn, self.ladder, self.buffers = fn, ladder, buffers
        self.breaks = frozenset(breaks)
        self.device = buffers.device
        self.use_graphs = enabled and self.device.type == "cuda"
        self.warmup, self.capture_error_mode = warmup, capture_error_mode
        self.inspectable, self.check_addresses = inspectable, check_addresses
        self.graphs: dict[int, BreakableGraph] = {}   # bucket -> its captured graph
        self.last_bucket: int | None = None           # bucket of the last run (None: eager)
        self.capture_seconds = 0.0
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._warned_eager = False
        self._closed = False

    # -- capture ------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every bucket, largest first, into one pool. Collective: all ranks call it.

        Buffers are reset to their pads first, so warmup and capture run on padding rows (slot
        -1: no KV writes). Buckets already captured are skipped.
        """
        self._check_open()
        t0 = time.perf_counter()
        self.buffers.fill_pads()
        if self.use_graphs and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        for bucket in self.ladder.descending():
            if bucket in self.graphs:
                continue
            graph = BreakableGraph(partial(self.fn, bucket, self.buffers), breaks=self.breaks,
                                   device=self.device, pool=self._pool, stream=self._stream,
                                   capture_error_mode=self.capture_error_mode,
                                   inspectable=self.inspectable, eager=not self.use_graphs)
            graph.capture(self.warmup)
            self.graphs[bucket] = graph
        self.capture_seconds += time.perf_counter() - t0

    def plan(self, bucket: int) -> tuple[Step, ...]:
        """Segments and breaks of a captured bucket, in program order."""
        return self.graphs[bucket].plan

    # -- steps --------------------------------------------------------------------------------
    def run(self, n: int, inputs: Mapping[str, torch.Tensor] | None = None,
            pads: Mapping[str, float | int | bool] | None = None,
            agree: ReduceMax | None = None, non_blocking: bool = False) -> Any:
        """One step with this rank's `n` rows; returns fn's outputs for the bucket's rows.

        inputs: name -> `[rows <= bucket, ...]` tensor copied into that static buffer, the rest
            of the bucket's rows padded (buffers not named keep whatever the caller wrote).
        pads: per-call pad overrides (default: each buffer's own pad).
        non_blocking: asynchronous host-to-device copies (inputs in pinned host memory, which the
            caller must not overwrite before the step's outputs are read).
        agree: max over ranks (see buckets.dist_reduce_max); None for one rank. Every rank must
            call run for every step, with the same agree, since the bucket choice is collective.
        Above the largest bucket, runs eagerly on `rows = max over ranks` rows (one warning).
        Under graphs the outputs are static: the next run of the same bucket overwrites them.
        """
        self._check_open()
        inputs, pads = inputs or {}, pads or {}
        rows = agreed_rows(n, agree)
        bucket = self.ladder.choose(rows)
        if bucket is None:
            return self._run_eager(rows, inputs, pads)
        if not self.graphs:
            self.capture_all()
        for name, src in inputs.items():
            self.buffers.copy_in(name, src, pads.get(name), bucket=bucket, non_blocking=non_blocking)
        if self.check_addresses:
            self.buffers.check_addresses()
        self.last_bucket = bucket
        return self.graphs[bucket].replay()

    def _run_eager(self, rows: int, inputs: Mapping[str, torch.Tensor],
                   pads: Mapping[str, float | int | bool]) -> Any:
        if not self._warned_eager:
            self._warned_eager = True
            warnings.warn(f"{rows} rows exceed the largest bucket ({self.ladder.max}): running "
                          "eagerly, without CUDA graphs (warned once per runner)",
                          EagerFallbackWarning, stacklevel=3)
        bufs = self.buffers.resized(rows)
        for name in bufs.names():
            # a buffer not in inputs: what the caller wrote into the static one
            src = inputs[name] if name in inputs else self.buffers[name][:rows]
            bufs.copy_in(name, src, pads.get(name))
        ctx = GraphContext(self.breaks)
        with torch.no_grad():
            out = self.fn(rows, bufs, ctx)
        ctx.finish()
        self.last_bucket = None
        return out

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Free all graphs and the shared pool (idempotent). Call before destroy_process_group."""
        if self._closed:
            return
        self._closed = True
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
        self._pool, self._stream = None, None
        if self.use_graphs:
            torch.cuda.empty_cache()  # the pool's blocks go back to the device

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> GraphRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GraphRunner is closed")
