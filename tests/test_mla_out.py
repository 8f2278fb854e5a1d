"""helix.layers.mla_out, absorbed MLA's split merge + W_UV + o_proj in one launch, against the
three launches' formulas (the LSE merge with empty splits skipped, W_UV, o_proj, each rounded);
the MLA decode kernels' split partials (merge=False) against their merged outputs; the grid
from shapes; the layer's rule; an sm_90 compile (no spills, registers that leave room for the
MLA kernel beside it). On the GPU: the one launch with its grid barrier on the Gluon kernel's
partials at DeepSeek-V2-Lite's shape, graph replays, and whole captured decodes either way.

Without CUDA the kernels run through Triton's interpreter, where the two phases are two
launches (a grid barrier cannot open there: programs run one after another)."""

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


def three_launches(o_ws, lse_ws, kv_lens, live, w_uv, w_o):
    """reduce_splits, absorb_v, o_proj's linear as formulas: each output rounded to w's dtype."""
    T, H, S, DL = o_ws.shape
    keep = live_mask(kv_lens.cpu(), S, *live)
    lse = torch.where(keep[:, None, :], lse_ws.float().cpu(), float("-inf"))
    part = torch.where(keep[:, None, :, None], o_ws.float().cpu(), 0.0)
    o, _ = merge_partials(part.permute(2, 0, 1, 3), lse.permute(2, 0, 1))
    o = o.to(w_uv.dtype).float()
    y = torch.einsum("thc,hvc->thv", o, w_uv.float().cpu()).to(w_uv.dtype).reshape(T, -1)
    return torch.nn.functional.linear(y.float(), w_o.float().cpu()).to(w_o.dtype)


def _case(T, H, S, DL, V, N, lens, live, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    o_ws = torch.randn(T, H, S, DL, generator=g)
    lse_ws = torch.randn(T, H, S, generator=g) * 2
    keep = live_mask(torch.tensor(lens), S, *live)
    dead = ~keep[:, None, :].expand(T, H, S)
    o_ws[dead] = float("nan")                   # what an empty split holds: never read
    lse_ws[dead] = float("nan")
    w_uv = (torch.randn(H, 2 * V, DL, generator=g) / DL ** 0.5).to(dtype)[:, V:]   # strided
    w_o = (torch.randn(N, H * V, generator=g) / (H * V) ** 0.5).to(dtype)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (o_ws, lse_ws, kv_lens)] + [live, w_uv.to(DEV), w_o.to(DEV)]


CASES = [  # T, H, S, DL, V, N, kv_lens, live
    (1, 4, 5, 40, 8, 20, [40], (8, 8)),               # padded dims, every split live
    (2, 3, 6, 64, 16, 48, [100, 9], (16, 16)),         # two rows, row 1's last splits empty
    (2, 2, 16, 32, 8, 24, [0, 33], (4, 4)),            # a row with no tokens: output 0
    (1, 4, 1, 64, 16, 40, [7], (0, 0)),                # one split: the kernel's o itself
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-h{c[1]}-s{c[2]}-n{c[5]}")
def test_one_launch_matches_the_three_launches(case, dtype):
    T, H, S, DL, V, N, lens, live = case
    args = _case(T, H, S, DL, V, N, lens, live, dtype, seed=sum(case[:6]))
    out = mla_out.project(*args)
    ref = three_launches(*args)
    assert out.dtype == dtype and out.shape == (T, N) and not torch.isnan(out).any()
    if 0 in lens:
        assert torch.equal(out[lens.index(0)].cpu().float(), torch.zeros(N))
    scale = ref.float().abs().max().item()
    # fp32: summation order only; bf16: W_UV's K sum in chunks may move y by its last bit
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol * scale, rtol=0)


def test_counter_is_zero_after_the_launch():
    args = _case(2, 3, 6, 64, 16, 48, [100, 9], (16, 16), torch.float32, 1)
    mla_out.project(*args)
    assert int(torch.count_nonzero(mla_out.arrival_counters(DEV, 1))) == 0


