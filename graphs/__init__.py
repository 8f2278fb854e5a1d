"""Breakable CUDA graphs, generic: bucket ladder, static input buffers, segments captured
between eager breaks into one shared pool, replay. Same API on CPU, where it runs eagerly.

Knows nothing of LLMs; depends on torch only (cuda-python optional, for graphs.inspect).
"""

from graphs.breakable import Break, BreakableGraph, GraphContext, Segment, Step
from graphs.buckets import BucketLadder, ReduceMax, agreed_rows, default_buckets, dist_reduce_max
from graphs.runner import EagerFallbackWarning, GraphRunner
from graphs.static import BufferSpec, HostStaging, StaticBuffers

__all__ = [
    "Break", "BreakableGraph", "GraphContext", "Segment", "Step",
    "BucketLadder", "ReduceMax", "agreed_rows", "default_buckets", "dist_reduce_max",
    "EagerFallbackWarning", "GraphRunner",
    "BufferSpec", "HostStaging", "StaticBuffers",
]
