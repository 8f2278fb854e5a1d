"""On one GPU: HOP-B's two-stream schedule (helix/layers/hopb.py `overlapped`) with the real
Triton decode attention on the compute stream and the real pack + merge kernels on the
communication stream (the all-to-all itself needs two GPUs: its partials are stood in for by the
packed buffer, read back as two KVP partials). M micro-batches, uneven splits included, must give
M = 1's result bitwise, eagerly and captured in a CUDA graph (multi-stream capture, replayed on
fresh inputs), and the graph must really hold kernels of both streams."""

from __future__ import annotations

import pytest
import torch

from helix.layers import hopb

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

B, HQ, HKV, D, PAGE, CTX = 7, 32, 8, 128, 16, 1000       # 7 rows: uneven splits


def _problem(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = B * (-(-CTX // PAGE))
    k = torch.randn(pages, PAGE, HKV, D, generator=g, device="cuda").bfloat16()
    v = torch.randn(pages, PAGE, HKV, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(B, HQ, D, generator=g, device="cuda").bfloat16()
    tables = torch.randperm(pages, generator=g, device="cuda").int().view(B, -1)
    lens = torch.randint(1, CTX + 1, (B,), generator=g, device="cuda").int()
    return q, k, v, tables, lens


def _step(q, k, v, tables, lens, m: int) -> torch.Tensor:
    from helix.attention import triton_decode, triton_merge

    def attend(a, b):
        return triton_decode.gqa_decode(q[a:b], k, v, tables[a:b], lens[a:b], D ** -0.5)

    def exchange(o, lse):
        send = triton_merge.pack_partials(o, lse, 2)            # [2, rows, HQ/2, D + c]
        return triton_merge.merge_received(send, D)             # as if from 2 KVP ranks

    return hopb.overlapped(attend, exchange, B, m, q.device)


@needs_cuda
@pytest.mark.parametrize("m", [2, 3, 4])
def test_micro_batches_equal_one_eagerly_and_captured(m):
    problem = _problem(0)
    want = _step(*problem, 1)
    assert torch.equal(_step(*problem, m), want)

    static = [t.clone() for t in problem]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                  # warm up (compile) outside the capture
        _step(*static, m)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(*static, m)
    for seed in (1, 2):                            # replay on fresh inputs in the same buffers
        fresh = _problem(seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _step(*fresh, 1))


@needs_cuda
def test_exchange_runs_on_the_communication_stream():
    """The exchange's kernels are queued on hopb's communication stream, not the caller's."""
    q, k, v, tables, lens = _problem(3)
    seen = []
    from helix.attention import triton_merge
    real = triton_merge.merge_received

    def spy(recv, d):
        seen.append(torch.cuda.current_stream().stream_id)
        return real(recv, d)

    triton_merge.merge_received = spy
    try:
        _step(q, k, v, tables, lens, 2)
    finally:
        triton_merge.merge_received = real
    side = hopb.comm_stream(q.device).stream_id
    assert seen == [side, side] and torch.cuda.current_stream().stream_id != side
