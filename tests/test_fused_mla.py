"""helix.layers.fused_mla against the MLA layer's previous torch formulas: the latent cache row
(RMS norm + RoPE + concat in one kernel); fp32 / fp16 / bf16 (the interpreter made to round
fp32 -> bf16 like the GPU), interleaved and half-split RoPE; grids from shapes only (meta
tensors). (W_UV's absorption: tests/test_skinny_gemm.py.)

Without CUDA the kernels run through Triton's interpreter."""

import torch

from triton_mode import DEV, ON_GPU, gpu_rounding  # first: picks the interpreter before triton

import sm90_compile  # noqa: E402

from unittest import mock  # noqa: E402

import pytest  # noqa: E402

from helix.layers import fused_mla as fmla  # noqa: E402
from helix.layers.fused_ops import rope_torch  # noqa: E402
from helix.layers.rope import RotaryEmbedding  # noqa: E402
from helix.config import RopeConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _gpu_rounding():
    with gpu_rounding():
        yield


def ulps(a, b) -> int:
    ibits, mask = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.bfloat16: (torch.int16, 0x7FFF)}[a.dtype]

    def ordered(t):
        i = t.detach().cpu().contiguous().view(ibits).long()
        return torch.where(i < 0, -(i & mask), i)
    return int((ordered(a) - ordered(b)).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dims,interleave,heads", [((512, 64), True, 16), ((48, 16), False, 3)],
                         ids=["deepseek-interleaved", "small-halves"])
