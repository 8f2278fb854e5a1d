"""Page allocator for one rank's KV pool: a free list of page ids."""

from __future__ import annotations

from helix.errors import CapacityError


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"KV pool full: need {n} pages, {len(self._free)} free; "
                                f"raise --num-pages or lower --max-batch")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
