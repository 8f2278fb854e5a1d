"""Continuous batching, replicated on every rank: given the same commands in the same order,
every rank admits, schedules and finishes the same requests.

Admission reserves the request's worst-case KV pages (prompt + max_new_tokens) on KVP rank 0,
which owns the most positions of any sequence, so no rank ever runs out mid-request and nothing
is preempted. A request that could never fit is refused when it is added.
"""

from __future__ import annotations

from collections import deque

from helix.kv.ownership import KVSharding
from helix.runtime.request import Request


class Scheduler:
    def __init__(self, num_pages: int, page_size: int, kvp: int, interleave: int, max_batch: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.sharding = KVSharding(kvp, interleave, page_size)
        self.max_batch = max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[int, int] = {}
        self.dropped: list[Request] = []      # aborted while waiting

    def pages_for(self, length: int) -> int:
        return self.sharding.max_pages(length)

    def free_pages(self) -> int:
        return self.num_pages - sum(self.reserved.values())

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req_id: int) -> Request | None:
        for r in list(self.waiting):
            if r.id == req_id:
                self.waiting.remove(r)
                r.finish_reason = "abort"
                self.dropped.append(r)
                return r
        for r in self.running:
            if r.id == req_id:
                r.finish_reason = "abort"
                return r
        return None

    def schedule(self) -> list[Request]:
        """Admit waiting requests (FIFO) while pages and batch slots last; return the batch."""
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            need = self.pages_for(req.max_len)
            if need > self.free_pages():
                break
            self.waiting.popleft()
            self.reserved[req.id] = need
            self.running.append(req)
        return list(self.running)

    def retire(self) -> list[Request]:
        """Drop finished requests from the batch and release their reservations."""
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        for r in done:
            self.reserved.pop(r.id, None)
        done, self.dropped = done + self.dropped, []
        return done
