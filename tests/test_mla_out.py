"""helix.layers.mla_out, absorbed MLA's split merge + W_UV in one launch, against the two
launches' formulas (the LSE merge with empty splits skipped, W_UV, each rounded); the MLA
decode kernels' split partials (merge=False) against their merged outputs; the grid from
shapes; the layer's rule; an sm_90 compile without spills. On the GPU: the launch on the
Gluon kernel's partials at DeepSeek-V2-Lite's shape against reduce_splits + absorb_v, graph
replays, and whole captured decodes either way.

Without CUDA the kernels run through Triton's interpreter."""

import torch

from triton_mode import DEV, ON_GPU, gpu_rounding  # first: picks the interpreter before triton

import sm90_compile  # noqa: E402

from unittest import mock  # noqa: E402

import pytest  # noqa: E402

from helix.attention import triton_mla, triton_splits  # noqa: E402
from helix.attention.merge import merge_partials  # noqa: E402
from helix.layers import mla_out  # noqa: E402


@pytest.fixture(autouse=True)
def _gpu_rounding():
    with gpu_rounding():
        yield


def live_mask(kv_lens, S, block_n, min_chunk):
    """[T, S]: the splits holding tokens (triton_splits.split_range's chunks, in torch)."""
    keep = torch.ones(len(kv_lens), S, dtype=torch.bool)
    if block_n:
        for t, n in enumerate(kv_lens.tolist()):
            chunk = max(-(-(-(-n // S)) // block_n) * block_n, min_chunk)
            keep[t] = torch.arange(S) * chunk < n
    return keep


def two_launches(o_ws, lse_ws, kv_lens, live, w_uv):
    """reduce_splits and absorb_v as formulas: each output rounded to w_uv's dtype."""
    T, H, S, DL = o_ws.shape
    keep = live_mask(kv_lens.cpu(), S, *live)
    lse = torch.where(keep[:, None, :], lse_ws.float().cpu(), float("-inf"))
    part = torch.where(keep[:, None, :, None], o_ws.float().cpu(), 0.0)
    o, _ = merge_partials(part.permute(2, 0, 1, 3), lse.permute(2, 0, 1))
    o = o.to(w_uv.dtype).float()
    return torch.einsum("thc,hvc->thv", o, w_uv.float().cpu()).to(w_uv.dtype).reshape(T, -1)


def _case(T, H, S, DL, V, lens, live, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    o_ws = torch.randn(T, H, S, DL, generator=g)
    lse_ws = torch.randn(T, H, S, generator=g) * 2
    keep = live_mask(torch.tensor(lens), S, *live)
    dead = ~keep[:, None, :].expand(T, H, S)
    o_ws[dead] = float("nan")                   # what an empty split holds: never read
    lse_ws[dead] = float("nan")
    w_uv = (torch.randn(H, 2 * V, DL, generator=g) / DL ** 0.5).to(dtype)[:, V:]   # strided
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (o_ws, lse_ws, kv_lens)] + [live, w_uv.to(DEV)]


CASES = [  # T, H, S, DL, V, kv_lens, live
    (1, 4, 5, 40, 8, [40], (8, 8)),                    # padded dims, every split live
    (2, 3, 6, 64, 12, [100, 9], (16, 16)),             # two rows, row 1's last splits empty
    (2, 2, 16, 32, 8, [0, 33], (4, 4)),                # a row with no tokens: output 0
    (1, 4, 1, 64, 16, [7], (0, 0)),                    # one split: the kernel's o itself
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-h{c[1]}-s{c[2]}-v{c[4]}")
def test_one_launch_matches_the_two_launches(case, dtype):
    T, H, S, DL, V, lens, live = case
    args = _case(T, H, S, DL, V, lens, live, dtype, seed=sum(case[:5]))
    out = mla_out.absorb_splits(*args)
    ref = two_launches(*args)
    assert out.dtype == dtype and out.shape == (T, H * V) and not torch.isnan(out).any()
    if 0 in lens:
        assert torch.equal(out[lens.index(0)].cpu().float(), torch.zeros(H * V))
    scale = ref.float().abs().max().item()
    # fp32: summation order only; bf16: W_UV's K sum in chunks may move an output by its
    # last bit
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol * scale, rtol=0)


def test_counters_are_zero_after_the_launch():
    args = _case(2, 3, 6, 64, 16, [100, 9], (16, 16), torch.float32, 1)
    mla_out.absorb_splits(*args)
    assert int(torch.count_nonzero(mla_out.arrival_counters(DEV, 6))) == 0


def test_grid_from_shapes():
    """DeepSeek-V2-Lite at one row: 16 heads x 8 chunks of 64 latent columns at 128 splits
    and at one (the W_UV tile's bound); smaller chunks where splits are many."""
    assert mla_out.plan(1, 16, 128, 512, 128) == dict(programs=128, BLOCK_S=128, CHUNK=64,
                                                      BLOCK_V=128, ROWS=1)
    assert mla_out.plan(2, 16, 128, 512, 1)["CHUNK"] == 64
    assert mla_out.plan(2, 16, 128, 512, 1)["programs"] == 256
    assert mla_out.plan(1, 16, 64, 512, 256)["CHUNK"] == 32
    m = dict(device="meta")
    launches = []
    with mock.patch.object(mla_out, "run_kernel", lambda k, g, *a, **kw: launches.append(g)), \
            mock.patch.object(mla_out, "arrival_counters",
                              lambda d, n: torch.empty(n, dtype=torch.int32, **m)):
        y = mla_out.absorb_splits(torch.empty(1, 16, 128, 512, **m),
                                  torch.empty(1, 16, 128, **m),
                                  torch.empty(1, dtype=torch.int32, **m), (64, 64),
                                  torch.empty(16, 256, 512, dtype=torch.bfloat16, **m)[:, 128:])
    assert y.shape == (1, 2048) and launches == [(128,)]


def test_the_layers_rule():
    """One launch for one or two decode rows of one KVP rank, on a Triton device, with W_UV's
    unit stride along the latent dims; the two launches elsewhere."""
    x = torch.empty(1, device=DEV)
    w_uv = torch.empty(4, 16, 8, device=DEV).to(torch.bfloat16)
    gpu = x.is_cuda
    assert mla_out.takes(1, 1) and mla_out.takes(2, 1)
    assert not mla_out.takes(3, 1) and not mla_out.takes(1, 2) and not mla_out.takes(0, 1)
    assert mla_out.fits(x, 1, 1, w_uv) == gpu                 # a Triton device (use_triton)
    assert not mla_out.fits(x, 1, 1, w_uv.transpose(1, 2))
    assert not mla_out.fits(x, 1, 2, w_uv)
    with mock.patch.object(mla_out, "ENABLED", False):
        assert not mla_out.takes(1, 1)


@pytest.mark.parametrize("heads", [16, 48], ids=["few-heads", "heads-blocks"])
def test_decode_partials_merge_to_the_decode_output(heads):
    """mla_decode(merge=False) gives the partials its merge=True call reduces: merged by the
    LSE rule they are its (o, lse) (the few-heads kernel and the general one)."""
    g = torch.Generator().manual_seed(heads)
    Dl, Dr, page = 64, 16, 16
    kv = torch.randn(12, page, Dl + Dr, generator=g).to(DEV)
    q = torch.randn(2, heads, Dl + Dr, generator=g).to(DEV)
    bt = torch.randperm(12, generator=g)[:10].view(2, 5).int().to(DEV)
    lens = torch.tensor([70, 20], dtype=torch.int32, device=DEV)
    ql, qr = q.split([Dl, Dr], dim=-1)
    o, lse = triton_mla.mla_decode(ql, qr, kv, bt, lens, 0.3, num_splits=3)
    parts = triton_mla.mla_decode(ql, qr, kv, bt, lens, 0.3, num_splits=3, merge=False)
    assert isinstance(parts, triton_splits.SplitPartials) and parts.o_ws.shape == (2, heads, 3, Dl)
    keep = live_mask(lens.cpu(), 3, *parts.live)
    lw = torch.where(keep[:, None, :], parts.lse_ws.cpu(), float("-inf"))
    pw = torch.where(keep[:, None, :, None], parts.o_ws.cpu().float(), 0.0)
    mo, ml = merge_partials(pw.permute(2, 0, 1, 3), lw.permute(2, 0, 1))
    torch.testing.assert_close(mo, o.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ml, lse.cpu(), atol=1e-5, rtol=1e-5)
    one = triton_mla.mla_decode(ql, qr, kv, bt, lens, 0.3, num_splits=1, merge=False)
    assert one.o_ws.shape == (2, heads, 1, Dl) and one.live == (0, 0)
    torch.testing.assert_close(one.o_ws[:, :, 0].cpu(), o.cpu(), atol=1e-5, rtol=1e-5)


_COMPILE_SCRIPT = """
import json
from unittest import mock
import torch
from helix.layers import mla_out
from profiling.kernel_resources import compile_sm90
m = dict(device="meta")
bf = torch.bfloat16
launches = []
with mock.patch.object(mla_out, "run_kernel",
                       lambda k, g, *a, **kw: launches.append((k, a, dict(kw, PDL=1)))), \\
        mock.patch.object(mla_out, "arrival_counters",
                          lambda d, n: torch.empty(n, dtype=torch.int32, **m)):
    for T, S in ((1, 128), (2, 64), (1, 1)):
        mla_out.absorb_splits(torch.empty(T, 16, S, 512, **m), torch.empty(T, 16, S, **m),
                              torch.empty(T, dtype=torch.int32, **m), (64, 64),
                              torch.empty(16, 256, 512, dtype=bf, **m)[:, 128:])
print(json.dumps([compile_sm90(k, a, kw) for k, a, kw in launches]))
"""


@pytest.mark.sm90
def test_kernel_compiles_for_sm90(tmp_path):
    """DeepSeek-V2-Lite's shapes (bf16, PDL): one and two rows, 128 / 64 / one split. No
    spills."""
    import json
    res = sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT], timeout=900, fp_fusion=True)
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(recs) == 3 and {r["kernel"] for r in recs} == {"_absorb_splits_kernel"}
    for r in recs:
        assert r["local_loads"] == 0 and r["stack_bytes"] == 0, r


# -- GPU: the launch on the Gluon kernel's partials, graphs, whole decodes ------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def _gluon_partials(T, ctx, seed):
    """The Gluon MLA kernel's partials at DeepSeek-V2-Lite's shape (16 heads, 512 + 64), and
    its merged output."""
    from helix.attention import gluon_mla
    assert gluon_mla.gluon_available("cuda", "few")
    g = torch.Generator().manual_seed(seed)
    page = 64
    pages = T * (-(-ctx // page)) + 2
    kv = (torch.randn(pages, page, 576, generator=g) * 0.5).to("cuda", torch.bfloat16)
    q = (torch.randn(T, 16, 576, generator=g) * 0.5).to("cuda", torch.bfloat16)
    bt = torch.arange(T * (pages // T), dtype=torch.int32, device="cuda").view(T, -1)
    lens = torch.tensor([ctx - 100 * t for t in range(T)], dtype=torch.int32, device="cuda")
    ql, qr = q.split([512, 64], dim=-1)
    run = dict(q_latent=ql, q_rope=qr, kv_cache=kv, block_tables=bt, kv_lens=lens, scale=0.1,
               variant="few")
    return gluon_mla.mla_decode_gluon(**run, merge=False), gluon_mla.mla_decode_gluon(**run), lens


def _w_uv(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(16, 256, 512, generator=g) / 22).to("cuda", torch.bfloat16)[:, 128:]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,ctx", [(1, 1024), (1, 32768), (2, 5000)])
def test_gpu_launch_on_the_gluon_partials(T, ctx):
    """At DeepSeek-V2-Lite's shape, against the two launches the layer runs without it
    (reduce_splits inside mla_decode_gluon, the W_UV GEMV) on the same partials, and against
    the formulas; the counters back to zero after each launch."""
    from helix.layers.skinny_gemm import absorb_v
    parts, (o, _), lens = _gluon_partials(T, ctx, T + ctx)
    w_uv = _w_uv(ctx)
    ref = absorb_v(o, w_uv)
    scale = ref.float().abs().max().item()
    for _ in range(3):
        y = mla_out.absorb_splits(parts.o_ws, parts.lse_ws, lens, parts.live, w_uv)
        torch.cuda.synchronize()
        assert int(torch.count_nonzero(mla_out.arrival_counters("cuda", 32))) == 0
        torch.testing.assert_close(y.float(), ref.float(), atol=1e-2 * scale, rtol=0)
    formulas = two_launches(parts.o_ws, parts.lse_ws, lens, parts.live, w_uv)
    torch.testing.assert_close(y.float().cpu(), formulas.float(), atol=1e-2 * scale, rtol=0)


@pytest.mark.gpu
@gpu
def test_gpu_graph_replays_on_new_partials():
    parts, _, lens = _gluon_partials(1, 4096, 3)
    w_uv = _w_uv(5)
    o_ws, lse_ws = parts.o_ws.clone(), parts.lse_ws.clone()
    mla_out.absorb_splits(o_ws, lse_ws, lens, parts.live, w_uv)                 # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mla_out.absorb_splits(o_ws, lse_ws, lens, parts.live, w_uv)
    for seed in (1, 2):
        o_ws.normal_(generator=torch.Generator("cuda").manual_seed(seed))
        graph.replay()
        torch.cuda.synchronize()
        ref = two_launches(o_ws, lse_ws, lens, parts.live, w_uv)
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(y.float().cpu(), ref.float(), atol=1e-2 * scale, rtol=0)
        assert int(torch.count_nonzero(mla_out.arrival_counters("cuda", 32))) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", ["tiny-deepseek-v3"])
def test_gpu_captured_decode_either_way(model, monkeypatch):
    """Whole captured decodes (bf16, buckets 1 / 2 / 4): the launch taken at one and two
    rows, the same greedy tokens as with the two launches, logits within bf16 rounding."""
    from gpu_decode import captured_decode
    calls = []
    real = mla_out.absorb_splits
    monkeypatch.setattr(mla_out, "absorb_splits", lambda *a: calls.append(1) or real(*a))
    one_tokens, one_logits = captured_decode(model)
    assert calls
    monkeypatch.setattr(mla_out, "ENABLED", False)
    tokens, logits = captured_decode(model)
    assert one_tokens == tokens
    for a, b in zip(one_logits, logits):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)
