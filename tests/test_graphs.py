"""graphs/: bucket ladder, agreement across ranks, static buffers and padding, breakable graph
plans, the runner's eager fallback and teardown. CPU tests run everywhere; `gpu` tests compare
captured against eager output bitwise and skip without CUDA."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from graphs import (Break, BreakableGraph, BucketLadder, EagerFallbackWarning, GraphContext,
                    GraphRunner, HostStaging, Segment, StaticBuffers, default_buckets, dist_reduce_max)
from graphs import inspect as graph_inspect

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- buckets ----------------------------------------------------------------------------------

def test_default_ladder():
    assert default_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert default_buckets(100)[-3:] == (88, 96, 100)  # max kept even off the step
    assert default_buckets(12) == (1, 2, 4, 8, 12)
    assert default_buckets(1) == (1,)
    assert default_buckets(64, step=16) == (1, 2, 4, 8, 16, 32, 48, 64)


@pytest.mark.parametrize("n, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (16, 16),
                                       (17, 24), (39, 40), (40, 40), (41, None), (1000, None)])
def test_choose(n, bucket):
    assert BucketLadder(40).choose(n) == bucket


def test_ladder_validation():
    with pytest.raises(ValueError):
        BucketLadder(40).choose(-1)
    with pytest.raises(ValueError):
        BucketLadder()
    with pytest.raises(ValueError):
        BucketLadder(64, buckets=[1, 8, 32])
    ladder = BucketLadder(buckets=[32, 8, 1, 8])
    assert ladder.buckets == (1, 8, 32) and ladder.max == 32
    assert list(ladder.descending()) == [32, 8, 1]


@pytest.mark.parametrize("needs, bucket", [([3, 9, 0], 16), ([0, 0], 1), ([40, 1], 40),
                                           ([2, 41, 5], None)])
def test_agree_fake_ranks(needs, bucket):
    """Every simulated rank gets the bucket of the largest need, whatever its own need."""
    ladder = BucketLadder(40)
    fake_all_reduce_max = lambda n: max(needs)  # noqa: E731  (same answer on every rank)
    assert [ladder.agree(n, fake_all_reduce_max) for n in needs] == [bucket] * len(needs)
    assert ladder.agree(3, None) == 4  # one rank: no reduction


def test_agree_rejects_bad_reduction():
    with pytest.raises(RuntimeError, match="max over ranks"):
        BucketLadder(40).agree(9, lambda n: 1)


# -- static buffers ---------------------------------------------------------------------------

def _buffers(rows=16):
    bufs = StaticBuffers(rows)
    bufs.add("x", (3,), torch.float32, pad=0.0)
    bufs.add("slot", (), torch.int64, pad=-1)
    bufs.add("length", (), torch.int32, pad=0)
    bufs.add("table", (4,), torch.int32, pad=-1)
    return bufs


def test_copy_in_pads_bucket_rows_only():
    bufs = _buffers()
    bufs["slot"].fill_(77)  # sentinel: rows past the bucket must stay untouched
    src = torch.tensor([5, 6, 7])
    view = bufs.copy_in("slot", src, bucket=8)
    assert view.shape == (8,) and view.data_ptr() == bufs["slot"].data_ptr()
    assert bufs["slot"][:3].tolist() == [5, 6, 7]       # real rows
    assert bufs["slot"][3:8].tolist() == [-1] * 5        # padded rows: the buffer's pad
    assert bufs["slot"][8:].tolist() == [77] * 8         # beyond the bucket: not touched
    bufs.copy_in("slot", src[:1], pad_value=-9, bucket=4)  # per-call override
    assert bufs["slot"][:4].tolist() == [5, -9, -9, -9]


def test_copy_in_narrow_rows_and_dtype():
    bufs = _buffers()
    table = torch.arange(6, dtype=torch.int64).view(3, 2)  # 2 of 4 pages, int64 -> int32
    bufs.copy_in("table", table, bucket=4)
    assert bufs["table"][:4].tolist() == [[0, 1, -1, -1], [2, 3, -1, -1], [4, 5, -1, -1],
                                          [-1, -1, -1, -1]]
    assert bufs["table"].dtype == torch.int32
    with pytest.raises(ValueError):
        bufs.copy_in("table", torch.zeros(5, 4), bucket=4)   # more rows than the bucket
    with pytest.raises(ValueError):
        bufs.copy_in("table", torch.zeros(2, 5), bucket=4)   # wider than the buffer
    with pytest.raises(KeyError):
        bufs.copy_in("nope", table)


def _packed(rows=8):
    return StaticBuffers.packed(rows, "cpu", {
        "ids": ((), torch.int64, 0), "slot": ((), torch.int64, -1),
        "length": ((), torch.int32, 0), "table": ((4,), torch.int32, -1)})


def test_packed_buffers_share_one_arena_per_dtype():
    bufs = _packed()
    i64, layout64 = bufs.arenas[torch.int64]
    i32, layout32 = bufs.arenas[torch.int32]
    assert [n for n, _, _ in layout64] == ["ids", "slot"] and [n for n, _, _ in layout32] == [
        "length", "table"]
    assert bufs["slot"].data_ptr() == i64.data_ptr() + 8 * 8        # right after 8 ids
    assert bufs["table"].data_ptr() == i32.data_ptr() + 8 * 4
    assert bufs["table"].shape == (8, 4) and bufs["table"].is_contiguous()
    assert bufs["slot"].tolist() == [-1] * 8 and bufs["table"].eq(-1).all()


def test_host_staging_uploads_bucket_rows_with_pads():
    bufs = _packed()
    host = HostStaging(bufs)
    bufs["table"].fill_(77)                       # rows past the bucket: must stay untouched
    host.put("ids", torch.tensor([5, 6, 7]), bucket=4)
    host.put("slot", torch.tensor([10, 11, 12]), bucket=4)
    host.put("length", torch.tensor([3, 1, 2], dtype=torch.int32), bucket=4)
    host.put("table", torch.tensor([[1, 2], [3, 4], [5, 6]]), bucket=4)
    host.upload(4)
    assert bufs["ids"][:4].tolist() == [5, 6, 7, 0]
    assert bufs["slot"][:4].tolist() == [10, 11, 12, -1]
    assert bufs["length"][:4].tolist() == [3, 1, 2, 0]
    assert bufs["table"][:4].tolist() == [[1, 2, -1, -1], [3, 4, -1, -1], [5, 6, -1, -1],
                                          [-1, -1, -1, -1]]
    assert bufs["table"][4:].eq(77).all()        # the last buffer is copied up to the bucket
    # narrower input without tail padding: the columns past it keep what the mirror held
    host.put("table", torch.tensor([[9]]), bucket=1, pad_tail=False)
    host.upload(1)
    assert bufs["table"][0].tolist() == [9, 2, -1, -1]
    with pytest.raises(ValueError):
        host.put("table", torch.zeros(2, 5, dtype=torch.int32), bucket=4)   # too wide
    with pytest.raises(ValueError):
        host.put("ids", torch.zeros(5, dtype=torch.int64), bucket=4)        # too many rows
    with pytest.raises(ValueError, match="packed"):
        HostStaging(_buffers())


def test_addresses_tracked():
    bufs = _buffers()
    before = bufs.data_ptrs()
    for n, bucket in [(1, 1), (3, 4), (16, 16), (5, 8)]:
        bufs.copy_in("x", torch.randn(n, 3), bucket=bucket)
        bufs.check_addresses()
    assert bufs.data_ptrs() == before
    bufs["x"].set_(torch.zeros(16, 3))  # what a careless reallocation looks like
    with pytest.raises(RuntimeError, match="'x'"):
        bufs.check_addresses()


# -- breakable graph plans --------------------------------------------------------------------

def _logged_fn(log):
    """Three stretches of code separated by an 'attention' and a 'sampling' break."""
    def fn(ctx: GraphContext):
        log.append("a")
        x = torch.ones(2, 2)
        x = ctx.graph_break("attention", lambda t: (log.append("attn"), t * 2)[1], x)
        log.append("b")
        x = ctx.graph_break("sampling", lambda t: (log.append("samp"), t + 1)[1], x)
        log.append("c")
        return x
    return fn


@pytest.mark.parametrize("breaks, plan, order", [
    ({"attention", "sampling"},
     [Segment(0), Break("attention"), Segment(1), Break("sampling"), Segment(2)],
     ["a", "attn", "b", "samp", "c"]),
    ({"attention"},
     [Segment(0), Break("attention"), Segment(1, ("sampling",))],
     ["a", "attn", "b", "samp", "c"]),
    (set(), [Segment(0, ("attention", "sampling"))], ["a", "attn", "b", "samp", "c"]),
])
def test_break_order_and_inlining(breaks, plan, order):
    log = []
    g = BreakableGraph(_logged_fn(log), breaks=breaks)
    out = g.capture()
    assert list(g.plan) == plan
    assert log == order and out.tolist() == [[3.0, 3.0]] * 2
    log.clear()
    assert g.replay().tolist() == [[3.0, 3.0]] * 2
    assert list(g.last_trace) == plan and log == order


def test_break_rules():
    def nested(ctx):
        return ctx.graph_break("outer", lambda: ctx.graph_break("inner", torch.zeros, 1))
    with pytest.raises(RuntimeError, match="do not nest"):
        BreakableGraph(nested, breaks={"outer", "inner"}).capture()
    # nested inside a *disabled* break is fine: it is captured inline
    BreakableGraph(nested, breaks={"inner"}).capture()
    with pytest.raises(TypeError, match="only"):
        BreakableGraph(lambda ctx: ctx.graph_break("b", lambda: 3), breaks={"b"}).capture()

    flip = [True]
    def data_dependent(ctx):
        return ctx.graph_break("b", torch.zeros, 1) if flip[0] else torch.zeros(1)
    g = BreakableGraph(data_dependent, breaks={"b"})
    g.capture()
    flip[0] = False
    with pytest.raises(RuntimeError, match="structure changed"):
        g.replay()


# -- runner -----------------------------------------------------------------------------------

def _step(bucket, bufs, ctx):
    """Toy decode step: rows with slot -1 are padding and produce zeros in the break."""
    x, slot = bufs.view("x", bucket), bufs.view("slot", bucket)   # [b, 3], [b]
    h = x * 2                                                        # segment 0
    h = ctx.graph_break("attention", lambda t, s: t * (s >= 0).unsqueeze(-1), h, slot)
    return h + bufs.view("length", bucket).unsqueeze(-1)           # segment 1, [b, 3]


def test_runner_pads_and_reuses_buffers():
    bufs = _buffers()
    runner = GraphRunner(_step, BucketLadder(16), bufs, breaks={"attention"})
    runner.capture_all()
    assert list(runner.graphs) == [16, 8, 4, 2, 1]  # captured largest first
    assert list(runner.plan(4)) == [Segment(0), Break("attention"), Segment(1)]
    ptrs = bufs.data_ptrs()
    for n in [3, 16, 1, 5]:
        x = torch.randn(n, 3)
        out = runner.run(n, {"x": x, "slot": torch.arange(n), "length": torch.full((n,), 2)})
        bucket = BucketLadder(16).choose(n)
        assert runner.last_bucket == bucket and out.shape == (bucket, 3)
        assert torch.equal(out[:n], x * 2 + 2)                   # real rows
        assert torch.equal(out[n:], torch.zeros(bucket - n, 3))  # pad rows: slot -1, length 0
        assert bufs.data_ptrs() == ptrs
    runner.close()


def test_eager_fallback_warns_once():
    bufs = _buffers(8)
    runner = GraphRunner(_step, BucketLadder(8), bufs, breaks={"attention"})
    runner.capture_all()
    before = bufs["x"].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in [9, 12, 3]:
            x = torch.randn(n, 3)
            out = runner.run(n, {"x": x, "slot": torch.arange(n), "length": torch.ones(n)},
                             agree=lambda k: max(k, 10))  # another rank needs 10
            rows = max(n, 10)  # every rank runs eagerly on the agreed row count
            assert out.shape == (rows, 3) and torch.equal(out[:n], x * 2 + 1)
            assert torch.equal(out[n:], torch.zeros(rows - n, 3))
            assert runner.last_bucket is None
    assert [w.category for w in caught] == [EagerFallbackWarning]
    assert torch.equal(bufs["x"], before)  # the fallback leaves the static buffers alone
    runner.close()


def test_close_idempotent_and_context_manager():
    with GraphRunner(_step, BucketLadder(4), _buffers(4), breaks={"attention"}) as runner:
        out = runner.run(2, {"x": torch.ones(2, 3)})  # captures lazily on first use
        assert out.shape == (2, 3) and len(runner.graphs) == 3
    assert runner.closed and runner.graphs == {}
    runner.close()
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run(1, {})
    with pytest.raises(ValueError, match="rows"):
        GraphRunner(_step, BucketLadder(32), _buffers(16))


def test_inspect_imports_without_cuda():
    g = BreakableGraph(_logged_fn([]), breaks={"attention"})
    g.capture()
    assert graph_inspect.describe(g).splitlines() == [
        "segment 0 (eager)", "break attention (eager)", "segment 1 (eager, inlined sampling)"]


# -- two real ranks (gloo) --------------------------------------------------------------------

def _collective_step(bucket, bufs, ctx):
    """A collective inside the step: it only matches when all ranks use the same row count."""
    import torch.distributed as dist
    x = bufs.view("x", bucket).clone()
    dist.all_reduce(x)
    return ctx.graph_break("attention", lambda t: t + 0, x)


def _gloo_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    try:
        reduce_max = dist_reduce_max()
        ladder = BucketLadder(8)
        local = [3, 6][rank]
        result = {"bucket": ladder.agree(local, reduce_max)}
        bufs = StaticBuffers(8)
        bufs.add("x", (2,), torch.float32, pad=0.0)
        with GraphRunner(_collective_step, ladder, bufs, breaks={"attention"}) as runner:
            runner.capture_all()
            out = runner.run(local, {"x": torch.full((local, 2), rank + 1.0)}, agree=reduce_max)
            result["rows"] = out.shape[0]
            result["sums"] = out[:, 0].tolist()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", EagerFallbackWarning)
                big = [9, 4][rank]  # rank 0 exceeds the ladder: both must go eager on 9 rows
                out = runner.run(big, {"x": torch.ones(big, 2)}, agree=reduce_max)
            result["eager_rows"] = out.shape[0]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_two_rank_gloo_agreement(tmp_path):
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["bucket"] == r1["bucket"] == 8
    assert r0["rows"] == r1["rows"] == 8
    # rank 0 rows 0..2 hold 1, rank 1 rows 0..5 hold 2, pads 0: the all-reduced sums
    assert r0["sums"] == r1["sums"] == [3.0] * 3 + [2.0] * 3 + [0.0] * 2
    assert r0["eager_rows"] == r1["eager_rows"] == 9


# -- GPU: captured vs eager -------------------------------------------------------------------

def _gpu_step_factory(scale):
    """A toy step with matmuls around an eager break that reads host state (`scale[0]`)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(64, 128, device="cuda", generator=gen)
    w2 = torch.randn(128, 32, device="cuda", generator=gen)

    def mix(h, lens):  # eager at replay: the host value is read afresh every step
        return h * (lens > 0).unsqueeze(-1) * scale[0]

    def step(bucket, bufs, ctx):
        x, lens = bufs.view("x", bucket), bufs.view("length", bucket)  # [b, 64], [b]
        h = torch.relu(x @ w1)                                          # [b, 128]
        h = ctx.graph_break("mix", mix, h, lens)
        return torch.tanh(h @ w2) + lens.unsqueeze(-1)                  # [b, 32]
    return step


