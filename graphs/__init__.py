"""Breakable CUDA graphs, generic: bucket ladder, static input buffers staged from a pinned host
mirror, segments captured between eager breaks into one shared pool, replay. Same API on CPU,
where it runs eagerly. Knows nothing of LLMs; depends on torch only."""

from .breakable import Break, BreakableGraph, GraphContext, Segment, Step
from .buckets import BucketLadder, default_buckets, token_buckets
from .runner import GraphPool, GraphRunner
from .static import BufferSpec, HostStaging, StaticBuffers

__all__ = [
    "Break", "BreakableGraph", "GraphContext", "Segment", "Step",
    "BucketLadder", "default_buckets", "token_buckets", "GraphPool", "GraphRunner",
    "BufferSpec", "HostStaging", "StaticBuffers",
]
