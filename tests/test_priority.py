"""Priority scheduling (RuntimeConfig.scheduling="priority", SamplingParams.priority: lower runs
first): the queue is admitted by priority, the request that makes room is the lowest-priority
one, and a better request that does not fit preempts worse running ones. Tokens stay those of
each request run alone (preempted requests are recomputed)."""

from __future__ import annotations

import pytest
from hf_fixtures import SMALL

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.errors import ConfigError, RequestError
from helix.kv.ownership import KVSharding
from helix.runtime.request import Request
from helix.runtime.scheduler import Scheduler
from helix.serving.protocol import sampling


def _req(i: int, n: int, new: int, priority: int = 0) -> Request:
    return Request(i, list(range(1, n + 1)), SamplingParams(max_new_tokens=new, ignore_eos=True,
                                                            priority=priority), 10 ** 6)


def _run_steps(s: Scheduler, steps: int) -> None:
    """The engine's bookkeeping without a device: every planned row writes and samples."""
    for _ in range(steps):
        plan = s.schedule()
        for r in plan.decode:
            r.computed = r.num_tokens
            r.output.append(1)
        for c in plan.prefill:
            c.req.computed = c.start + len(c.ids)
            if c.samples:
                c.req.output.append(1)
        for r in plan.requests:
            if len(r.output) >= r.params.max_new_tokens:
                r.finish_reason = "length"
        s.retire()


def test_the_queue_is_admitted_by_priority():
    for policy, first in (("fcfs", 0), ("priority", 1)):
        s = Scheduler(100, KVSharding(1, 1, 4), max_batch=1, max_prefill_tokens=64,
                      policy=policy)
        for i, prio in enumerate((5, -1, 3)):
            s.add(_req(i, 8, 4, prio))
        s.schedule()
        assert [r.id for r in s.running] == [first]


def test_a_better_request_preempts_worse_running_ones_and_never_the_reverse():
    """A pool for about two requests: low-priority ones run; a high-priority one arrives and
    takes the room at the next step; while it runs, growth preempts low ones, never it."""
    s = Scheduler(12, KVSharding(1, 1, 4), max_batch=4, max_prefill_tokens=64,
                  policy="priority")
    lows = [_req(i, 16, 12, priority=5) for i in range(3)]
    for r in lows:
        s.add(r)
    _run_steps(s, 2)
    assert len(s.running) >= 2
    high = _req(9, 16, 12, priority=0)
    s.add(high)
    plan = s.schedule()
    assert high in s.running and plan.preempted and all(r in lows for r in plan.preempted)
    _run_steps(s, 40)
    assert high.finished and high.preemptions == 0
    assert sum(r.preemptions for r in lows) >= 1
    fcfs = Scheduler(12, KVSharding(1, 1, 4), max_batch=4, max_prefill_tokens=64)
    for r in [_req(i, 16, 12, priority=5) for i in range(3)]:
        fcfs.add(r)
    _run_steps(fcfs, 2)
    fcfs.add(_req(9, 16, 12))
    assert not fcfs.schedule().preempted                  # arrival order: it waits


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_urgent_request_gets_its_first_token_sooner(hf_checkpoint, policy):
    """Two long low-priority requests fill a 20-page pool; an urgent request added after two
    steps has its first token at once with priority scheduling, only after the others end with
    fcfs. Every request's tokens are those it gets alone."""
    path, _ = hf_checkpoint("llama")
    rt = RuntimeConfig(**{**SMALL, "num_pages": 20, "scheduling": policy})
    long_a, long_b, urgent = list(range(5, 45)), list(range(50, 80)), [7, 8, 9, 10]
    low = 5 if policy == "priority" else 0
    with LLM(path, Layout(), rt) as llm:
        a = llm.add_request(long_a, SamplingParams(max_new_tokens=30, ignore_eos=True,
                                                   priority=low))
        b = llm.add_request(long_b, SamplingParams(max_new_tokens=30, ignore_eos=True,
                                                   priority=low))
        llm.step()
        llm.step()
        u = llm.add_request(urgent, SamplingParams(max_new_tokens=4, ignore_eos=True))
        steps = 0
        while not llm.outputs[u]:
            llm.step()
            steps += 1
        while llm.has_unfinished():
            llm.step()
        got = [llm.outputs[i] for i in (a, b, u)]
    with LLM(path, Layout(), RuntimeConfig(**SMALL)) as alone:
        want = [alone.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
                for p, n in ((long_a, 30), (long_b, 30), (urgent, 4))]
    assert got == want
    assert (steps <= 2) == (policy == "priority"), steps


def test_priority_needs_its_policy_and_is_an_integer(llama_ckpt):
    with LLM(llama_ckpt, Layout(), RuntimeConfig(**SMALL)) as llm:
        with pytest.raises(RequestError, match="--scheduling priority"):
            llm.add_request([5], SamplingParams(priority=1))
        assert not llm.outputs
    with pytest.raises(RequestError, match="priority must be an integer"):
        SamplingParams(priority=0.5)
    with pytest.raises(ConfigError, match="scheduling must be fcfs or priority"):
        RuntimeConfig(scheduling="lifo")
    assert sampling({"priority": -3}, 128).priority == -3
