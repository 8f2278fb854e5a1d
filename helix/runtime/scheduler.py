"""Continuous batching with chunked prefill and paged admission, replicated on every rank: given
the same commands in the same order, every rank plans the same steps.

Pages are counted as KVP rank 0 holds them (it owns at least as many positions of any sequence as
any other rank), so a plan that fits rank 0's pool fits every rank's. A request holds the pages of
the positions it has written, not its worst case: admission needs room for its first chunk plus
one page per running request (so their decodes can grow; with nothing running, the whole pool),
pages are taken as sequences grow, and when a decode row finds the pool full the newest running
request is preempted: its pages are freed and it goes back to the head of the queue, to be
recomputed (prompt and generated tokens prefilled again) when it is re-admitted. A request may
overtake a queue head that does not fit, at most `MAX_OVERTAKES` times per head; then the head
blocks the queue until it fits.

With the priority policy (`scheduling="priority"`, SamplingParams.priority: lower runs first)
the queue is admitted in priority order (then arrival), a request that must make room
preempts the lowest-priority running one (then the newest), and the queue's best request,
when it does not fit, preempts running requests of lower priority until it does.

With a prefix cache (helix/kv/prefix_cache.py) a request admitted for the first time, or again
after preemption, starts with the cached blocks that begin its tokens and prefills from there;
the full blocks a request has written become cached as it runs (and when it ends or loses its
KV). Pages of blocks some request holds count as used; idle cached blocks count as free, and are
evicted (least recently used first) when the pages are taken: to host memory when the cache has
a host tier, whence a hit loads them back into pages it takes like any request's.

With speculative decoding (helix/runtime/speculative.py) a running request whose n-gram draft
finds guesses runs them as a chunk of its last token and the guesses instead of a decode row
(planned with the decode rows, before any prompt chunk, its pages held for every guess, the
guesses counted against the step's max_prefill_tokens); the engine releases the pages of the
guesses the model rejected (`verified`).

Each step: one decode row per running request that has finished its prefill, then prefill chunks
of at most `max_prefill_tokens` tokens in all (running requests still prefilling first, then
newly admitted ones), or `idle_prefill_tokens` in a step without decode rows (no request waits
on it; fewer, longer chunks reach the first token sooner). Rows are planned in that order:
decode rows first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from helix.kv.ownership import KVSharding
from helix.kv.prefix_cache import PrefixCache
from helix.runtime.request import Request
from helix.runtime.speculative import Drafter

MAX_OVERTAKES = 8


@dataclass
class Chunk:
    req: Request
    start: int                  # first position
    ids: list[int]              # token ids of positions [start, start + len(ids))
    samples: bool               # its last row yields the request's first generated token
    draft: int = 0              # speculative: ids[1:] are this many guesses to verify (every
                                # row yields a token; ids[0] is the request's last token)


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)     # one row each, first in the batch
    prefill: list[Chunk] = field(default_factory=list)      # then these chunks, in order
    preempted: list[Request] = field(default_factory=list)  # KV dropped this step (free pages)

    @property
    def requests(self) -> list[Request]:
        return self.decode + [c.req for c in self.prefill]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(len(c.ids) for c in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, num_pages: int, sharding: KVSharding, max_batch: int,
                 max_prefill_tokens: int, idle_prefill_tokens: int | None = None,
                 prefix_caching: bool = False, host_slots: int = 0, policy: str = "fcfs",
                 drafter: Drafter | None = None):
        self.num_pages, self.sharding = num_pages, sharding
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.idle_prefill_tokens = max(max_prefill_tokens, idle_prefill_tokens or 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # in admission order
        self.pages: dict[int, int] = {}       # request id -> pages its sequence spans (rank 0's
                                              # count), cached blocks it holds included
        self.used = 0                         # pages requests hold: their own, and those of the
                                              # cached blocks any of them holds
        self.kv_ops: list[tuple] = []         # what every rank's KV manager applies next, in
                                              # order (KVManager.apply_ops)
        self.cache = (PrefixCache(sharding.block_tokens, sharding.block_pages, self.kv_ops,
                                  host_slots) if prefix_caching else None)
        # a waiting request's cache walk and its prompt heads' matches, kept across the steps
        # it waits (a long prompt would otherwise be hashed or compared whole every step)
        self._walks: dict[int, tuple[int, list]] = {}    # request id -> (forgotten, blocks)
        self._same_head: dict[int, dict[int, bool]] = {}  # request id -> running id -> equal
        self.policy = policy                  # fcfs | priority
        self.drafter = drafter                # speculative decoding's guesses, or None
        self.preemptions = 0                  # requests preempted so far
        self.dropped: list[Request] = []      # finished while waiting (abort, error)
        self._admitted = 0

    # -- accounting ---------------------------------------------------------------------------
    def pages_for(self, length: int) -> int:
        return self.sharding.max_pages(length)

    def free_pages(self) -> int:
        """Pages a request may take: free ones and idle cached blocks'."""
        return self.num_pages - self.used

    def _hold(self, r: Request, n: int) -> None:
        """r's sequence now spans n pages; idle cached blocks are evicted to make the room."""
        self.used += n - self.pages.get(r.id, 0)
        self.pages[r.id] = n
        self._reclaim()

    def _reclaim(self) -> None:
        """Evict idle cached blocks until the pool holds what is used and what stays cached."""
        if self.cache is not None:
            over = self.used + self.cache.idle_pages - self.num_pages
            if over > 0:
                self.cache.evict(over)

    def _drop(self, r: Request) -> None:
        """r holds no KV any more: its own pages are free, its cached blocks' maybe idle."""
        self.used -= self.pages.pop(r.id, 0)
        self._forget_waiting(r)
        if self.cache is not None:
            self._register(r)
            self.used += self.cache.held(r.id) - self.cache.release(r.id)
        self.kv_ops.append(("free", r.id))

    def take_kv_ops(self) -> list[tuple]:
        """The KV ops decided since the last call (frees, prefix-cache attach / register /
        evict), in order: a request preempted and admitted again in one step is freed before
        it is attached."""
        ops = self.kv_ops[:]
        self.kv_ops.clear()
        return ops

    # -- prefix cache -------------------------------------------------------------------------
    def _register(self, r: Request) -> None:
        """r's full blocks written so far (and whose tokens the host knows) become cached."""
        if r.shares_kv:
            self.cache.register(r.id, r.tokens, min(r.computed, r.known))

    def _register_due(self) -> None:
        """_register for the running requests that completed a block since they last did (per
        row and step: the test is all most rows pay)."""
        chains, B = self.cache.chains, self.sharding.block_tokens
        for r in self.running:
            if r.computed // B > len(chains.get(r.id, ())):      # (computed >= what _register
                self._register(r)                               # takes: the cheap test first)

    def _cached_blocks(self, r: Request) -> list:
        """The cached blocks that begin a request being admitted (none without a cache)."""
        if (self.cache is None or not r.shares_kv or r.computed
                or r.params.prompt_logprobs is not None):   # prompt scores need every prompt
            return []                                       # position prefilled here
        seen = self._walks.get(r.id)
        blocks = self.cache.lookup(r.tokens, r.cache_limit,
                                   seen[1] if seen and seen[0] == self.cache.forgotten else ())
        self._walks[r.id] = (self.cache.forgotten, blocks)
        return blocks

    def _forget_waiting(self, r: Request) -> None:
        """r was admitted or holds no KV: its walk and head matches are stale."""
        self._walks.pop(r.id, None)
        self._same_head.pop(r.id, None)

    def _defers(self, r: Request) -> bool:
        """r waits while a running request prefills the first half (or more) of r's prompt: r
        then reads those positions from the cache instead of prefilling them beside it (n
        choices of one prompt, the same document asked twice at once). Not for a shared prefix
        shorter than that (a common system prompt before long, different questions), where
        waiting would cost r a step to save less than it prefills anyway."""
        if not r.shares_kv or r.computed or r.params.prompt_logprobs is not None:
            return False
        B = self.sharding.block_tokens
        need = max(B, len(r.prompt) // 2) // B * B
        if need > r.cache_limit:
            return False
        same = self._same_head.setdefault(r.id, {})
        for q in self.running:
            if q.prefilling and q.shares_kv and q.computed < need:
                if q.id not in same:
                    same[q.id] = q.prompt[:need] == r.prompt[:need]
                if same[q.id]:
                    return True
        return False

    def _take_cached(self, r: Request, blocks: list) -> None:
        """r starts with these cached blocks: its first chunk begins after them."""
        self._forget_waiting(r)
        B = self.sharding.block_tokens
        if not r.preemptions:                   # hit rate: over first admissions
            self.cache.query_tokens += len(r.prompt)
            self.cache.hit_tokens += len(blocks) * B
            self.cache.host_hit_tokens += sum(b.slot is not None for b in blocks) * B
        if blocks:
            revived, loading = self.cache.acquire(r.id, blocks)
            self.used += revived + len(loading) * self.sharding.block_pages
            self._reclaim()                     # room for the ones coming from host memory
            self.cache.attach(r.id, loading)
            r.computed = len(blocks) * B
            self.pages[r.id] = self.pages_for(r.computed)
            if not r.preemptions:
                r.cached = r.computed

    def reset_cache(self) -> int:
        """Evict every idle cached block; returns the pages freed."""
        return self.cache.clear() if self.cache is not None else 0

    @property
    def cached_pages(self) -> int:
        """Pages of idle cached blocks (counted free)."""
        return self.cache.idle_pages if self.cache is not None else 0

    def _fit(self, start: int, n: int, free: int, have: int) -> int:
        """The longest chunk <= n from `start` of a sequence spanning `have` pages whose new
        pages fit `free` (pages grow with length)."""
        if self.pages_for(start + n) - have <= free:
            return n
        lo, hi = 0, n                  # lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.pages_for(start + mid) - have <= free else (lo, mid)
        return lo

    # -- commands -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req_id: int) -> Request | None:
        for r in list(self.waiting) + self.running:
            if r.id == req_id and not r.finished:
                r.finish_reason = "abort"
                return r
        return None

    # -- planning -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if self.cache is not None:
            self._register_due()
        if self.policy == "priority":
            self._room_for_priority(plan)
        spare = self.max_prefill_tokens                 # guesses ride on the prompt budget
        for r in list(self.running):                    # decode rows, oldest first
            if r.finished or r.exhausted or r.prefilling or (plan.preempted
                                                             and r not in self.running):
                continue
            guess = self.drafter.draft(r)[:spare] if self.drafter is not None else []
            n = self.pages_for(r.num_tokens + len(guess))
            need = n - self.pages.get(r.id, 0)
            while need > self.free_pages():
                planned = {id(q) for q in plan.requests}   # (rows planned stay in the plan)
                victim = self._victim([q for q in self.running if id(q) not in planned])
                self._preempt(victim, plan)
                if victim is r:
                    break
            if not plan.preempted or r in self.running:
                self._hold(r, n)
                if guess:
                    plan.prefill.append(Chunk(r, r.num_tokens - 1, [r.output[-1]] + guess,
                                              True, len(guess)))
                    spare -= len(guess)
                else:
                    plan.decode.append(r)
        budget = self._plan_prefill(plan, spare)
        while not plan and len(self.running) > 1 and any(   # prompts blocked on pages
                r.prefilling and not r.pending and not r.finished for r in self.running):
            self._preempt(self._victim(self.running), plan)     # make room
            budget = self._plan_prefill(plan)
        self._admit(budget, plan)
        return plan

    def _plan_prefill(self, plan: StepPlan, spare: int | None = None) -> int:
        """Chunks of running requests still prefilling, oldest first; returns the budget left.
        spare: the busy budget left by guesses to verify."""
        busy = plan.decode or plan.prefill           # (decode rows, or guesses to verify)
        budget = ((self.max_prefill_tokens if spare is None else spare) if busy
                  else self.idle_prefill_tokens)
        for r in self.running:
            if budget <= 0:
                break
            if r.finished or r.pending or not r.prefilling or r in plan.decode:
                continue
            budget -= self._plan_chunk(r, budget, plan)
        return budget

    def _plan_chunk(self, r: Request, budget: int, plan: StepPlan) -> int:
        start, ids, samples = r.chunk(budget)
        n = self._fit(start, len(ids), self.free_pages(), self.pages.get(r.id, 0))
        if n == 0:
            return 0
        if n < len(ids):
            ids, samples = ids[:n], False
        self._hold(r, self.pages_for(start + n))
        plan.prefill.append(Chunk(r, start, ids, samples))
        return n

    def _admit(self, budget: int, plan: StepPlan) -> None:
        head_blocked = None
        for r in self._queue_order():
            if budget <= 0 or len(self.running) >= self.max_batch:
                return
            if r.finished:
                self.waiting.remove(r)
                self.dropped.append(r)
                self._forget_waiting(r)
                continue
            if r.pending:                  # preempted with a token still on its way: next step
                continue
            if self.cache is not None and self._defers(r):
                continue
            blocks = self._cached_blocks(r)
            start = len(blocks) * self.sharding.block_tokens if blocks else r.computed
            n = min(start + budget, r.prefill_end) - start
            # pages its hit makes live: idle blocks', and those coming back from host memory
            revived = sum(b.refs == 0 for b in blocks) * self.sharding.block_pages
            # a page of headroom per running request, so their decodes can grow
            free = self.free_pages() - len(self.running) - revived
            fits = self._fit(start, n, free, self.pages_for(start) if blocks else 0)
            if fits == 0 and (n or free < 0):
                if head_blocked is None:
                    head_blocked = r
                    if r.skipped >= MAX_OVERTAKES:
                        return             # fairness: the head has been overtaken enough
                continue
            if head_blocked is not None:
                head_blocked.skipped += 1
            self.waiting.remove(r)
            r.admitted = self._admitted
            self._admitted += 1
            self.running.append(r)
            if self.cache is not None:
                self._take_cached(r, blocks)
            budget -= self._plan_chunk(r, budget, plan)
            if head_blocked is not None and head_blocked.skipped >= MAX_OVERTAKES:
                return

    def _victim(self, candidates: list[Request]) -> Request:
        """Who makes room: the newest (fcfs), or the lowest priority, then the newest."""
        if self.policy == "priority":
            return max(candidates, key=lambda q: (q.params.priority, q.admitted))
        return candidates[-1]

    def _queue_order(self) -> list[Request]:
        """The queue as admission takes it: arrival order (preempted requests first), or by
        priority, then arrival."""
        if self.policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.params.priority, r.id))
        return list(self.waiting)

    def _room_for_priority(self, plan: StepPlan) -> None:
        """The queue's best request preempts running requests of lower priority, lowest first,
        until its first chunk fits (with a page of headroom per running request, counted
        without cache hits) and the batch has a free row."""
        head = next((r for r in self._queue_order() if not r.pending and not r.finished), None)
        if head is None:
            return
        end = min(head.prefill_end, head.computed + self.max_prefill_tokens)
        while True:
            lower = [q for q in self.running if q.params.priority > head.params.priority]
            fits = (len(self.running) < self.max_batch and
                    self.pages_for(end) + len(self.running) <= self.free_pages())
            if fits or not lower:
                return
            self._preempt(self._victim(lower), plan)

    def _preempt(self, r: Request, plan: StepPlan) -> None:
        self.preemptions += 1
        self.running.remove(r)
        self._drop(r)
        r.reset_kv()
        self.waiting.appendleft(r)
        plan.preempted.append(r)

    # -- after a step -------------------------------------------------------------------------
    def verified(self, r: Request) -> None:
        """r's guesses were checked: its KV holds r.computed positions, the pages past them
        (rejected guesses') are released."""
        self._hold(r, self.pages_for(r.computed))

    def retire(self) -> list[Request]:
        """Drop finished requests from the batch and the queue, and release their pages."""
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        done += [r for r in self.waiting if r.finished]
        self.waiting = deque(r for r in self.waiting if not r.finished)
        for r in done:
            self._drop(r)
        done, self.dropped = self.dropped + done, []
        if self.drafter is not None:
            for r in done:
                self.drafter.drop(r.id)
        return done

    def stats(self) -> dict:
        cache = self.cache
        return {"running": len(self.running), "queued": len(self.waiting),
                "pages_used": self.used, "pages_free": self.free_pages(),
                "num_pages": self.num_pages,
                "pages_cached": self.cached_pages, "preemptions": self.preemptions,
                "prefix_cache_queries": cache.query_tokens if cache else 0,
                "prefix_cache_hits": cache.hit_tokens if cache else 0,
                "prefix_cache_host_hits": cache.host_hit_tokens if cache else 0,
                "host_blocks_cached": len(cache.host) if cache else 0}