def test_grid_from_shapes():
    """DeepSeek-V2-Lite at one row on 132 SMs: 16 heads x 8 chunks of 64 latent columns,
    256 blocks of 8 o_proj rows, 132 programs; one launch on a GPU, the two phases as two
    in the interpreter."""
    p = mla_out.plan(1, 16, 128, 512, 2048, 128, 132)
    assert p == dict(programs=132, BLOCK_S=128, CHUNK=64, BLOCK_V=128, BLOCK_NO=8,
                     BLOCK_HV=2048, ROWS=1)
    assert mla_out.plan(2, 16, 128, 512, 2048, 1, 132)["CHUNK"] == 64      # W_UV tile bound
    small = mla_out.plan(1, 2, 8, 32, 16, 4, 132)                           # few rows: small
    assert small["BLOCK_NO"] == 1 and small["programs"] == 16               # blocks, more of them
    m = dict(device="meta")
    launches = []
    with mock.patch.object(mla_out, "run_kernel", lambda k, g, *a, **kw: launches.append(
            (g, kw["PHASE"]))), \
            mock.patch.object(mla_out, "arrival_counters",
                              lambda d, n: torch.empty(n, dtype=torch.int32, **m)), \
            mock.patch.object(triton_splits, "sm_count_of", lambda d: 132):
        out = mla_out.project(torch.empty(1, 16, 128, 512, **m), torch.empty(1, 16, 128, **m),
                              torch.empty(1, dtype=torch.int32, **m), (64, 64),
                              torch.empty(16, 256, 512, dtype=torch.bfloat16, **m)[:, 128:],
                              torch.empty(2048, 2048, dtype=torch.bfloat16, **m))
    assert out.shape == (1, 2048)
    assert launches == ([((132,), 0)] if ON_GPU else [((132,), 1), ((132,), 2)])


def test_the_layers_rule():
    """One launch for one or two decode rows of one KVP rank, on a Triton device, with the
    weights' unit strides along K; the three launches elsewhere."""
    x = torch.empty(1, device=DEV)
    w_uv = torch.empty(4, 16, 8, device=DEV).to(torch.bfloat16)
    w_o = torch.empty(12, 64, device=DEV).to(torch.bfloat16)
    gpu = x.is_cuda
    assert mla_out.takes(1, 1) and mla_out.takes(2, 1)
    assert not mla_out.takes(3, 1) and not mla_out.takes(1, 2) and not mla_out.takes(0, 1)
    assert mla_out.fits(x, 1, 1, w_uv, w_o) == gpu            # a Triton device (use_triton)
    assert not mla_out.fits(x, 1, 1, w_uv.transpose(1, 2), w_o)
    assert not mla_out.fits(x, 1, 1, w_uv, w_o.float())
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
                          lambda d, n: torch.empty(n, dtype=torch.int32, **m)), \\
        mock.patch("helix.attention.triton_splits.sm_count_of", lambda d: 132):
    for T, S in ((1, 128), (2, 64), (1, 1)):
        mla_out.project(torch.empty(T, 16, S, 512, **m), torch.empty(T, 16, S, **m),
                        torch.empty(T, dtype=torch.int32, **m), (64, 64),
                        torch.empty(16, 256, 512, dtype=bf, **m)[:, 128:],
                        torch.empty(2048, 2048, dtype=bf, **m))
print(json.dumps([compile_sm90(k, a, kw) for k, a, kw in launches]))
"""


@pytest.mark.sm90
def test_kernel_compiles_for_sm90(tmp_path):
    """DeepSeek-V2-Lite's shapes (bf16, PDL, one launch): one and two rows, 128 / 64 / one
    split. No spills, and at most 128 registers a thread on 8 warps: 32K registers, which
    leave room for the MLA kernel's programs so this one is resident under them (PDL)."""
    import json
    res = sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT], timeout=900, fp_fusion=True)
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(recs) == 3 and {r["kernel"] for r in recs} == {"_mla_out_kernel"}
    for r in recs:
        assert r["local_loads"] == 0 and r["stack_bytes"] == 0, r
        assert r["num_warps"] == 8 and r["registers"] <= 128, r


