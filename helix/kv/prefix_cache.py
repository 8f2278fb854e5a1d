"""Prefix caching: KV blocks written for one request, reused by later requests whose tokens start
the same way (a system prompt, a document asked about again, the earlier turns of a chat).

A block is `KVSharding.block_tokens` consecutive positions from a multiple of that size: the
span that fills whole pages on every KVP rank (`block_pages` each), so a block is shared by
pointing a sequence's leading page-table entries at its pages on every rank, and the positions
after a hit start on fresh pages (nothing is written into a shared page). A block is named by
its tokens and its parent block (its whole prefix): exact, no hash collisions.

This index is rank-independent: the scheduler, replicated on every rank, owns it, so every rank
takes the same hits, registers the same blocks and evicts the same ones. What it decides joins
the scheduler's KV op stream, which each rank's `KVManager.apply_ops` applies in order:
("attach", seq, [block ids]) - a new sequence starts with these blocks; ("register", seq, index,
block id) - the sequence's pages of block `index` become that block; ("evict", block id) - the
block's pages return to the pool; with a host tier ("offload", block id, slot) - the block's KV
goes to host slot `slot` and its pages return to the pool, ("load", block id, slot) - it comes
back into newly taken pages.

The host tier (`host_slots` > 0, helix/kv/host_cache.py): a block evicted from the device pool
keeps its KV in host memory instead of being dropped (a million-token prompt costs minutes to
prefill again, and host memory holds many times the device pool), least recently used out when
the host slots are full. A hit on a host block loads it back before the request's first step
reads it (the copies are queued on the step's stream, in order).

Pages are counted as the scheduler counts them (KVP rank 0's, and a block holds `block_pages` on
every rank). A block is live while a request holds it (refs > 0) and idle after; idle blocks
stay cached and are evicted least recently used first when pages are needed. A request that
holds a block holds its whole prefix, and blocks released together are queued deepest first, so
eviction takes leaves before their parents.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    id: int
    key: tuple                  # (parent block id or -1, its tokens)
    refs: int = 0               # requests holding it
    slot: int | None = None     # its host slot while its KV is in host memory, not on the device


class PrefixCache:
    def __init__(self, block_tokens: int, block_pages: int, ops: list | None = None,
                 host_slots: int = 0):
        self.block_tokens, self.block_pages = block_tokens, block_pages
        self.host: OrderedDict[int, Block] = OrderedDict()   # blocks in host memory, LRU first
        self.free_slots = list(range(host_slots - 1, -1, -1))
        self.host_hit_tokens = 0                  # ... of the hits, read from host memory
        self.forgotten = 0                        # blocks ever dropped from the index (a walk
                                                  # made before the last drop may be stale)
        self.index: dict[tuple, Block] = {}
        self.blocks: dict[int, Block] = {}
        self.idle: OrderedDict[int, Block] = OrderedDict()   # least recently used first
        self.chains: dict[int, list[Block]] = {}  # request id -> the blocks it holds, in order
        self.frozen: set[int] = set()             # requests that register no more blocks
        self.ops: list[tuple] = [] if ops is None else ops   # the scheduler's KV op stream
        self.query_tokens = 0                     # prompt positions looked up (first admissions)
        self.hit_tokens = 0                       # ... of them found cached
        self._next = 0

    @property
    def idle_pages(self) -> int:
        return len(self.idle) * self.block_pages

    def held(self, req_id: int) -> int:
        """Pages of the blocks a request holds."""
        return len(self.chains.get(req_id, ())) * self.block_pages

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, tokens, limit: int, found: list[Block] = ()) -> list[Block]:
        """The cached blocks that start a sequence, covering at most `limit` positions;
        tokens(a, b): its token ids at positions [a, b). found: the result of an earlier walk
        (no block dropped since): the walk goes on from its end."""
        B = self.block_tokens
        found = list(found[:limit // B])
        parent = found[-1].id if found else -1
        for b in range(len(found), limit // B):
            block = self.index.get((parent, tuple(tokens(b * B, (b + 1) * B))))
            if block is None:
                break
            found.append(block)
            parent = block.id
        return found

    def acquire(self, req_id: int, blocks: list[Block]) -> tuple[int, list[Block]]:
        """A new request will start with these blocks -> (pages of idle ones now live, the
        ones in host memory). Those leave the host's LRU (never dropped) until attach() loads
        them; between the two the caller makes room for them on the device."""
        revived, loading = 0, []
        for block in blocks:
            if block.slot is not None:
                del self.host[block.id]
                loading.append(block)
            elif block.refs == 0:
                del self.idle[block.id]
                revived += self.block_pages
            block.refs += 1
        self.chains[req_id] = list(blocks)
        return revived, loading

    def attach(self, req_id: int, loading: list[Block]) -> None:
        """acquire()'s blocks from host memory come back into device pages, and the request's
        sequence starts with its blocks."""
        for block in loading:
            self.ops.append(("load", block.id, block.slot))
            self.free_slots.append(block.slot)
            block.slot = None
        self.ops.append(("attach", req_id, [b.id for b in self.chains[req_id]]))

    def release(self, req_id: int) -> int:
        """A request holds no KV any more (it finished or was preempted): its sequence is freed
        (but its blocks' pages) and its blocks let go; returns the pages now idle."""
        self.frozen.discard(req_id)
        idle = 0
        for block in reversed(self.chains.pop(req_id, [])):     # deepest first: evicted first
            block.refs -= 1
            if block.refs == 0:
                self.idle[block.id] = block
                idle += self.block_pages
        return idle

    # -- growth -------------------------------------------------------------------------------
    def register(self, req_id: int, tokens, written: int) -> None:
        """The request's positions [0, written) hold its KV (tokens(a, b): its token ids at
        positions [a, b)): its full blocks past those it holds become cached blocks (its pages,
        now shared). A block another request registered first (both computed it) ends the
        request's registering: its pages for that block stay its own, and a chain must be a
        leading run of blocks."""
        if req_id in self.frozen:
            return
        chain, B = self.chains.setdefault(req_id, []), self.block_tokens
        for b in range(len(chain), written // B):
            key = (chain[-1].id if chain else -1, tuple(tokens(b * B, (b + 1) * B)))
            if key in self.index:
                self.frozen.add(req_id)
                return
            block = Block(self._next, key, refs=1)
            self._next += 1
            self.index[key] = self.blocks[block.id] = block
            chain.append(block)
            self.ops.append(("register", req_id, b, block.id))

    def evict(self, pages: int, offload: bool = True) -> int:
        """Evict idle blocks from the device, least recently used first, until `pages` are
        freed or none is idle (to host memory when it has a slot, or can free one by dropping
        its own least recently used block); returns the device pages freed."""
        freed = 0
        while freed < pages and self.idle:
            _, block = self.idle.popitem(last=False)
            if offload and not self.free_slots and self.host:
                self._forget(self.host.popitem(last=False)[1])
            if offload and self.free_slots:
                block.slot = self.free_slots.pop()
                self.host[block.id] = block
                self.ops.append(("offload", block.id, block.slot))
            else:
                self._forget(block)
                self.ops.append(("evict", block.id))
            freed += self.block_pages
        return freed

    def _forget(self, block: Block) -> None:
        """Out of the index (a block in host memory gives its slot back: no op, the slot's data
        is simply overwritten later)."""
        del self.index[block.key], self.blocks[block.id]
        self.forgotten += 1
        if block.slot is not None:
            self.free_slots.append(block.slot)
            block.slot = None

    def clear(self) -> int:
        """Drop every idle block, in host memory too; returns the device pages freed."""
        while self.host:
            self._forget(self.host.popitem(last=False)[1])
        return self.evict(self.idle_pages, offload=False)
