"""The prefix cache (helix/kv/prefix_cache.py): the KV of full blocks written for one request is
kept after it and a later request whose tokens begin the same way starts from it.

Checked three ways: the index alone (lookup, chaining, leaves-first eviction, a block computed
twice); the scheduler and one KV manager per KVP rank driven together through a random workload
with shared prefixes, preemption and eviction (the page accounting is exact on every step and no
page is in two places); and whole runs on tiny checkpoints against transformers and against the
same run without the cache (one process, and KVP ranks over gloo).
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_fixtures import SMALL, VOCAB, hf_greedy

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.kv import KVManager
from helix.kv.ownership import KVSharding, local_len
from helix.kv.prefix_cache import PrefixCache
from helix.runtime.request import Request
from helix.runtime.scheduler import Scheduler


def view(tokens: list[int]):
    return lambda a, b: tokens[a:b]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


# -- the index -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kvp,interleave,page", [(1, 1, 16), (2, 1, 4), (2, 3, 4), (3, 8, 4),
                                                 (4, 2, 6)])
def test_a_block_is_the_fewest_positions_that_fill_whole_pages_on_every_rank(kvp, interleave,
                                                                               page):
    s = KVSharding(kvp, interleave, page)
    B = s.block_tokens
    for k in range(1, 4):
        assert [local_len(k * B, r, kvp, interleave) for r in range(kvp)] == \
            [k * s.block_pages * page] * kvp
    for m in range(1, B):          # anything shorter leaves a partial page or unequal ranks
        held = [local_len(m, r, kvp, interleave) for r in range(kvp)]
        assert len(set(held)) > 1 or held[0] % page


def test_lookup_matches_whole_blocks_of_the_same_prefix_only():
    c = PrefixCache(4, 1)
    toks = list(range(10))
    c.register(0, view(toks), 10)                       # blocks [0:4], [4:8]; 8, 9 partial
    assert c.ops == [("register", 0, 0, 0), ("register", 0, 1, 1)]
    assert [b.id for b in c.lookup(view(toks), 10)] == [0, 1]
    assert [b.id for b in c.lookup(view(toks), 7)] == [0]          # the limit
    assert [b.id for b in c.lookup(view(toks[:4] + [9] * 6), 10)] == [0]
    # the same second block after another first one is another block (its prefix differs)
    assert c.lookup(view([99] + toks[1:]), 10) == []


def test_released_blocks_go_idle_leaves_first_and_are_evicted_least_recently_used_first():
    c = PrefixCache(2, 3)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 7, 8]
    c.register(0, view(a), 6)                           # a0 a1 a2
    assert c.acquire(1, c.lookup(view(b), 3)) == (0, [])   # a0, live: nothing revived
    c.register(1, view(b), 4)                           # b1 (child of a0)
    assert c.held(1) == 6
    assert c.release(0) == 6                            # a2, a1 idle; a0 still held
    assert c.release(1) == 6                            # b1, a0
    assert list(c.idle) == [2, 1, 3, 0] and c.idle_pages == 12
    c.ops.clear()
    assert c.evict(7) == 9                              # whole blocks: a2, a1, b1
    assert c.ops == [("evict", 2), ("evict", 1), ("evict", 3)]
    assert [x.id for x in c.lookup(view(a), 6)] == [0]
    assert c.acquire(2, c.lookup(view(a), 6)) == (3, [])   # a0 was idle: pages revived
    assert not c.idle and c.clear() == 0


def test_a_host_tier_keeps_evicted_blocks_until_its_slots_are_full():
    c = PrefixCache(2, 1, host_slots=2)
    t = [1, 2, 3, 4, 5, 6]
    c.register(0, view(t), 6)                           # b0 b1 b2
    c.release(0)                                        # idle: b2, b1, b0
    c.ops.clear()
    assert c.evict(3) == 3                    # b2, b1 to host; then b2 (the host's LRU) is
    assert c.ops == [("offload", 2, 0), ("offload", 1, 1), ("offload", 0, 0)]   # dropped for b0
    assert list(c.host) == [1, 0] and 2 not in c.blocks
    c.ops.clear()
    found = c.lookup(view(t), 5)                        # b0, b1: both in host memory
    assert [b.id for b in found] == [0, 1]
    assert c.acquire(7, found) == (0, found) and not c.host
    c.attach(7, found)
    assert c.ops == [("load", 0, 0), ("load", 1, 1), ("attach", 7, [0, 1])]
    assert sorted(c.free_slots) == [0, 1] and all(b.slot is None for b in found)
    c.release(7)
    assert c.clear() == 2 and not c.blocks and c.ops[-2:] == [("evict", 1), ("evict", 0)]


def test_a_block_computed_twice_stays_with_its_first_writer():
    c = PrefixCache(2, 1)
    t = [4, 5, 6, 7]
    c.register(0, view(t), 4)
    c.register(1, view(t), 4)                           # both prefilled it: 1 keeps its pages
    c.register(1, view(t + [8, 9]), 6)                  # ... and registers nothing after it
    assert c.ops == [("register", 0, 0, 0), ("register", 0, 1, 1)]
    assert c.held(1) == 0 and c.release(1) == 0


# -- the scheduler and every KVP rank's pages, together ------------------------------------------
def _check_pages(sched: Scheduler, mgrs: list[KVManager], num_pages: int) -> None:
    cache = sched.cache
    # rank 0 holds what the scheduler counts: requests' pages and idle blocks', exactly
    assert num_pages - mgrs[0].alloc.num_free == sched.used + cache.idle_pages
    on_device = {b for b, block in cache.blocks.items() if block.slot is None}
    assert set(cache.host) == set(cache.blocks) - on_device
    for m in mgrs:
        assert set(m.block_pages) == on_device           # every rank caches the same blocks
        owner: dict[int, object] = {}
        for b, pages in m.block_pages.items():
            for p in pages:
                assert owner.setdefault(p, ("block", b)) == ("block", b)
        for seq, pages in m.pages.items():
            n = m.shared.get(seq, 0)
            chain = cache.chains.get(seq, [])
            assert pages[:n] == [p for b in chain for p in m.block_pages[b.id]]
            for p in pages[n:]:                           # own pages: nobody else's
                assert owner.setdefault(p, ("seq", seq)) == ("seq", seq)
        assert not set(owner) & set(m.alloc._free)         # nothing held is also free
        assert len(owner) + m.alloc.num_free == num_pages


class SlotCheck:
    """A host tier for the KV managers without data: each load must read the slot its block
    was offloaded to, not overwritten since (checked on the op stream)."""

    def __init__(self):
        self.owner: dict[int, int] = {}
        self.loads = 0

    def see(self, ops: list[tuple]) -> None:
        for op in ops:
            if op[0] == "offload":
                self.owner[op[2]] = op[1]
            elif op[0] == "load":
                assert self.owner.pop(op[2]) == op[1], op
                self.loads += 1

    def offload(self, pages, slot):
        pass

    def load(self, slot, pages):
        pass


@pytest.mark.parametrize("host_slots", [0, 4], ids=["device", "host4"])
@pytest.mark.parametrize("kvp,interleave,page", [(1, 1, 2), (2, 1, 2), (2, 3, 2), (3, 2, 4)])
def test_scheduler_and_kv_managers_agree_through_hits_preemption_and_eviction(kvp, interleave,
                                                                             page, host_slots):
    """Requests from three shared prefixes, joining at random steps, in a pool that holds a few
    of them: hits, preemptions and evictions all happen (with a host tier: offloads and loads
    too), and after every step the scheduler's count is rank 0's pool, every rank holds the
    same blocks, and no page is in two places."""
    rng = random.Random(kvp * 100 + interleave * 10 + page)
    sharding = KVSharding(kvp, interleave, page)
    B = sharding.block_tokens
    num_pages = sharding.max_pages(10 * B)        # about two of the longest requests
    sched = Scheduler(num_pages, sharding, max_batch=6, max_prefill_tokens=4 * B,
                      prefix_caching=True, host_slots=host_slots)
    mgrs = [KVManager(num_pages, page, k, kvp, interleave) for k in range(kvp)]
    host = SlotCheck()
    stems = [[rng.randrange(1, 50) for _ in range(3 * B)] for _ in range(3)]
    rid, done, preempted, steps = 0, 0, 0, 0
    while done < 30:
        steps += 1
        assert steps < 2000, "the workload did not finish"
        if rid < 30 and rng.random() < 0.5:
            stem = rng.choice(stems)[:rng.randrange(B, 3 * B + 1)]
            prompt = stem + [rng.randrange(50, 99) for _ in range(rng.randrange(1, B))]
            sched.add(Request(rid, prompt, greedy(rng.randrange(1, 4 * B)), 10 ** 6))
            rid += 1
        plan = sched.schedule()
        preempted += len(plan.preempted)
        ops = sched.take_kv_ops()
        host.see(ops)
        batch = [(r.id, r.num_tokens - 1, 1) for r in plan.decode]
        batch += [(c.req.id, c.start, len(c.ids)) for c in plan.prefill]
        for m in mgrs:
            m.apply_ops(ops, host)
            if batch:
                m.prepare(batch, "cpu")
        for r in plan.decode:                         # the engine's bookkeeping, no overlap
            r.computed = r.num_tokens
            r.output.append(rng.randrange(1, 99))
        for c in plan.prefill:
            c.req.computed = c.start + len(c.ids)
            if c.samples:
                c.req.output.append(rng.randrange(1, 99))
        for r in plan.requests:
            if len(r.output) >= r.params.max_new_tokens:
                r.finish_reason = "length"
        finished = sched.retire()
        ops = sched.take_kv_ops()
        host.see(ops)
        for m in mgrs:
            m.apply_ops(ops, host)
        done += len(finished)
        _check_pages(sched, mgrs, num_pages)
    assert sched.cache.hit_tokens > 0 and preempted > 0
    assert sched.cache._next > len(sched.cache.blocks)           # some blocks were dropped
    assert (host.loads > 0) == (host_slots > 0)
    assert (sched.cache.host_hit_tokens > 0) == (host_slots > 0)
    sched.reset_cache()
    assert not sched.cache.host and len(sched.cache.free_slots) == host_slots
    ops = sched.take_kv_ops()
    for m in mgrs:
        m.apply_ops(ops, host)
        assert m.alloc.num_free == num_pages and not m.block_pages
    assert sched.used == 0


# -- whole runs ------------------------------------------------------------------------------------
PREFIX = [(7 * i + 3) % VOCAB for i in range(41)]
P1, P2 = PREFIX + [5, 9, 11], PREFIX + [60, 61]


def _llm(path: str, layout: Layout | None = None, **runtime) -> LLM:
    return LLM(path, layout or Layout(), RuntimeConfig(**{**SMALL, **runtime}))


@pytest.mark.parametrize("family,overlap", [("llama", False), ("llama", True),
                                            ("deepseek_v3", False)])
def test_a_shared_prefix_is_read_from_the_cache_with_transformers_tokens(hf_checkpoint, family,
                                                                        overlap):
    """P2 shares P1's first 41 tokens; the next turn of P1's conversation holds P1, its answer
    and more. Each is prefilled from its first uncached position only, and its tokens equal
    transformers' greedy ones and those of the same run without the cache. With overlap a
    request's newest tokens are still on the device when its blocks are registered: only
    tokens the host has read count."""
    path, hf = hf_checkpoint(family)
    runs = {}
    for cache in (True, False):
        with _llm(path, prefix_caching=cache, overlap=overlap) as llm:
            a = llm.generate([P1], greedy(6))[0]
            turn = P1 + a + [33, 34]
            rb, rc = llm.add_request(P2, greedy(6)), None
            llm.step()
            rc = llm.add_request(turn, greedy(6))         # while P2 still decodes
            while llm.has_unfinished():
                llm.step()
            runs[cache] = (a, llm.outputs[rb], llm.outputs[rc], dict(llm.cached_tokens),
                           llm.prefill_tokens_per_rank()[0], llm.stats())
    a, b, c, cached, prefilled, stats = runs[True]
    assert (a, b, c) == runs[False][:3]
    assert b == hf_greedy(hf, P2, 6)[0] and c == hf_greedy(hf, P1 + a + [33, 34], 6)[0]
    # page 4, one rank: 4-token blocks. P2 finds PREFIX's 10 whole blocks; the turn finds P1 and
    # its answer as written (P1 + 5 of 6 tokens: 49 positions, 12 blocks)
    assert cached == {1: 40, 2: 48}
    assert prefilled == runs[False][4] - 40 - 48
    assert stats["prefix_cache_hits"] == 88
    assert stats["prefix_cache_queries"] == len(P1) + len(P2) + len(P1) + 6 + 2
    assert stats["kv_pages_used"] == [0] and stats["kv_pages_cached"] > 0
    assert runs[False][3] == {} and runs[False][5]["kv_pages_cached"] == 0


def test_a_tight_pool_preempts_evicts_and_keeps_the_tokens(hf_checkpoint):
    """A pool of 14 pages: requests sharing a prefix are preempted, resume from their own cached
    blocks, and evict idle ones; every token equals the run without the cache."""
    path, _ = hf_checkpoint("llama")
    prompts = [PREFIX[:20] + [i, i + 1, i + 2] for i in range(4)] + [PREFIX]
    runs = {}
    for cache in (True, False):
        with _llm(path, num_pages=14, prefix_caching=cache) as llm:
            ids = [llm.add_request(p, greedy(10)) for p in prompts]
            preempted = 0
            while llm.has_unfinished():
                llm.step()
                preempted = max([preempted] + [r.preemptions for r in
                                               llm.engine.scheduler.running])
            runs[cache] = [llm.outputs[i] for i in ids]
            assert preempted >= 1
            if cache:
                assert llm.stats()["prefix_cache_hits"] > 0
                assert llm.engine.scheduler.cache._next > len(llm.engine.scheduler.cache.blocks)
            assert llm.engine.kv_pages_free() == 14
    assert runs[True] == runs[False]


def test_a_request_waits_for_the_prefill_of_its_prompt_that_is_running(hf_checkpoint):
    """Two choices of one prompt (and a third request sharing its first half) added together:
    the first prefills, the others wait a step and read its blocks; a request sharing less than
    half its prompt (a common system prompt) is not held back. Tokens: transformers'."""
    path, hf = hf_checkpoint("llama")
    short = PREFIX[:8] + list(range(60, 100))        # shares 8 of 48 tokens: runs at once
    half = PREFIX[:28] + [1, 2, 3]                    # shares 28 of 31
    with _llm(path, max_prefill_tokens=256) as llm:
        ids = [llm.add_request(p, greedy(4)) for p in (P1, P1, half, short)]
        first = llm.step()
        running = {r.id for r in llm.engine.scheduler.running}
        while llm.has_unfinished():
            llm.step()
        assert running == {ids[0], ids[3]}
        assert first.num_tokens == len(P1) + len(short)
        assert llm.cached_tokens == {ids[1]: 40, ids[2]: 28}
        assert llm.prefill_tokens_per_rank() == [len(P1) + 4 + 3 + len(short)]
        for i, p in zip(ids, (P1, P1, half, short)):
            assert llm.outputs[i] == hf_greedy(hf, p, 4)[0]


