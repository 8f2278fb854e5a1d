"""helix.graphs (the repository's graphs/): bucket ladder, packed static buffers staged from a host
mirror, breakable graph plans, the runner's replay and teardown. CPU tests run everywhere; `gpu`
tests compare captured against eager output bitwise and skip without CUDA."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from helix.graphs import (Break, BreakableGraph, BucketLadder, GraphContext, GraphRunner,
                          HostStaging, Segment, StaticBuffers, default_buckets)

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


# -- static buffers ---------------------------------------------------------------------------

def _buffers(rows=16, device="cpu"):
    return StaticBuffers.packed(rows, device, {
        "x": ((3,), torch.float32, 0.0), "slot": ((), torch.int64, -1),
        "length": ((), torch.int32, 0)})


def _stage(bufs, bucket, **inputs):
    """Write a step's rows through a host mirror, as the runtime does."""
    host = HostStaging(bufs)
    for name, t in inputs.items():
        host.put(name, t, bucket)
    for name in bufs.names():
        if name not in inputs:
            host.put(name, bufs[name][:0].cpu(), bucket)
    host.upload(bucket, non_blocking=False)


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
        HostStaging(StaticBuffers(4))


def test_addresses_tracked():
    bufs = _buffers()
    before = bufs.data_ptrs()
    for n, bucket in [(1, 1), (3, 4), (16, 16), (5, 8)]:
        _stage(bufs, bucket, x=torch.randn(n, 3))
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
        bucket = BucketLadder(16).choose(n)
        _stage(bufs, bucket, x=x, slot=torch.arange(n),
               length=torch.full((n,), 2, dtype=torch.int32))
        out = runner.replay(bucket)
        assert runner.last_bucket == bucket and out.shape == (bucket, 3)
        assert torch.equal(out[:n], x * 2 + 2)                   # real rows
        assert torch.equal(out[n:], torch.zeros(bucket - n, 3))  # pad rows: slot -1, length 0
        assert bufs.data_ptrs() == ptrs
    with pytest.raises(ValueError, match="not captured"):
        runner.replay(3)
    runner.close()


def test_close_idempotent():
    runner = GraphRunner(_step, BucketLadder(4), _buffers(4), breaks={"attention"})
    runner.capture_all()
    assert len(runner.graphs) == 3
    runner.close()
    runner.close()
    assert runner.closed and runner.graphs == {}
    with pytest.raises(RuntimeError, match="closed"):
        runner.replay(1)
    with pytest.raises(ValueError, match="rows"):
        GraphRunner(_step, BucketLadder(32), _buffers(16))


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
        ladder = BucketLadder(8)
        bufs = StaticBuffers.packed(8, "cpu", {"x": ((2,), torch.float32, 0.0)})
        runner = GraphRunner(_collective_step, ladder, bufs, breaks={"attention"})
        runner.capture_all()
        local = [3, 6][rank]               # ranks hold different rows, replay the same bucket
        _stage(bufs, 8, x=torch.full((local, 2), rank + 1.0))
        out = runner.replay(8)
        result = {"rows": out.shape[0], "sums": out[:, 0].tolist()}
        runner.close()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_replay_one_bucket_with_per_rank_padding(tmp_path):
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["rows"] == r1["rows"] == 8
    # rank 0 rows 0..2 hold 1, rank 1 rows 0..5 hold 2, pads 0: the all-reduced sums
    assert r0["sums"] == r1["sums"] == [3.0] * 3 + [2.0] * 3 + [0.0] * 2


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
    return StaticBuffers.packed(16, "cuda", {"x": ((64,), torch.float32, 0.0),
                                            "length": ((), torch.int32, 0)})


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
    try:
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
            b = ladder.choose(n)
            _stage(graphed.buffers, b, x=x.cpu(), length=lens.cpu())
            _stage(eager.buffers, b, x=x.cpu(), length=lens.cpu())
            got = graphed.replay(b).clone()
            want = eager.replay(b)
            assert got.shape == want.shape == (ladder.choose(n), 32)
            assert torch.equal(got, want)
            assert torch.equal(got[n:], torch.zeros_like(got[n:]))  # pad rows: length 0
        assert graphed.buffers.data_ptrs() == ptrs
        assert len(graphed.graphs[ladder.choose(n)].segment_graphs) == len(breaks) + 1
    finally:
        graphed.close()
        eager.close()


@gpu
@needs_cuda
def test_gpu_empty_segments():
    """Breaks at the start and back to back leave empty segments: skipped at replay."""
    bufs = _gpu_buffers()

    def step(bucket, b, ctx):
        x = ctx.graph_break("first", lambda t: t + 1, b.view("x", bucket))
        x = ctx.graph_break("second", lambda t: t * 2, x)
        y = x.sum(-1)
        return ctx.graph_break("last", lambda t: t - 1, y)

    runner = GraphRunner(step, BucketLadder(4), bufs, breaks={"first", "second", "last"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "empty graph" warning may leak out
        runner.capture_all()
    x = torch.randn(3, 64)
    _stage(bufs, 4, x=x)
    out = runner.replay(4)
    torch.testing.assert_close(out[:3].cpu(), ((x + 1) * 2).sum(-1) - 1)
    g = runner.graphs[4]
    assert [type(s).__name__ for s in g.plan] == ["Segment", "Break"] * 3 + ["Segment"]
    runner.close()


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
    result = {"equal": []}
    try:
        ladder = BucketLadder(16)
        spec = {"x": ((256,), torch.float32, 0.0)}
        graphed = GraphRunner(_nccl_step, ladder, StaticBuffers.packed(16, "cuda", spec),
                              breaks={"exchange"})
        eager = GraphRunner(_nccl_step, ladder, StaticBuffers.packed(16, "cuda", spec),
                            breaks={"exchange"}, enabled=False)
        graphed.capture_all()
        eager.capture_all()
        gen = torch.Generator().manual_seed(rank)
        for local, bucket in zip(([3, 16, 1, 5], [7, 2, 1, 16])[rank], [8, 16, 1, 16]):
            x = torch.randn(local, 256, generator=gen)
            _stage(graphed.buffers, bucket, x=x)
            _stage(eager.buffers, bucket, x=x)
            got = graphed.replay(bucket).clone()
            want = eager.replay(bucket)
            result["equal"].append(bool(torch.equal(got, want)))
        graphed.close()                   # graphs freed before the group is destroyed
        eager.close()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_rank_nccl_captured_collectives(tmp_path):
    mp.spawn(_nccl_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert all(r0["equal"]) and all(r1["equal"])
