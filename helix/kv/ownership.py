"""The KV ownership rule, and the one place its page arithmetic lives.

Position p lives on KVP rank (p // I) % kvp, I = kv_interleave; its local index there is
(p // (kvp*I)) * I + p % I. The free functions work on ints and on integer tensors; `KVSharding`
answers the per-rank questions every other module asks (positions and pages a length needs on a
rank, the worst rank, all ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def kv_owner(p, kvp: int, interleave: int):
    return (p // interleave) % kvp


def local_index(p, kvp: int, interleave: int):
    return (p // (kvp * interleave)) * interleave + p % interleave


def local_to_global(j, kvp_rank: int, kvp: int, interleave: int):
    """Inverse of local_index on rank `kvp_rank`: global position of local index j."""
    return (j // interleave) * (kvp * interleave) + kvp_rank * interleave + j % interleave


def local_len(length: int, kvp_rank: int, kvp: int, interleave: int) -> int:
    """How many of positions [0, length) rank `kvp_rank` owns. KVP rank 0 always owns the most."""
    if kvp == 1:
        return length
    cycle = kvp * interleave
    full, rem = divmod(length, cycle)
    return full * interleave + min(max(rem - kvp_rank * interleave, 0), interleave)


@dataclass(frozen=True)
class KVSharding:
    """How a sequence's KV spreads over the KVP ranks and their pages."""

    kvp: int                # KVP degree
    interleave: int         # kv_interleave I
    page_size: int          # KV positions per page, per rank

    def local_len(self, length: int, rank: int) -> int:
        """Positions of [0, length) held by KVP rank `rank`."""
        return local_len(length, rank, self.kvp, self.interleave)

    def pages(self, length: int, rank: int) -> int:
        """Pages KVP rank `rank` holds for a sequence of `length` positions."""
        return -(-self.local_len(length, rank) // self.page_size)

    def max_pages(self, length: int) -> int:
        """Pages of the rank that holds the most (KVP rank 0 owns at least as many positions as
        any other): what admission and block-table widths size for."""
        return self.pages(length, 0)

    @property
    def block_tokens(self) -> int:
        """The fewest positions from 0 whose pages are whole on every rank (a prefix-cache
        block): kvp x lcm(page_size, I). Block b fills pages [b*block_pages, (b+1)*block_pages)
        of every rank."""
        return self.kvp * math.lcm(self.page_size, self.interleave)

    @property
    def block_pages(self) -> int:
        """Pages of one block on each rank."""
        return math.lcm(self.page_size, self.interleave) // self.page_size

    def pages_per_rank(self, length: int) -> list[int]:
        return [self.pages(length, r) for r in range(self.kvp)]