def _gpu_buffers():
    bufs = StaticBuffers(16, "cuda")
    bufs.add("x", (64,), torch.float32, pad=0.0)
    bufs.add("length", (), torch.int32, pad=0)
    return bufs


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [8, 5, 16, 1])  # 8, 16, 1 fill their bucket; 5 pads to 8
@pytest.mark.parametrize("breaks", [{"mix"}, set()])
def test_gpu_captured_matches_eager_bitwise(n, breaks):
    scale = [1.0]
    step = _gpu_step_factory(scale)
    ladder = BucketLadder(16)
    graphed = GraphRunner(step, ladder, _gpu_buffers(), breaks=breaks)
    eager = GraphRunner(step, ladder, _gpu_buffers(), breaks=breaks, enabled=False)
    with graphed, eager:
        graphed.capture_all()
        eager.capture_all()
        assert graphed.use_graphs and not eager.use_graphs
        ptrs = graphed.buffers.data_ptrs()
        # an enabled break re-reads host state at every replay; a disabled one is captured
        # inline, its host value frozen at capture, so only vary the scale when it breaks
        for s in [0.5, 3.0] if breaks else [1.0, 1.0]:
            scale[0] = s
            x = torch.randn(n, 64, device="cuda")
            lens = torch.arange(1, n + 1, device="cuda", dtype=torch.int32)
            got = graphed.run(n, {"x": x, "length": lens}).clone()
            want = eager.run(n, {"x": x, "length": lens})
            assert got.shape == want.shape == (ladder.choose(n), 32)
            assert torch.equal(got, want)
            assert torch.equal(got[n:], torch.zeros_like(got[n:]))  # pad rows: length 0
        assert graphed.buffers.data_ptrs() == ptrs
        assert len(graphed.graphs[ladder.choose(n)].segment_graphs) == len(breaks) + 1


