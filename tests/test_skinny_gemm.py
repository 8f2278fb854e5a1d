"""helix.layers.skinny_gemm against the torch formulas it replaces: F.linear (with and without
bias), W_UK's absorption of the queries (einsum over a strided [h, K, N] view of kv_b_proj) and
W_UV's of the latent outputs; one K split and several (the last program to arrive sums the
partials), ragged feature blocks, 1-16 rows; the dispatch rule; the split rule from shapes.

Without CUDA the kernel runs through Triton's interpreter (fp32 / fp16 there: its bf16 dot
products are not the GPU's); on a GPU the same tests run the compiled kernel in bf16 too."""

import torch

from triton_mode import DEV, ON_GPU, gpu_rounding  # first: picks the interpreter

import sm90_compile  # noqa: E402

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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,G,N,K,bias,early", [(1, 1, 40, 96, False, True),
                                                (2, 1, 72, 256, True, False),
                                                (2, 3, 24, 80, False, True),
                                                (1, 2, 33, 200, True, True)])
def test_gemv_matches_the_torch_formulas(T, G, N, K, bias, early, dtype):
    """The one-tile GEMV: ragged feature blocks and K (masked to the power-of-two tile), one
    and two rows, several groups (W_UV's heads, a strided view),
    the bias; the weight loaded before or after the PDL wait."""
    g = torch.Generator().manual_seed(T * N + G)
    x = torch.randn(T, G, K, generator=g).to(dtype)
    w = (torch.randn(G, N + 5, K, generator=g) / K ** 0.5).to(dtype)[:, 5:]      # strided
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    ref = torch.einsum("tgk,gnk->tgn", x.float(), w.float())
    if bias:
        ref = ref + b.float()
    y = torch.empty(T, G, N, dtype=dtype, device=DEV)
    with mock.patch.object(sg, "GEMV_EARLY", early):
        grid, args, meta = sg.gemv_launch(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV),
                                          y, dict(BLOCK_N=8))
        sg._run((grid, args, meta), sg._gemv_kernel)
    assert grid == (-(-N // 8), G, 1) and meta["ROWS"] == sg.pow2(T) and meta["EARLY"] == early
    _close(y, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,G,N,K,max_k,bias", [(1, 1, 40, 200, 64, False),
                                                (2, 2, 24, 300, 128, True),
                                                (2, 1, 33, 129, 64, True)])
def test_gemv_splits_k_past_one_tile(T, G, N, K, max_k, bias, dtype):
    """K past GEMV_MAX_K: equal K ranges a program each (the last one short, one of a single
    element), fp32 partials summed in split order by the last program to arrive, the bias
    added once; twice, so the arrival counters are reset."""
    g = torch.Generator().manual_seed(K + T)
    x = torch.randn(T, G, K, generator=g).to(dtype)
    w = (torch.randn(G, N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    ref = torch.einsum("tgk,gnk->tgn", x.float(), w.float()) + (b.float() if bias else 0)
    with mock.patch.object(sg, "GEMV_MAX_K", max_k):
        assert sg.gemv_fits(x, w)
        for _ in range(2):
            y = torch.full((T, G, N), float("nan"), dtype=dtype, device=DEV)
            grid, args, meta = sg.gemv_launch(x.to(DEV), w.to(DEV),
                                              None if b is None else b.to(DEV), y, dict(BLOCK_N=8))
            sg._run((grid, args, meta), sg._gemv_kernel)
            split = -(-K // max_k)
            assert grid == (-(-N // 8), G, split) and meta["SPLIT_K"] == split > 1
            _close(y, ref, dtype)
        with mock.patch.object(sg, "GEMV_SPLIT", False):
            assert not sg.gemv_fits(x, w)


def test_gemv_takes_decode_rows_of_linear_and_absorb_v():
    """linear / absorb_v at <= GEMV_MAX_ROWS rows of a weight with K <= GEMV_MAX_K run the
    GEMV and match the torch formula; more rows, a longer K, explicit skinny tiles or GEMV
    off: the skinny kernel."""
    g = torch.Generator().manual_seed(3)
    dtype = torch.float16
    x = torch.randn(2, 64, generator=g).to(dtype)
    w = (torch.randn(48, 64, generator=g) / 8).to(dtype)
    kernels = []
    real = sg._run
    with mock.patch.object(sg, "_run", lambda launch, kernel=None: (
            kernels.append((kernel or sg._skinny_kernel).fn.__name__), real(launch, kernel))):
        _close(sg.linear_triton(x.to(DEV), w.to(DEV)), torch.nn.functional.linear(
            x.float(), w.float()), dtype)
        o = torch.randn(1, 3, 32, generator=g).to(dtype)
        wv = (torch.randn(3, 16, 32, generator=g) / 6).to(dtype)
        _close(sg.absorb_v_triton(o.to(DEV), wv.to(DEV)), sg.absorb_v_torch(o.float(),
                                                                             wv.float()), dtype)
        five = torch.randn(sg.GEMV_MAX_ROWS + 1, 64, generator=g).to(dtype)
        _close(sg.linear_triton(five.to(DEV), w.to(DEV)), torch.nn.functional.linear(
            five.float(), w.float()), dtype)
        sg.linear_triton(x.to(DEV), w.to(DEV), None, dict(SPLIT_K=2))
        with mock.patch.object(sg, "GEMV", False):
            sg.linear_triton(x.to(DEV), w.to(DEV))
    assert kernels == ["_gemv_kernel", "_gemv_kernel"] + ["_skinny_kernel"] * 3
    m = dict(device="meta")
    big = sg.GEMV_SPLIT_MAX_ELEMENTS // 8192          # rows of K = 8192: past one tile
    assert sg.gemv_fits(torch.empty(1, 1, 8192, **m), torch.empty(1, big, 8192, **m))
    assert not sg.gemv_fits(torch.empty(1, 1, 8192, **m), torch.empty(1, big + 1, 8192, **m))
    assert sg.gemv_fits(torch.empty(1, 1, 4096, **m), torch.empty(1, 4 * big, 4096, **m))
    assert not sg.gemv_fits(torch.empty(1, 1, 16), torch.empty(1, 16, 8).transpose(1, 2))


def test_gemv_rule_from_shapes():
    """DeepSeek-V2-Lite, 132 SMs: 8K-element tiles at one row (4K at two), rows halved to a
    program per SM."""
    def rule(N, K, G=1, T=1):
        c = sg.gemv_config(T, N, K, G, 132)
        return c["BLOCK_N"], c["BLOCK_K"]
    assert rule(3648, 2048) == (4, 2048)        # the x projection: 912 programs
    assert rule(3648, 2048, T=2) == (2, 2048)
    assert rule(2048, 2048) == (4, 2048)        # o_proj: 512
    assert rule(128, 512, 16) == (8, 512)       # W_UV: 16 blocks x 16 heads
    assert rule(10, 4096) == (1, 4096)          # never below one row
    assert rule(2048, 10944) == (2, 4096)       # the dense down: 3 K ranges of 3648
    assert sg.gemv_config(1, 2048, 10944, 1, 132)["SPLIT_K"] == 3
    assert rule(4096, 14336) == (2, 4096)       # 4 ranges of 3584 (gemv_fits: not taken)
    with pytest.raises(ValueError, match="unknown GEMV tunables"):
        sg.gemv_config(1, 8, 8, 1, 132, {"SPLIT_K": 2})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,N,K,bias", [(1, 40, 96, False), (2, 72, 256, True),
                                        (2, 33, 200, False)])
def test_add_norm_linear_is_the_norm_then_the_linear(T, N, K, bias, dtype):
    """The input add + RMS norm in the GEMV's launch: h = residual + a as fused_ops'
    add_rms_norm gives it (bitwise: program 0 stores it), y as the linear of the normed rows
    (the normed rows differ from the norm kernel's by at most an ulp: the squares are summed
    in another order); several feature blocks, each forming the rows itself."""
    from helix.layers.fused_ops import add_rms_norm_torch
    g = torch.Generator().manual_seed(T * K)
    a = (torch.randn(T, K + 8, generator=g) * 2).to(dtype)[:, 3:3 + K]        # strided rows
    res = (torch.randn(T, K, generator=g) * 3).to(dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    x_ref, h_ref = add_rms_norm_torch(a, res, nw, 1e-6)
    ref = torch.nn.functional.linear(x_ref.float(), w.float(), None if b is None else b.float())
    with gpu_rounding():
        y, h = sg.add_norm_linear_triton(a.to(DEV), res.to(DEV), nw.to(DEV), 1e-6, w.to(DEV),
                                         None if b is None else b.to(DEV), dict(BLOCK_N=8))
    assert y.shape == (T, N) and h.shape == (T, K) and y.dtype == h.dtype == dtype
    assert torch.equal(h.cpu(), h_ref)
    _close(y, ref, dtype)


def test_add_norm_linear_dispatch():
    """Off CUDA (and past GEMV_MAX_ROWS rows, with a strided residual, NORM_IN_GEMV off, or
    fewer than NORM_MIN_ROWS weight rows a program: Llama-8B's qkv) add_norm_linear is
    add_rms_norm, then linear: the same tensors as the two calls."""
    from helix.layers.fused_ops import add_rms_norm
    g = torch.Generator().manual_seed(1)
    a, res = torch.randn(2, 32, generator=g).bfloat16(), torch.randn(2, 32, generator=g).bfloat16()
    nw, w = torch.rand(32, generator=g).bfloat16(), torch.randn(8, 32, generator=g).bfloat16()
    y, h = sg.add_norm_linear(a, res, nw, 1e-5, w)
    x_ref, h_ref = add_rms_norm(a, res, nw, 1e-5)
    assert torch.equal(h, h_ref) and torch.equal(y, sg.linear(x_ref, w))
    with mock.patch.object(sg, "use_triton", lambda t: True), \
            mock.patch.object(sg, "linear_triton", lambda x, w, b=None: ("plain", x)), \
            mock.patch.object(sg, "add_norm_linear_triton", lambda *args, **kw: ("fused", None)):
        assert sg.add_norm_linear(a, res, nw, 1e-5, w)[0] == "fused"
        res_t = res.t().contiguous().t()                          # no unit feature stride
        assert sg.add_norm_linear(a, res_t, nw, 1e-5, w)[0][0] != "fused"
        big = torch.randn(sg.GEMV_MAX_ROWS + 1, 32).bfloat16()
        assert sg.add_norm_linear(big, big, nw, 1e-5, w)[0][0] == "plain"
        with mock.patch.object(sg, "NORM_IN_GEMV", False):
            assert sg.add_norm_linear(a, res, nw, 1e-5, w)[0][0] == "plain"
        with mock.patch.object(sg, "NORM_MIN_ROWS", 10 ** 6):      # tiles of too few rows
            assert sg.add_norm_linear(a, res, nw, 1e-5, w)[0][0] == "plain"
    # the shape rule on the H200 (132 SMs): DeepSeek-V2-Lite's x projection (4 rows of 2048 a
    # program) fuses its norm, Llama-3.1-8B's qkv (2 rows of 4096) does not; nor 3 rows, nor
    # K past one tile
    assert sg.gemv_config(1, 3648, 2048, 1, 132)["BLOCK_N"] == 4
    assert sg.gemv_config(1, 6144, 4096, 1, 132)["BLOCK_N"] == 2
    assert sg.norm_in_gemv(1, 3648, 2048, 132) and sg.norm_in_gemv(2, 3648, 1024, 132)
    assert not sg.norm_in_gemv(1, 6144, 4096, 132)
    assert not sg.norm_in_gemv(sg.GEMV_MAX_ROWS + 1, 3648, 2048, 132)
    assert not sg.norm_in_gemv(1, 3648, 2 * sg.GEMV_MAX_K, 132)


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


def test_linear_sends_large_weights_past_the_gemv_rows_to_cublas():
    """Past GEMV_MAX_ROWS rows the skinny kernel takes only weights of at most
    SKINNY_MAX_WEIGHT_ELEMENTS (Llama-3.1-8B's projections lost to cuBLAS at 4-8 rows); at the
    GEMV's rows every weight up to MAX_WEIGHT_ELEMENTS still takes the kernel."""
    calls = []
    with mock.patch.object(sg, "use_triton", lambda t: True), \
            mock.patch.object(sg, "linear_triton",
                              lambda x, w, b=None: calls.append(tuple(x.shape)) or "kernel"), \
            mock.patch.object(sg, "SKINNY_MAX_WEIGHT_ELEMENTS", 64 * 32):
        small, large = torch.zeros(64, 32).bfloat16(), torch.zeros(65, 32).bfloat16()
        rows = sg.GEMV_MAX_ROWS + 1
        assert sg.linear(torch.zeros(rows, 32).bfloat16(), small) == "kernel"
        got = sg.linear(torch.zeros(rows, 32).bfloat16(), large)
        assert isinstance(got, torch.Tensor) and got.shape == (rows, 65)       # F.linear
        assert sg.linear(torch.zeros(sg.GEMV_MAX_ROWS, 32).bfloat16(), large) == "kernel"
    assert calls == [(rows, 32), (sg.GEMV_MAX_ROWS, 32)]
    # the shipped bound: DeepSeek-V2-Lite's x projection (3648 x 2048) stays on the kernel,
    # Llama-3.1-8B's q (4096 x 4096) goes to cuBLAS
    assert 3648 * 2048 <= sg.SKINNY_MAX_WEIGHT_ELEMENTS < 4096 * 4096


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
        out = sg.linear_triton(torch.empty(5, 2048, dtype=bf, **m),
                               torch.empty(3072, 2048, dtype=bf, **m))
        assert out.shape == (5, 3072)
        out = sg.absorb_v_triton(torch.empty(8, 16, 512, dtype=bf, **m),
                                 torch.empty(16, 128, 512, dtype=bf, **m))
        assert out.shape == (8, 2048)
        out = sg.linear_triton(torch.empty(2, 2048, dtype=bf, **m),      # the GEMV
                               torch.empty(3072, 2048, dtype=bf, **m))
        out = sg.absorb_v_triton(torch.empty(1, 16, 512, dtype=bf, **m),
                                 torch.empty(16, 128, 512, dtype=bf, **m))
        assert out.shape == (1, 2048)
    assert grids == [(96, 4, 1), (4, 4, 16), (1536, 1, 1), (16, 16, 1)]



_COMPILE_SCRIPT = """
import json, re
from unittest import mock
import torch
import triton
from triton.backends.compiler import GPUTarget
from helix.layers import skinny_gemm as sg
from profiling.kernel_resources import _signature, compile_sm90
m = dict(device="meta")
e = lambda *s: torch.empty(*s, dtype=torch.bfloat16, **m)
launches = []
with mock.patch.object(sg, "run_kernel", lambda k, g, *a, **kw: launches.append((k, a, kw))), \\
        mock.patch("helix.attention.triton_splits.sm_count_of", lambda d: 132):
    for T in (1, 2):
        sg.linear_triton(e(T, 2048), e(3648, 2048))                 # the x projection
    sg.absorb_v_triton(e(1, 16, 512), e(16, 128, 512))              # W_UV
    with mock.patch.object(sg, "GEMV_EARLY", False):
        sg.linear_triton(e(1, 2048), e(2048, 2048))
    sg.add_norm_linear_triton(e(1, 2048), e(1, 2048), e(2048), 1e-6, e(3648, 2048))
    sg.linear_triton(e(1, 10944), e(2048, 10944))                   # the dense down: split K
out = []
for k, a, kw in launches:
    rec = compile_sm90(k, a, dict(kw, PDL=1))
    sig, consts, attrs, options = _signature(k, a, dict(kw, PDL=1))
    src = triton.compiler.ASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options(options)
    ptx = triton.compile(src, target=target, options=opts.__dict__).asm["ptx"]
    rec["order"] = [x for i, x in enumerate(re.findall(r"ld\\.global|griddepcontrol\\.wait", ptx))]
    out.append(rec)
print(json.dumps(out))
"""


@pytest.mark.sm90
def test_gemv_compiles_for_sm90_and_loads_its_weights_before_the_wait(tmp_path):
    """DeepSeek-V2-Lite's decode GEMVs (the x projection at 1 and 2 rows, W_UV, the x
    projection with the input norm, the dense down split in K) compile for sm_90 without
    spills; with GEMV_EARLY the weight loads come before griddepcontrol.wait, without it every
    load comes after."""
    import json
    res = sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT], timeout=600)
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in recs] == ["_gemv_kernel"] * 6
    assert recs[5]["constexprs"]["SPLIT_K"] == 3
    assert all(r["local_loads"] == 0 and r["stack_bytes"] == 0 for r in recs), recs
    assert recs[4]["constexprs"]["ADD_NORM"]
    for r in recs[:3] + recs[4:]:
        wait = r["order"].index("griddepcontrol.wait")
        assert wait > 0 and r["order"].count("griddepcontrol.wait") == 1, r["order"]
    assert recs[3]["order"][0] == "griddepcontrol.wait", recs[3]["order"]


# the interpreter takes ~25 s a decode of tiny-deepseek-v3 (its MLA, a dense layer, a MoE
# layer); tiny-llama's GQA layers on the GPU only
@pytest.mark.parametrize("model", ["tiny-deepseek-v3"] + (["tiny-llama"] if ON_GPU else []))
def test_decode_with_the_input_norms_in_the_projections(model):
    """Whole decodes (the interpreter off CUDA): the norms before the attention's input
    projection (MLA q_a + kv_a, GQA qkv) and before a dense MLP's gate/up inside those GEMVs'
    launches, against the decode without them (the norm kernel or formula, then the GEMM): the
    same greedy tokens, logits to the dtype's rounding."""
    from helix import LLM, Layout, RuntimeConfig, SamplingParams
    dtype = "bfloat16" if ON_GPU else "float16"
    calls = []
    real = sg.add_norm_linear_triton

    def decode():
        rt = RuntimeConfig(device=DEV, dtype=dtype, page_size=16, max_batch=1, max_context=32)
        with LLM(model, Layout(), rt) as llm:
            rid = llm.add_request([5, 17, 42], SamplingParams(max_new_tokens=3, ignore_eos=True))
            logits = []
            while llm.has_unfinished():
                llm.step()
                logits.append(llm.engine.last_logits.clone())
            return llm.outputs[rid], logits

    # NORM_MIN_ROWS 1: the tiny models' GEMVs hold fewer rows a program on a 132-SM GPU than
    # on the interpreter's 2 "SMs"; every input norm that can go into its GEMV does, on both
    with mock.patch.object(sg, "add_norm_linear_triton",
                           lambda *a, **k: calls.append(a[4].shape) or real(*a, **k)), \
            mock.patch.object(sg, "NORM_MIN_ROWS", 1):
        with mock.patch.object(sg, "use_triton", lambda t: True):
            fused_tokens, fused_logits = decode()
        fused_calls = len(calls)
        with mock.patch.object(sg, "ENABLED", False):
            tokens, logits = decode()
    assert fused_calls and len(calls) == fused_calls           # the second decode: none
    assert len(set(calls)) >= 2      # the attention's input projection and a dense gate/up
    assert fused_tokens == tokens
    for a, b in zip(fused_logits, logits):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
