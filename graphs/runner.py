"""GraphRunner: a step function captured per bucket, replayed from static input buffers.

    runner = GraphRunner(step, BucketLadder(64), buffers, breaks={"plan"})
    runner.capture_all()                    # largest bucket first, one shared pool
    staging.put(...); staging.upload(b)     # this step's rows into the static buffers
    out = runner.replay(b)                  # bucket b's outputs (static: overwritten next time)
    runner.close()

`step(bucket, buffers, ctx)` reads its inputs from `buffers.view(name, bucket)` and returns its
outputs (tensors at fixed addresses once captured). A step needing more rows than the largest
bucket is the caller's to run another way (eagerly). `close()` frees all graphs; do it before
destroying process groups: a process that destroyed its NCCL group with captured graphs alive was
seen to hang at exit. Runners handed the same `GraphPool` capture into one memory pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

from .breakable import BreakableGraph, GraphContext, Step
from .buckets import BucketLadder
from .static import StaticBuffers

StepFn = Callable[[int, StaticBuffers, GraphContext], Any]


class GraphPool:
    """One CUDA graph memory pool and capture stream, for every runner handed it. Graphs that
    are replayed one at a time on one stream may share their intermediates (each graph's outputs
    stay its own), so a process holds one step's activations however many graphs it captures.
    Created at the first capture on CUDA; never on other devices."""

    def __init__(self):
        self.handle = None
        self.stream: torch.cuda.Stream | None = None

    def ensure(self, device: torch.device) -> None:
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)


class GraphRunner:
    """Captures `fn` for every bucket of `ladder` and replays the one a step needs.

    buffers: the static inputs, at least `ladder.max` rows, on the device to run on.
    breaks: names of the breaks to run eagerly (others are captured inline).
    enabled: False runs every step eagerly through the same code path (also what non-CUDA
        devices do), for A/B checks of graphs against eager.
    warmup: eager runs per bucket before its capture (CUDA only).
    pool: the pool to capture into, shared with other runners (None: one of its own).
    """

    def __init__(self, fn: StepFn, ladder: BucketLadder, buffers: StaticBuffers, *,
                 breaks: Iterable[str] = (), enabled: bool = True, warmup: int = 2,
                 capture_error_mode: str = "global", pool: GraphPool | None = None):
        if buffers.max_rows < ladder.max:
            raise ValueError(f"static buffers hold {buffers.max_rows} rows, the largest bucket "
                             f"needs {ladder.max}: allocate StaticBuffers(ladder.max, ...)")
        self.fn, self.ladder, self.buffers = fn, ladder, buffers
        self.breaks = frozenset(breaks)
        self.device = buffers.device
        self.use_graphs = enabled and self.device.type == "cuda"
        self.warmup, self.capture_error_mode = warmup, capture_error_mode
        self.graphs: dict[int, BreakableGraph] = {}   # bucket -> its captured graph
        self.last_bucket: int | None = None           # bucket of the last replay
        self.capture_seconds = 0.0
        self.pool = pool if pool is not None else GraphPool()
        self._closed = False

    def capture_all(self) -> None:
        """Capture every bucket, largest first, into one pool. Collective: all ranks call it.

        Buffers are reset to their pads first, so warmup and capture run on padding rows (slot
        -1: no KV writes). Buckets already captured are skipped.
        """
        self._check_open()
        t0 = time.perf_counter()
        self.buffers.fill_pads()
        if self.use_graphs:
            self.pool.ensure(self.device)
        for bucket in self.ladder.descending():
            if bucket in self.graphs:
                continue
            graph = BreakableGraph(partial(self.fn, bucket, self.buffers), breaks=self.breaks,
                                   device=self.device, pool=self.pool.handle,
                                   stream=self.pool.stream,
                                   capture_error_mode=self.capture_error_mode,
                                   eager=not self.use_graphs)
            graph.capture(self.warmup)
            self.graphs[bucket] = graph
        self.capture_seconds += time.perf_counter() - t0

    def plan(self, bucket: int) -> tuple[Step, ...]:
        """Segments and breaks of a captured bucket, in program order."""
        return self.graphs[bucket].plan

    def replay(self, bucket: int) -> Any:
        """Run bucket `bucket` on what its static buffers hold; its outputs (static under graphs:
        the next replay of the bucket overwrites them)."""
        self._check_open()
        if bucket not in self.graphs:
            raise ValueError(f"bucket {bucket} is not captured (ladder {list(self.ladder)})")
        self.buffers.check_addresses()
        self.last_bucket = bucket
        return self.graphs[bucket].replay()

    def close(self) -> None:
        """Free all graphs (idempotent); the pool's blocks go back to the device once no runner
        sharing it holds graphs. Call before destroy_process_group."""
        if self._closed:
            return
        self._closed = True
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
        if self.use_graphs:
            torch.cuda.empty_cache()  # the pool's blocks go back to the device

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GraphRunner is closed")