@gpu
@needs_cuda
def test_gpu_empty_segments_and_inspect():
    """Breaks at the start and back to back leave empty segments: skipped at replay."""
    bufs = _gpu_buffers()

    def step(bucket, b, ctx):
        x = ctx.graph_break("first", lambda t: t + 1, b.view("x", bucket))
        x = ctx.graph_break("second", lambda t: t * 2, x)
        y = x.sum(-1)
        return ctx.graph_break("last", lambda t: t - 1, y)

    with GraphRunner(step, BucketLadder(4), bufs, breaks={"first", "second", "last"},
                     inspectable=True) as runner:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "empty graph" warning may leak out
            runner.capture_all()
        x = torch.randn(3, 64, device="cuda")
        out = runner.run(3, {"x": x})
        torch.testing.assert_close(out[:3], ((x + 1) * 2).sum(-1) - 1)
        g = runner.graphs[4]
        assert [type(s).__name__ for s in g.plan] == ["Segment", "Break"] * 3 + ["Segment"]
        text = graph_inspect.describe(g)
        print(text)
        nodes = [graph_inspect.summarize(sg).num_nodes for sg in g.segment_graphs]
        assert nodes[0] == nodes[1] == nodes[3] == 0 and nodes[2] >= 1  # only the sum captured
        assert "segment 1: 0 nodes" in text