def test_kv_row_matches_torch(dims, interleave, heads, dtype):
    """The cache row and, in the same launch, the queries' rope dims (a strided view of the
    q projection, as the layer passes them) against the torch formulas."""
    Dl, Dr = dims
    g = torch.Generator().manual_seed(Dl)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, adjacent_pairs=interleave), Dr, 64)
    ckv = (torch.randn(5, Dl + Dr + 8, generator=g) * 3).to(dtype)[:, 4:4 + Dl + Dr]  # strided
    w = (torch.rand(Dl, generator=g) + 0.5).to(dtype)
    q = (torch.randn(5, heads, 24 + Dr, generator=g) * 3).to(dtype)
    q_rope = q.split([24, Dr], dim=-1)[1]                                 # [5, h, Dr] strided
    pos = torch.tensor([0, 7, 63, 2, 40])
    ref, ref_q = fmla.mla_kv_row_torch(ckv, w, 1e-6, rope.cos, rope.sin, pos, interleave,
                                       q_rope)
    assert torch.equal(ref_q, rope_torch(q_rope, rope.cos, rope.sin, pos, interleave))
    out, out_q = fmla.mla_kv_row_triton(ckv.to(DEV), w.to(DEV), 1e-6, rope.cos.to(DEV),
                                        rope.sin.to(DEV), pos.to(DEV), interleave,
                                        q_rope.to(DEV))
    assert out.dtype == dtype and out.shape == (5, Dl + Dr) and out.is_contiguous()
    assert out_q.shape == (5, heads, Dr) and out_q.is_contiguous()
    assert ulps(out[:, Dl:].cpu(), ref[:, Dl:]) == 0                  # RoPE: bitwise
    assert ulps(out_q.cpu(), ref_q) == 0
    # the norm's sum order differs from torch's: fp32 within a few ulps, half types within one
    assert ulps(out[:, :Dl].cpu(), ref[:, :Dl]) <= (8 if dtype == torch.float32 else 1)
    if dtype != torch.float32:                               # nearly all bitwise equal
        assert (out[:, :Dl].cpu() == ref[:, :Dl]).float().mean() > 0.97
    alone, none = fmla.mla_kv_row_triton(ckv.to(DEV), w.to(DEV), 1e-6, rope.cos.to(DEV),
                                         rope.sin.to(DEV), pos.to(DEV), interleave)
    assert none is None and torch.equal(alone, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", ["same", "float32"])
def test_kv_row_appends_to_the_pool(dtype, cache_dtype):
    """With the pool, the same launch writes each row at its flat slot (-1 skipped, every
    other pool row untouched), in the pool's dtype; the torch formula does the same."""
    Dl, Dr = 48, 16
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, adjacent_pairs=True), Dr, 64)
    ckv = (torch.randn(4, Dl + Dr, generator=g) * 3).to(dtype)
    w = (torch.rand(Dl, generator=g) + 0.5).to(dtype)
    pos = torch.tensor([3, 9, 0, 33])
    slots = torch.tensor([5, -1, 0, 11])                       # pool of 3 pages x 4 positions
    pool_dtype = dtype if cache_dtype == "same" else torch.float32
    got = {}
    for name, fn, dev in (("torch", fmla.mla_kv_row_torch, "cpu"),
                          ("triton", fmla.mla_kv_row_triton, DEV)):
        pool = torch.full((3, 4, Dl + Dr), -7.0, dtype=pool_dtype, device=dev)
        row, _ = fn(ckv.to(dev), w.to(dev), 1e-6, rope.cos.to(dev), rope.sin.to(dev),
                    pos.to(dev), True, None, pool, slots.to(dev))
        flat = pool.view(-1, Dl + Dr).cpu()
        keep = slots >= 0
        assert torch.equal(flat[slots[keep]], row.cpu()[keep].to(pool_dtype))
        others = torch.ones(12, dtype=torch.bool)
        others[slots[keep]] = False
        assert bool((flat[others] == -7.0).all())
        got[name] = row.cpu()
    alone, _ = fmla.mla_kv_row_triton(ckv.to(DEV), w.to(DEV), 1e-6, rope.cos.to(DEV),
                                      rope.sin.to(DEV), pos.to(DEV), True)
    assert torch.equal(alone.cpu(), got["triton"])          # appending changes no row value
    assert ulps(got["triton"], got["torch"]) <= (8 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T,split,append", [(1, None, True), (3, 2, True), (2, 1, False)])
def test_absorb_and_kv_row_in_one_launch(T, split, append, dtype):
    """mla_absorb_kv_row_triton: W_UK's absorption (skinny GEMM programs, one K split or
    several: the arrival counters indexed by the GEMM's own blocks) and the kv rows (the
    programs after them) of one grid give the two launches' tensors bitwise (fp32 on a GPU:
    within rounding), the append included, and the counters are reset."""
    from helix.layers import skinny_gemm as sg
    g = torch.Generator().manual_seed(T)
    H, nope, V, Dl, Dr = 4, 64, 16, 48, 16
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, adjacent_pairs=True), Dr, 64)
    q = (torch.randn(T, H, nope + Dr, generator=g)).to(dtype)
    w_kv = (torch.randn(H, nope + V, Dl, generator=g) / 8).to(dtype)
    ckv = (torch.randn(T, Dl + Dr, generator=g) * 3).to(dtype)
    w = (torch.rand(Dl, generator=g) + 0.5).to(dtype)
    pos = torch.tensor([3, 9, 0][:T])
    slots = torch.tensor([5, -1, 0][:T])
    args = [t.to(DEV) for t in (q[..., :nope], w_kv[:, :nope], ckv, w)]
    rest = (1e-6, rope.cos.to(DEV), rope.sin.to(DEV), pos.to(DEV), True, q[..., nope:].to(DEV))
    cfg = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split)
    real = sg.skinny_config
    outs = []
    with mock.patch.object(sg, "skinny_config", lambda *a: real(*a[:5], cfg)):
        for fused in (True, False):
            pool = torch.full((3, 4, Dl + Dr), -7.0, dtype=dtype, device=DEV)
            tail = (pool, slots.to(DEV)) if append else ()
            if fused:
                got = fmla.mla_absorb_kv_row_triton(*args, *rest, *tail)
            else:
                got = (sg.absorb_q_triton(args[0], args[1], cfg),
                       *fmla.mla_kv_row_triton(*args[2:], *rest, *tail))
            outs.append([t.cpu() for t in got] + [pool.cpu()])
    for a, b in zip(*outs):
        if ON_GPU and dtype == torch.float32:
            # compiled, the one launch runs the kv rows at the GEMM's num_warps, so the norm's
            # fp32 sum of squares takes another reduction order than _kv_row_kernel's (on the
            # H200: not bitwise at T = 3 with 2 K splits); 16-bit outputs round that away
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b)
    ref = torch.einsum("thn,hnc->thc", q[..., :nope].float(), w_kv[:, :nope].float())
    torch.testing.assert_close(outs[0][0].float(), ref, rtol=2e-3, atol=2e-3)
    from helix.triton_util import arrival_counters
    assert int(arrival_counters(DEV, 64).abs().sum()) == 0