def test_prompt_logprobs_prefill_the_whole_prompt(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    with _llm(path) as llm:
        first = llm.add_request(P1, greedy(2, prompt_logprobs=1))
        while llm.has_unfinished():
            llm.step()
        again = llm.add_request(P1, greedy(2, prompt_logprobs=1))
        plain = llm.add_request(P1, greedy(2))
        while llm.has_unfinished():
            llm.step()
        assert llm.cached_tokens == {plain: 40}             # the scored request took no hit
        assert len(llm.prompt_logprobs[again]) == len(P1)
        for x, y in zip(llm.prompt_logprobs[first][1:], llm.prompt_logprobs[again][1:]):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)


def test_reset_prefix_cache_returns_every_page(llama_ckpt):
    with _llm(llama_ckpt) as llm:
        llm.generate([P1], greedy(3))
        assert llm.stats()["kv_pages_cached"] == 11
        assert llm.engine.kv.alloc.num_free == llm.engine.num_pages - 11
        llm.reset_prefix_cache()
        llm.step()
        assert llm.stats()["kv_pages_cached"] == 0
        assert llm.engine.kv.alloc.num_free == llm.engine.num_pages
        rid = llm.add_request(P1, greedy(3))
        while llm.has_unfinished():
            llm.step()
        assert rid not in llm.cached_tokens                  # nothing left to hit