# -- GPU: the one launch, its barrier, graphs, whole decodes --------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (the grid barrier runs only there)")


def _gluon_partials(T, ctx, seed):
    """The Gluon MLA kernel's partials at DeepSeek-V2-Lite's shape (16 heads, 512 + 64)."""
    from helix.attention import gluon_mla
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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,ctx", [(1, 1024), (1, 32768), (2, 5000)])
def test_gpu_one_launch_on_the_gluon_partials(T, ctx):
    """At DeepSeek-V2-Lite's shape, against the three launches the layer ran before
    (reduce_splits, the W_UV GEMV, the o_proj GEMV) on the same partials; the barrier's
    counter back to zero after each launch."""
    from helix.attention import gluon_mla
    from helix.layers.skinny_gemm import absorb_v, linear
    assert gluon_mla.gluon_available("cuda", "few")
    parts, (o, _), lens = _gluon_partials(T, ctx, T + ctx)
    g = torch.Generator().manual_seed(ctx)
    w_uv = (torch.randn(16, 256, 512, generator=g) / 22).to("cuda", torch.bfloat16)[:, 128:]
    w_o = (torch.randn(2048, 2048, generator=g) / 45).to("cuda", torch.bfloat16)
    ref = linear(absorb_v(o, w_uv), w_o)
    for _ in range(3):
        out = mla_out.project(parts.o_ws, parts.lse_ws, lens, parts.live, w_uv, w_o)
        torch.cuda.synchronize()
        assert int(torch.count_nonzero(mla_out.arrival_counters("cuda", 1))) == 0
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2 * scale, rtol=0)
    torch.testing.assert_close(out.float(), three_launches(parts.o_ws, parts.lse_ws, lens,
                                                           parts.live, w_uv, w_o).cuda().float(),
                               atol=1e-2 * scale, rtol=0)


@pytest.mark.gpu
@gpu
def test_gpu_graph_replays_on_new_partials():
    parts, _, lens = _gluon_partials(1, 4096, 3)
    g = torch.Generator().manual_seed(5)
    w_uv = (torch.randn(16, 128, 512, generator=g) / 22).to("cuda", torch.bfloat16)
    w_o = (torch.randn(2048, 2048, generator=g) / 45).to("cuda", torch.bfloat16)
    o_ws, lse_ws = parts.o_ws.clone(), parts.lse_ws.clone()
    mla_out.project(o_ws, lse_ws, lens, parts.live, w_uv, w_o)              # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_out.project(o_ws, lse_ws, lens, parts.live, w_uv, w_o)
    for seed in (1, 2):
        o_ws.normal_(generator=torch.Generator("cuda").manual_seed(seed))
        graph.replay()
        torch.cuda.synchronize()
        ref = three_launches(o_ws, lse_ws, lens, parts.live, w_uv, w_o).cuda()
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2 * scale, rtol=0)
        assert int(torch.count_nonzero(mla_out.arrival_counters("cuda", 1))) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", ["tiny-deepseek-v3"])
def test_gpu_captured_decode_either_way(model, monkeypatch):
    """Whole captured decodes (bf16, buckets 1 / 2 / 4): the one launch taken at one and two
    rows, the same greedy tokens as with the three launches, logits within bf16 rounding."""
    from gpu_decode import captured_decode
    calls = []
    real = mla_out.project
    monkeypatch.setattr(mla_out, "project", lambda *a: calls.append(1) or real(*a))
    one_tokens, one_logits = captured_decode(model)
    assert calls
    monkeypatch.setattr(mla_out, "ENABLED", False)
    tokens, logits = captured_decode(model)
    assert one_tokens == tokens
    for a, b in zip(one_logits, logits):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)