def test_absorb_and_kv_row_dispatch():
    """One launch only where both kernels take the shapes and the rows agree (absorbed
    steps); otherwise absorb_q and mla_kv_row, whose own rules choose kernel or torch."""
    from helix.layers import skinny_gemm as sg
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 8, 16)
    ckv, w = torch.randn(3, 24, generator=g).half(), torch.rand(16, generator=g).half()
    pos = torch.tensor([1, 2, 3])
    q = torch.randn(3, 2, 16, generator=g).half()
    w_uk = torch.randn(2, 8, 16, generator=g).half()
    got = fmla.mla_absorb_kv_row(q[..., :8], w_uk, ckv, w, 1e-6, rope.cos, rope.sin, pos, False,
                                 q[..., 8:])
    want = (torch.einsum("thk,hkn->thn", q[..., :8], w_uk),
            *fmla.mla_kv_row_torch(ckv, w, 1e-6, rope.cos, rope.sin, pos, False, q[..., 8:]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))          # CPU: torch
    calls = []
    with mock.patch.object(sg, "use_triton", lambda t: True), \
            mock.patch.object(fmla, "use_triton", lambda t: True), \
            mock.patch.object(fmla, "mla_absorb_kv_row_triton",
                              lambda *a: calls.append("one") or (None, None, None)), \
            mock.patch.object(fmla, "absorb_q", lambda *a: calls.append("absorb")), \
            mock.patch.object(fmla, "mla_kv_row", lambda *a: calls.append("row") or (1, 2)):
        fmla.mla_absorb_kv_row(q[..., :8], w_uk, ckv, w, 1e-6, rope.cos, rope.sin, pos, False,
                               q[..., 8:])
        fmla.mla_absorb_kv_row(q[:1, :, :8], w_uk, ckv, w, 1e-6, rope.cos, rope.sin, pos, False,
                               q[..., 8:])                       # decompressed chunks: fewer
        with mock.patch.object(fmla, "FUSE_ABSORB", False):
            fmla.mla_absorb_kv_row(q[..., :8], w_uk, ckv, w, 1e-6, rope.cos, rope.sin, pos,
                                   False, q[..., 8:])
    assert calls == ["one", "absorb", "row", "absorb", "row"]


def test_dispatch_falls_back_off_cuda_and_for_prefill():
    """CPU tensors take the torch formulas (the layer's previous code, unchanged)."""
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 8, 16)
    ckv, w = torch.randn(3, 24, generator=g), torch.rand(16, generator=g)
    pos = torch.tensor([1, 2, 3])
    q = torch.randn(3, 2, 8, generator=g)
    got = fmla.mla_kv_row(ckv, w, 1e-6, rope.cos, rope.sin, pos, False, q)
    want = fmla.mla_kv_row_torch(ckv, w, 1e-6, rope.cos, rope.sin, pos, False, q)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_launch_grids_from_shapes():
    m = dict(device="meta")
    grids = []
    with mock.patch.object(fmla, "run_kernel", lambda k, grid, *a, **kw: grids.append(grid)):
        out, q = fmla.mla_kv_row_triton(
            torch.empty(4, 576, dtype=torch.bfloat16, **m),
            torch.empty(512, dtype=torch.bfloat16, **m), 1e-6, torch.empty(100, 32, **m),
            torch.empty(100, 32, **m), torch.empty(4, dtype=torch.int64, **m), True,
            torch.empty(4, 16, 192, dtype=torch.bfloat16, **m)[..., 128:])
        assert out.shape == (4, 576) and q.shape == (4, 16, 64)
        from helix.attention import triton_splits
        with mock.patch.object(triton_splits, "sm_count_of", lambda device: 132):
            bf = dict(dtype=torch.bfloat16, **m)      # DeepSeek-V2-Lite, one row
            ql, row, q = fmla.mla_absorb_kv_row_triton(
                torch.empty(1, 16, 192, **bf)[..., :128],
                torch.empty(16, 256, 512, **bf)[:, :128], torch.empty(1, 576, **bf),
                torch.empty(512, **bf), 1e-6, torch.empty(100, 32, **m),
                torch.empty(100, 32, **m), torch.empty(1, dtype=torch.int64, **m), True,
                torch.empty(1, 16, 192, **bf)[..., 128:], torch.empty(9, 64, 576, **bf),
                torch.empty(1, dtype=torch.int64, **m))
        assert ql.shape == (1, 16, 512) and row.shape == (1, 576) and q.shape == (1, 16, 64)
    assert grids == [(4,), (16 + 1, 1, 16)]      # W_UK's 16 blocks x 16 heads, then the row


