"""helix.layers.skinny_gemm against the torch formulas it replaces: F.linear (with and without
bias), W_UK's absorption of the queries (einsum over a strided [h, K, N] view of kv_b_proj) and
W_UV's of the latent outputs; one K split and several (the last program to arrive sums the
partials), ragged feature blocks, 1-16 rows; the dispatch rule; the split rule from shapes.

Without CUDA the kernel runs through Triton's interpreter (fp32 / fp16 there: its bf16 dot
products are not the GPU's); on a GPU the same tests run the compiled kernel in bf16 too."""

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

from unittest import mock  # noqa: E402

import pytest  # noqa: E402

from helix.layers import skinny_gemm as sg  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(out, ref, dtype):
    torch.testing.assert_close(out.float().cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,N,K,split,bias", [(1, 40, 96, 1, False), (3, 72, 256, 4, True),
                                              (16, 33, 200, 2, False), (5, 64, 64, None, True)])
def test_linear_matches_f_linear(T, N, K, split, bias, dtype):
    g = torch.Generator().manual_seed(T * N)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    cfg = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split)
    out = sg.linear_triton(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), cfg)
    assert out.shape == (T, N) and out.dtype == dtype
    _close(out, ref, dtype)
    again = sg.linear_triton(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), cfg)
    assert torch.equal(out, again)              # the counters were reset; the sum order fixed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [1, 2])
def test_absorb_q_matches_einsum_on_strided_views(split, dtype):
    """q_nope is a view of q [T, h, nope + rope], W_UK a view [h, nope, Dl] of kv_b_proj's
    [h, nope + v, Dl] (unit stride along Dl, the output axis)."""
    g = torch.Generator().manual_seed(split)
    T, H, nope, rope, V, Dl = 3, 4, 64, 16, 24, 48
    q = torch.randn(T, H, nope + rope, generator=g).to(dtype)
    w = (torch.randn(H, nope + V, Dl, generator=g) / 8).to(dtype)
    q_nope, w_uk = q[..., :nope], w[:, :nope]
    ref = torch.einsum("thn,hnc->thc", q_nope.float(), w_uk.float())
    out = sg.absorb_q_triton(q_nope.to(DEV), w_uk.to(DEV),
                             dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split))
    assert out.shape == (T, H, Dl) and out.is_contiguous()
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 7])
def test_absorb_v_matches_einsum(T, dtype):
    """The W_UV slice is a strided view of kv_b_proj ([h, nope + v, Dl] -> [:, nope:]), the
    merged heads a slice of the local heads (m0 offset)."""
    g = torch.Generator().manual_seed(T)
    H, nope, V, Dl = 6, 16, 24, 80
    w = (torch.randn(H, nope + V, Dl, generator=g) / 9).to(dtype)
    w_uv = w[:, nope:][2:5]                                            # [3, V, Dl], strided
    o = torch.randn(T, 3, Dl, generator=g).to(dtype)
    ref = sg.absorb_v_torch(o.float(), w_uv.float())
    for split in (None, 2):
        out = sg.absorb_v_triton(o.to(DEV), w_uv.to(DEV), dict(BLOCK_K=32, SPLIT_K=split))
        assert out.shape == (T, 3 * V) and out.dtype == dtype and out.is_contiguous()
        _close(out, ref, dtype)


def test_dispatch_falls_back_off_cuda_and_past_the_rows():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 32, generator=g), torch.randn(8, 32, generator=g)
    assert torch.equal(sg.linear(x, w), torch.nn.functional.linear(x, w))
    q, wk = torch.randn(2, 3, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    assert torch.equal(sg.absorb_q(q, wk), torch.einsum("thk,hkn->thn", q, wk))
    o, wv = torch.randn(sg.ABSORB_MAX_ROWS + 1, 2, 16), torch.randn(2, 8, 16)
    assert torch.equal(sg.absorb_v(o, wv), sg.absorb_v_torch(o, wv))
    with mock.patch.object(sg, "use_triton", lambda t: True), \
            mock.patch.object(sg, "linear_triton", side_effect=AssertionError("kernel")):
        xb, wb = x.bfloat16(), w.bfloat16()
        big = torch.randn(sg.MAX_ROWS + 1, 32).bfloat16()
        torch.testing.assert_close(sg.linear(big, wb), torch.nn.functional.linear(big, wb))
        with pytest.raises(AssertionError, match="kernel"):
            sg.linear(xb, wb)                                   # decode rows: the kernel
        assert torch.equal(sg.linear(x, w), torch.nn.functional.linear(x, w))   # fp32: torch


def test_split_rule_from_shapes():
    """DeepSeek-V2-Lite at one row, 132 SMs: about two programs per SM, a split >= a K tile."""
    def split(N, K, G=1):
        return sg.skinny_config(1, N, K, G, 132)["SPLIT_K"]
    assert split(3072, 2048) == 4               # q_proj: 96 feature blocks
    assert split(576, 2048) == 16               # kv_a: 18 blocks, 128-deep splits
    assert split(2048, 2048) == 8               # o_proj
    assert split(512, 128, 16) == 1             # W_UK: 256 blocks, one K tile
    assert split(128, 512, 16) == 4             # W_UV: 64 blocks
    with pytest.raises(ValueError, match="unknown skinny GEMM tunables"):
        sg.skinny_config(1, 8, 8, 1, 132, {"BLOCK_M": 16})


def test_launch_grids_from_shapes():
    m = dict(device="meta")
    grids = []
    from helix.attention import triton_splits
    with mock.patch.object(sg, "run_kernel", lambda k, grid, *a, **kw: grids.append(grid)), \
            mock.patch.object(sg, "arrival_counters", lambda device, n: None), \
            mock.patch.object(triton_splits, "sm_count_of", lambda device: 132):
        bf = torch.bfloat16
        out = sg.linear_triton(torch.empty(2, 2048, dtype=bf, **m),
                               torch.empty(3072, 2048, dtype=bf, **m))
        assert out.shape == (2, 3072)
        out = sg.absorb_v_triton(torch.empty(4, 16, 512, dtype=bf, **m),
                                 torch.empty(16, 128, 512, dtype=bf, **m))
        assert out.shape == (4, 2048)
    assert grids == [(96, 4, 1), (4, 4, 16)]