@gpu
@needs_cuda
def test_gpu_inspect_debug_dump_fallback():
    """The DOT path (no cuda-python): torch dumps only graphs it kept (keep_graph or debug mode)."""
    try:
        g = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        g = torch.cuda.CUDAGraph()
    g.enable_debug_mode()
    x = torch.ones(8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g.capture_begin()
        y = (x * 2).sum()
        g.capture_end()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch announces every dump
        summary = graph_inspect._summarize_dot(g, None)
    assert summary.source == "debug_dump" and summary.num_nodes >= 2
    assert summary.node_types.get("Kernel", 0) >= 2, summary
    del y


@gpu
@needs_cuda
def test_gpu_close_releases_pool():
    step = _gpu_step_factory([1.0])
    torch.cuda.synchronize()
    runner = GraphRunner(step, BucketLadder(16), _gpu_buffers(), breaks={"mix"})
    runner.capture_all()
    held = torch.cuda.memory_reserved()
    runner.close()
    runner.close()
    assert torch.cuda.memory_reserved() <= held


def _nccl_step(bucket, bufs, ctx):
    """all_reduce captured in segment 0, another inside the eager break, then segment 1."""
    import torch.distributed as dist
    x = bufs.view("x", bucket) * 1.0                     # [b, 256]
    dist.all_reduce(x)
    y = ctx.graph_break("exchange", _eager_all_reduce, x)
    return torch.tanh(y) * 2 + x


def _eager_all_reduce(t):
    import torch.distributed as dist
    t = t.clone()
    dist.all_reduce(t)
    return t


def _nccl_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60),
                            device_id=torch.device("cuda", rank))
    result = {"equal": [], "buckets": []}
    try:
        reduce_max = dist_reduce_max()
        ladder = BucketLadder(16)
        bufs = StaticBuffers(16, "cuda")
        bufs.add("x", (256,), torch.float32, pad=0.0)
        ref_bufs = bufs.resized(16)
        with GraphRunner(_nccl_step, ladder, bufs, breaks={"exchange"}) as graphed, \
                GraphRunner(_nccl_step, ladder, ref_bufs, breaks={"exchange"},
                            enabled=False) as eager:
            graphed.capture_all()
            eager.capture_all()
            gen = torch.Generator(device="cuda").manual_seed(rank)
            for local in ([3, 16, 1, 5], [7, 2, 1, 16])[rank]:
                x = torch.randn(local, 256, device="cuda", generator=gen)
                got = graphed.run(local, {"x": x}, agree=reduce_max).clone()
                want = eager.run(local, {"x": x}, agree=reduce_max)
                result["equal"].append(bool(torch.equal(got, want)))
                result["buckets"].append(graphed.last_bucket)
        # runners closed (graphs freed) before the group is destroyed
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_rank_nccl_captured_collectives(tmp_path):
    mp.spawn(_nccl_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["buckets"] == r1["buckets"] == [8, 16, 1, 16]
    assert all(r0["equal"]) and all(r1["equal"])