_COMPILE_SCRIPT = """
import json
from unittest import mock
import torch
from helix.layers import fused_mla as fmla
from profiling.kernel_resources import compile_sm90
m = dict(device="meta")
launches = []
with mock.patch.object(fmla, "run_kernel", lambda k, g, *a, **kw: launches.append((k, a, kw))):
    bf = torch.bfloat16
    fmla.mla_kv_row_triton(torch.empty(8, 576, dtype=bf, **m), torch.empty(512, dtype=bf, **m),
                           1e-6, torch.empty(100, 32, **m), torch.empty(100, 32, **m),
                           torch.empty(8, dtype=torch.int64, **m), True,
                           torch.empty(8, 128, 192, dtype=bf, **m)[..., 128:],
                           torch.empty(50, 64, 576, dtype=bf, **m),
                           torch.empty(8, dtype=torch.int64, **m))
    with mock.patch("helix.attention.triton_splits.sm_count_of", lambda d: 132):
        fmla.mla_absorb_kv_row_triton(
            torch.empty(1, 16, 192, dtype=bf, **m)[..., :128],
            torch.empty(16, 256, 512, dtype=bf, **m)[:, :128],
            torch.empty(1, 576, dtype=bf, **m), torch.empty(512, dtype=bf, **m), 1e-6,
            torch.empty(100, 32, **m), torch.empty(100, 32, **m),
            torch.empty(1, dtype=torch.int64, **m), True,
            torch.empty(1, 16, 192, dtype=bf, **m)[..., 128:],
            torch.empty(50, 64, 576, dtype=bf, **m), torch.empty(1, dtype=torch.int64, **m))
print(json.dumps([compile_sm90(k, a, kw) for k, a, kw in launches]))
"""


@pytest.mark.sm90
def test_kernels_compile_for_sm90(tmp_path):
    """DeepSeek-V2-Lite's shapes (bf16) compile for sm_90 without spills: the kv row alone
    (8 rows, 128 heads' rope dims) and with W_UK's absorption in its grid (one row)."""
    import json
    res = sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT], timeout=600, fp_fusion=True)
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in recs] == ["_kv_row_kernel", "_absorb_kv_row_kernel"]
    assert all(r["local_loads"] == 0 and r["stack_bytes"] == 0 for r in recs), recs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny-deepseek-v3"])
def test_captured_decode_with_absorb_and_row_in_one_launch(model, monkeypatch):
    """Whole captured decodes (q_lora MLA, dense and MoE layers): W_UK's absorption and the kv
    row in one launch against the two launches: bitwise the same tokens and logits (the
    same programs compute the same values)."""
    from gpu_decode import captured_decode
    launches = []
    real = fmla.mla_absorb_kv_row_triton
    monkeypatch.setattr(fmla, "mla_absorb_kv_row_triton",
                        lambda *a: launches.append(1) or real(*a))
    one_tokens, one_logits = captured_decode(model)
    assert launches
    monkeypatch.setattr(fmla, "FUSE_ABSORB", False)
    tokens, logits = captured_decode(model)
    assert one_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(one_logits, logits))
