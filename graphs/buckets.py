"""Bucket ladder: the sizes (batch rows, or prefill tokens per rank) graphs are captured for.

A graph is captured per bucket; a step with n rows replays the smallest bucket >= n, its inputs
padded to that bucket. Every rank must replay the same bucket, because the collectives inside
the graph must match in count, order and shape: the caller derives n identically on every rank.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence


def default_buckets(max_size: int, step: int = 8) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, then every `step` (24, 32, ...) up to `max_size`, `max_size` always last.

    Powers of two at the small end (where a decode batch often sits and padding a 3 to 8 would
    waste most of the step); a linear ladder above 16 bounds padding waste to `step - 1` rows.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    sizes = [b for b in (1, 2, 4, 8, 16) if b <= max_size]
    sizes += range(16 + step, max_size + 1, step)
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return tuple(sizes)


def token_buckets(max_size: int, per_octave: int = 8, dense_from: int = 256) -> tuple[int, ...]:
    """Token counts for prefill steps: powers of two from 16 up to `dense_from`, then
    `per_octave` evenly spaced sizes per octave (256, 288, 320, ... 512, 576, ...), `max_size`
    always last.

    A prefill step's work grows with its tokens, so a padded token costs compute: above
    `dense_from` the ladder bounds the padding to 1 / per_octave of the step (12.5 %). Below it a
    step is bound by kernel launches rather than FLOPs, and doubling costs little.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    if per_octave < 1 or dense_from < 16:
        raise ValueError(f"per_octave must be >= 1 and dense_from >= 16, got {per_octave}, "
                         f"{dense_from}")
    sizes, b = [], 16
    while b < dense_from and b < max_size:
        sizes.append(b)
        b *= 2
    while b < max_size:
        step = max(1, b // per_octave)
        sizes += range(b, min(2 * b, max_size), step)
        b *= 2
    return tuple(sizes) + (max_size,)


class BucketLadder:
    """Ascending, distinct bucket sizes; the largest is the most rows a graph holds.

    `BucketLadder(64)` gives the default ladder up to 64; `BucketLadder(buckets=[1, 8, 32])`
    an explicit one (its max is its largest entry).
    """

    def __init__(self, max_size: int | None = None, *, buckets: Iterable[int] | None = None,
                 step: int = 8):
        if buckets is None:
            if max_size is None:
                raise ValueError("give max_size or an explicit list of buckets")
            sizes = default_buckets(max_size, step)
        else:
            sizes = tuple(sorted(set(int(b) for b in buckets)))
            if not sizes or sizes[0] < 1:
                raise ValueError(f"buckets must be a non-empty list of ints >= 1, got {buckets}")
            if max_size is not None and sizes[-1] != max_size:
                raise ValueError(f"largest bucket {sizes[-1]} != max_size {max_size}")
        self.buckets: tuple[int, ...] = sizes

    @property
    def max(self) -> int:
        """The largest bucket: the row count static buffers are allocated for."""
        return self.buckets[-1]

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def __repr__(self) -> str:
        return f"BucketLadder({list(self.buckets)})"

    def descending(self) -> Sequence[int]:
        """Capture order: largest first, so smaller buckets reuse the shared pool's blocks."""
        return self.buckets[::-1]

    def choose(self, n: int) -> int | None:
        """Smallest bucket >= n; None when n exceeds the largest (the caller runs eagerly).

        n = 0 (a rank with no rows this step still takes part in the collectives) gives the
        smallest bucket.
        """
        if n < 0:
            raise ValueError(f"row count must be >= 0, got {n}")
        i = bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None