@pytest.mark.parametrize("family,layout", [
    ("llama", Layout(kvp=2, kv_interleave=3)),
    ("deepseek_v3", Layout(kvp=2)),
], ids=["llama-kvp2-i3", "deepseek_v3-kvp2"])
def test_kvp_ranks_take_the_same_hits(hf_checkpoint, family, layout):
    """Two gloo ranks: a block is 2 x lcm(4, I) positions, half on each rank; hits on both ranks'
    pages give transformers' tokens."""
    path, hf = hf_checkpoint(family)
    B = 2 * (12 if layout.kv_interleave == 3 else 4)
    with _llm(path, layout) as llm:
        a = llm.generate([P1], greedy(5))[0]
        turn = P1 + a + [33]
        outs = llm.generate([P2, turn], greedy(5))
        cached = dict(llm.cached_tokens)
    assert a == hf_greedy(hf, P1, 5)[0]
    assert outs == [hf_greedy(hf, P2, 5)[0], hf_greedy(hf, turn, 5)[0]]
    assert cached == {1: 41 // B * B, 2: (len(P1) + 4) // B * B}


# -- on the GPU: graphs over shared pages ----------------------------------------------------------
def _gpu_turns(model: str, dtype: str, cache: bool, graph_eager: bool = False):
    """A request, then one sharing its prompt's first 40 tokens and one holding its prompt and
    answer (the next turn), under decode and prefill graphs with overlapped steps."""
    rt = RuntimeConfig(device="cuda", dtype=dtype, page_size=16, max_batch=4,
                       graph_buckets=(1, 2, 4), attention_backend="triton",
                       graph_eager=graph_eager, prefix_caching=cache)
    with LLM(model, Layout(), rt) as llm:
        a = llm.generate([P1], greedy(8))[0]
        outs = llm.generate([P2, P1 + a + [33, 34]], greedy(8))
        return [a] + outs, dict(llm.cached_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_captured_steps_read_cached_blocks_as_eager_steps_do(model):
    """Decode and prefill graphs over block tables whose leading pages are cached blocks, and
    chunks that start after a hit: bitwise the eager steps' tokens (bf16); in fp32 the tokens of
    the same run without the cache."""
    captured, cached = _gpu_turns(model, "bfloat16", True)
    assert (captured, cached) == _gpu_turns(model, "bfloat16", True, graph_eager=True)
    assert cached == {1: 32, 2: 48}                  # 16-position blocks
    assert _gpu_turns(model, "float32", True)[0] == _gpu_turns(model, "float32", False)[0]


@pytest.mark.parametrize("layout,pages", [(Layout(), 16), (Layout(kvp=2), 8)],
                         ids=["kvp1", "kvp2"])
def test_blocks_evicted_to_host_memory_come_back_with_the_same_tokens(hf_checkpoint, layout,
                                                                      pages):
    """A pool of a few pages a rank and a host tier: the first conversation's blocks are pushed
    out to host memory by an unrelated request, and its next turn loads them back (KV copied
    out and in) instead of prefilling them; its tokens are transformers' and those without
    the host tier, where the same blocks were dropped and prefilled again."""
    path, hf = hf_checkpoint("llama")
    other = [(5 * i + 1) % VOCAB for i in range(40)]
    runs = {}
    for gb in (0.0, 0.01):
        with _llm(path, layout, num_pages=pages, host_cache_gb=gb) as llm:
            a = llm.generate([P1], greedy(6))[0]
            llm.generate([other], greedy(8))
            turn = P1 + a + [33, 34]
            (c,) = llm.generate([turn], greedy(6))
            stats = llm.stats()
            runs[gb] = (a, c, llm.prefill_tokens_per_rank()[0], stats)
            assert llm.engine.kv_pages_free() == pages
    (a, c, prefilled, stats), plain = runs[0.01], runs[0.0]
    assert (a, c) == plain[:2] and c == hf_greedy(hf, P1 + a + [33, 34], 6)[0]
    assert stats["prefix_cache_host_hits"] > 0
    assert plain[3]["prefix_cache_host_hits"] == 0
    assert prefilled < plain[2]                    # the turn's blocks were not prefilled again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tier_copies_on_the_stream_keep_the_tokens():
    """On CUDA the host tier's copies are asynchronous (pinned memory, the step's stream): a
    pool too small for two conversations, blocks pushed out and loaded back under graphs, the
    tokens those of the run that drops them instead (fp32)."""
    other = [(5 * i + 1) % VOCAB for i in range(40)]
    runs = []
    for gb in (0.0, 0.01):
        rt = RuntimeConfig(device="cuda", dtype="float32", page_size=16, max_batch=4,
                           max_context=256, num_pages=5, graph_buckets=(1, 2, 4),
                           attention_backend="triton", host_cache_gb=gb)
        with LLM("tiny-llama", Layout(), rt) as llm:
            a = llm.generate([P1], greedy(8))[0]
            llm.generate([other], greedy(8))
            c = llm.generate([P1 + a + [33, 34]], greedy(8))[0]
            runs.append((a, c, llm.stats()["prefix_cache_host_hits"]))
    assert runs[0][:2] == runs[1][:2] and runs[0][2] == 0 < runs[1][2]


def _random_workload(path: str, seed: int, **runtime) -> tuple[dict, dict]:
    """Requests from shared stems joining at random steps, some aborted mid-way, in a small
    pool, with overlapped steps: each request's finish and tokens (greedy; "aborted" for those
    an abort was sent to: with the cache they may end sooner) and the engine's stats."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, VOCAB) for _ in range(24)] for _ in range(2)]
    out, aborted = {}, set()
    with _llm(path, num_pages=16, overlap=True, max_prefill_tokens=32, **runtime) as llm:
        ids, step, preempted = [], 0, 0
        while len(ids) < 14 or llm.has_unfinished():
            if len(ids) < 14 and rng.random() < 0.45:
                prompt = rng.choice(stems)[:rng.randrange(4, 25)] + \
                    [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 9))]
                ids.append(llm.add_request(prompt, greedy(rng.randrange(2, 12))))
            if ids and rng.random() < 0.08:
                victim = rng.choice(ids)
                aborted.add(victim)
                if victim not in llm.finish_reasons:
                    llm.abort(victim)
            llm.step()
            step += 1
            assert step < 500
            preempted = max([preempted] + [r.preemptions for r in llm.engine.scheduler.running])
        for i in ids:
            out[i] = "aborted" if i in aborted else (llm.finish_reasons[i], llm.outputs[i])
        assert llm.engine.kv_pages_free() == 16
        return out, dict(llm.stats(), preempted=preempted)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_workload_gives_the_same_tokens_with_and_without_the_cache(hf_checkpoint,
                                                                            seed):
    """Joins, aborts, preemption and overlap in a 16-page pool: every request that was not
    aborted ends as it does without the cache, with or without a host tier, and the cache was
    used (hits; with the host tier, loads)."""
    path, _ = hf_checkpoint("llama")
    plain, _ = _random_workload(path, seed, prefix_caching=False)
    cached, stats = _random_workload(path, seed)
    hosted, host_stats = _random_workload(path, seed, host_cache_gb=0.01)
    assert cached == plain == hosted
    assert stats["prefix_cache_hits"] > 0 and host_stats["prefix_cache_hits"] > 0
    assert stats["preempted"] > 0 and host_stats["prefix_cache_host_hits"] > 0


def test_a_host_cache_that_cannot_be_allocated_is_a_config_error(monkeypatch):
    from helix.errors import ConfigError
    from helix.kv.host_cache import HostCache
    real = torch.empty

    def refuse(*a, **kw):
        raise RuntimeError("CUDA error: out of memory\nmore")
    caches = [[torch.zeros(4, 2, 3)]]
    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(ConfigError, match=r"could not be allocated \(CUDA error: out of "
                                          r"memory\): lower --host-cache-gb"):
        HostCache(caches, 8, 1)
    monkeypatch.setattr(torch, "empty", real)
    host = HostCache(caches, 2, 2)
    caches[0][0][1:3] = 7.0
    host.offload([1, 2], 1)
    caches[0][0].zero_()
    host.load(1, [3, 0])
    assert caches[0][0][3].eq(7).all() and caches[0][0][0].eq(7).all()
    assert caches[0][0][1:3].eq(0).all()


def test_a_waiting_request_walks_the_cache_once_and_again_after_a_drop():
    """A request held back (the batch is full) with a long cached prefix: its first look walks
    every block, each later step only tries the next one; after a block is dropped from the
    index its walk starts over and finds only what is left."""
    sharding = KVSharding(1, 1, 2)
    s = Scheduler(200, sharding, max_batch=1, max_prefill_tokens=64, prefix_caching=True)
    stem = list(range(1, 41))
    s.cache.register(99, lambda a, b: stem[a:b], 40)            # 20 blocks of 2
    s.cache.release(99)
    busy, waiting = Request(0, [7] * 4, greedy(30), 10 ** 6), Request(1, stem + [3], greedy(2),
                                                                       10 ** 6)
    s.add(busy)
    s.schedule()
    s.add(waiting)
    calls = []
    real = waiting.tokens
    waiting.tokens = lambda a, b: calls.append(a) or real(a, b)

    def look():
        calls.clear()
        return s._cached_blocks(waiting)
    assert len(look()) == 20 and len(calls) == 20
    assert len(look()) == 20 and calls == []                    # the limit: nothing to try
    s.cache.evict(s.cache.block_pages * 15, offload=False)        # the 15 deepest go
    assert len(look()) == 5 and len(calls) == 6
    assert [b.id for b in look()] == [b.id for b in s.cache.lookup(real, waiting.cache_limit)]
