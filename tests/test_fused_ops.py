"""helix.layers.fused_ops (rms_norm, add_rms_norm, rope, silu_mul) against their torch fallbacks
and the layers' original formulas; strided / odd shapes; the module wiring (RMSNorm,
RotaryEmbedding, DecoderLayer's fused residual adds); launch grids from shapes only (meta
tensors); the launches compile for sm_90 (no GPU needed).

Without CUDA the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported). The interpreter rounds fp32 -> bf16 casts toward zero, where the GPU rounds
to nearest even (cvt.rn.bf16.f32): the `gpu_rounding` fixture makes the interpreter round like
the GPU, so bf16 results are checked for the bitwise / one-ulp agreement the GPU gives. With a
GPU (TRITON_INTERPRET unset) the same tests run the compiled kernels against torch on CUDA."""

import os

import torch

from triton_mode import DEV, gpu_rounding  # first: chooses the interpreter before triton loads

import sm90_compile  # noqa: E402

import json  # noqa: E402
import textwrap  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


from helix.config import RopeConfig  # noqa: E402
from helix.layers import fused_ops as fo  # noqa: E402
from helix.layers.norm import RMSNorm  # noqa: E402
from helix.layers.rope import RotaryEmbedding  # noqa: E402
from helix.models.base import DecoderLayer  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS = 1e-6


@pytest.fixture(autouse=True)
def _gpu_rounding():
    with gpu_rounding():
        yield


# -- helpers ---------------------------------------------------------------------------------------

def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype tensors."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    ibits, mask = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.bfloat16: (torch.int16, 0x7FFF)}[a.dtype]

    def ordered(t):
        i = t.detach().cpu().contiguous().view(ibits).long()
        return torch.where(i < 0, -(i & mask), i)
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def close(got, want, max_ulps):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype,
                                                                 got.shape, want.shape)
    u = ulps(got, want)
    assert u <= max_ulps, (u, (got.float() - want.float()).abs().max().item())


# the layers' formulas before fused_ops (copied verbatim)
def original_rms_norm(x, weight, eps):
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def original_rope(x, cos_t, sin_t, pos, interleave):
    cos = cos_t[pos].unsqueeze(1)
    sin = sin_t[pos].unsqueeze(1)
    xf = x.float()
    if interleave:
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:
        a, b = xf.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


# the reduction order differs from torch's: fp32 within a few ulps, half types within one
NORM_ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}


# -- rms_norm / add_rms_norm -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 64), (5, 37), (3, 1000), (2, 4096), (33, 8)])
def test_rms_norm(dtype, T, D):
    x = _rand(T, D, dtype=dtype, seed=T * D, scale=3.0)
    w = (1 + _rand(D, seed=1, scale=0.2)).to(dtype)
    got = fo.rms_norm_triton(x, w, EPS)
    close(got, fo.rms_norm_torch(x, w, EPS), NORM_ULPS[dtype])
    close(got, original_rms_norm(x, w, EPS), NORM_ULPS[dtype])
    if dtype != torch.float32:   # nearly all elements bitwise equal
        assert (got == original_rms_norm(x, w, EPS)).float().mean() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_chunked_rows(dtype):
    """Rows wider than the tile (here forced small) take the two-pass chunked path."""
    x = _rand(4, 300, dtype=dtype, seed=3, scale=2.0)
    w = (1 + _rand(300, seed=4, scale=0.2)).to(dtype)
    for block in (64, 128, 256):
        assert fo.norm_launch_config(4, 300, block)["CHUNKS"] > 1
        close(fo.rms_norm_triton(x, w, EPS, max_block_d=block), original_rms_norm(x, w, EPS),
              NORM_ULPS[dtype])
    r = _rand(4, 300, dtype=dtype, seed=5)
    y, h = fo.add_rms_norm_triton(x, r, w, EPS, max_block_d=64)
    assert torch.equal(h, r + x)
    close(y, original_rms_norm(r + x, w, EPS), NORM_ULPS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_inputs(dtype):
    """Head views of a projection output (Qwen3 q/k norm), column slices (MLA's latent), a
    non-unit feature stride, 1-D and 4-D inputs: no copy needed, same result."""
    d = 24
    proj = _rand(5, 11 * d + 7, dtype=dtype, seed=6, scale=2.0)
    w = (1 + _rand(d, seed=7, scale=0.2)).to(dtype)
    views = [proj[:, 7:7 + 4 * d].view(5, 4, d),               # [T, h, d], row stride 11d + 7
             proj[:, 3:3 + d],                                  # [T, d] slice
             proj[:, 1:1 + 2 * d:2],                            # feature stride 2
             proj[2, :d],                                       # 1-D
             proj[:, :8 * d].reshape(5, 2, 4, d),               # 4-D
             proj[:, :4 * d].view(5, 4, d).transpose(0, 1)]     # [h, T, d]
    for v in views:
        got = fo.rms_norm_triton(v, w, EPS)
        assert got.shape == v.shape and got.is_contiguous()
        close(got, original_rms_norm(v, w, EPS), NORM_ULPS[dtype])


def test_rms_norm_mixed_weight_dtype():
    """fp32 weight on bf16 activations: torch promotes the product to fp32; so does the kernel."""
    x = _rand(3, 40, dtype=torch.bfloat16, seed=8)
    w = 1 + _rand(40, seed=9, scale=0.2)
    got = fo.rms_norm_triton(x, w, EPS)
    want = original_rms_norm(x, w, EPS)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    # the bf16-rounded normalised value agrees within one bf16 ulp before the fp32 multiply
    close((got / w).to(torch.bfloat16), (want / w).to(torch.bfloat16), 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 64), (7, 129), (2, 4096)])
def test_add_rms_norm(dtype, T, D):
    x = _rand(T, D, dtype=dtype, seed=10 + D, scale=2.0)
    r = _rand(T, D, dtype=dtype, seed=11 + D, scale=4.0)
    w = (1 + _rand(D, seed=12, scale=0.2)).to(dtype)
    y, h = fo.add_rms_norm_triton(x, r, w, EPS)
    y_t, h_t = fo.add_rms_norm_torch(x, r, w, EPS)
    assert torch.equal(h, h_t) and torch.equal(h, r + x)       # the new residual: bitwise
    close(y, y_t, NORM_ULPS[dtype])
    close(y, original_rms_norm(r + x, w, EPS), NORM_ULPS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_strided(dtype):
    """x a column slice, residual a transposed copy: strides differ between the two."""
    x = _rand(6, 90, dtype=dtype, seed=13)[:, 5:69]
    r = _rand(64, 6, dtype=dtype, seed=14).t()
    w = (1 + _rand(64, seed=15, scale=0.2)).to(dtype)
    y, h = fo.add_rms_norm_triton(x, r, w, EPS)
    assert torch.equal(h, r + x) and h.is_contiguous() and y.is_contiguous()
    close(y, original_rms_norm(r + x, w, EPS), NORM_ULPS[dtype])


# -- rope ----------------------------------------------------------------------------------------

def _tables(P, half, seed=20):
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    freqs = torch.arange(P, dtype=torch.float32)[:, None] * inv[None, :]
    scale = 1 + 0.1 * torch.rand(1, generator=g).item()          # a YaRN-like attention factor
    return (freqs.cos() * scale).to(DEV), (freqs.sin() * scale).to(DEV)


def _rope_f64(x, cos_t, sin_t, pos, interleave):
    """Independent reference: complex rotation in fp64, written out in the kernel's layout."""
    xd = x.double()
    if interleave:
        z = torch.complex(xd[..., 0::2], xd[..., 1::2])
    else:
        a, b = xd.chunk(2, dim=-1)
        z = torch.complex(a, b)
    rot = torch.complex(cos_t[pos].double(), sin_t[pos].double()).unsqueeze(1)
    z = z * rot
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("T,H,dim", [(1, 32, 128), (5, 3, 64), (4, 7, 6), (3, 1, 64)])
def test_rope(dtype, interleave, T, H, dim):
    cos, sin = _tables(257, dim // 2)
    x = _rand(T, H, dim, dtype=dtype, seed=T * H + dim, scale=2.0)
    pos = torch.tensor([250, 3, 17, 0, 3][:T] if T <= 5 else list(range(T)), device=DEV)
    got = fo.rope_triton(x, cos, sin, pos, interleave)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    # fp32 math with the same roundings (no FMA contraction): bitwise the torch formula's
    assert torch.equal(got, fo.rope_torch(x, cos, sin, pos, interleave))
    assert torch.equal(got, original_rope(x, cos, sin, pos, interleave))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), _rope_f64(x, cos, sin, pos, interleave),
                               rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
def test_rope_strided_views(dtype, interleave):
    """q / k head views of a fused qkv output, MLA's rope part of q (a split of the last dim),
    MLA's k_rope.unsqueeze(1), an int32 pos, positions out of order and repeated."""
    T, hq, hk, d = 5, 4, 2, 16
    cos, sin = _tables(64, 8)
    pos = torch.tensor([9, 2, 63, 2, 0], device=DEV)
    qkv = _rand(T, (hq + 2 * hk) * d, dtype=dtype, seed=30)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    mla_q = _rand(T, hq, 24 + d, dtype=dtype, seed=31).split([24, d], dim=-1)[1]
    ckv = _rand(T, 40 + d, dtype=dtype, seed=32)
    k_rope = ckv.split([40, d], dim=-1)[1].unsqueeze(1)
    for v in (q.view(T, hq, d), k.view(T, hk, d), mla_q, k_rope):
        assert not v.is_contiguous()
        for p in (pos, pos.int()):
            got = fo.rope_triton(v, cos, sin, p, interleave)
            assert torch.equal(got, original_rope(v, cos, sin, pos, interleave))


def test_rope_module_tables():
    """RotaryEmbedding (llama3 and YaRN tables) through the kernel equals the original formula."""
    for cfg in (RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0),
                RopeConfig(rope_type="yarn", factor=40.0, original_max_position=64, mscale=1.0,
                           mscale_all_dim=1.0, adjacent_pairs=True)):
        rope = RotaryEmbedding(cfg, 64, 4096).to(DEV)
        x = _rand(3, 5, 64, dtype=torch.bfloat16, seed=33)
        pos = torch.tensor([4095, 0, 1234], device=DEV)
        want = original_rope(x, rope.cos, rope.sin, pos, cfg.adjacent_pairs)
        assert torch.equal(fo.rope_triton(x, rope.cos, rope.sin, pos, cfg.adjacent_pairs), want)
        with mock.patch.object(fo, "use_triton", lambda t: True):
            assert torch.equal(rope(x, pos), want)


# -- silu_mul ------------------------------------------------------------------------------------

# fp32: exp to a few ulp (fused_ops._exp_f32; GPU: exp2 is ex2.approx) then a correctly rounded
# division, vs torch's expf; half types: one rounding of that
SILU_ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1024), (3, 37), (6, 1500)])
def test_silu_mul(dtype, T, I):
    gu = _rand(T, 2 * I, dtype=dtype, seed=T + I, scale=4.0)
    got = fo.silu_mul_triton(gu)
    assert got.shape == (T, I) and got.dtype == dtype
    want = F.silu(gu[:, :I]) * gu[:, I:]
    close(got, want, SILU_ULPS[dtype])
    close(got, fo.silu_mul_torch(gu), SILU_ULPS[dtype])
    if dtype != torch.float32:
        assert (got == want).float().mean() > 0.99


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_exp_range(dtype):
    """The whole exp range: exp(-g) overflowing (silu(-100) = -0), underflowing (silu(100) =
    100), subnormal silu values, signed zeros, and a dense sweep of [-100, 100]."""
    g = torch.tensor([-200.0, -110, -104, -103, -89, -88.7, -88, -87.3, -87, -50, -20, -1e-3,
                      0.0, -0.0, 1e-3, 20, 87, 88.8, 89, 100, 200])
    g = torch.cat([g, torch.linspace(-100, 100, 20001)]).to(dtype).to(DEV)
    gu = torch.cat([g, torch.ones_like(g)]).view(1, -1)
    got = fo.silu_mul_triton(gu)
    close(got, F.silu(g).view(1, -1), SILU_ULPS[dtype])
    assert torch.equal(torch.signbit(got[0, :21]), torch.signbit(F.silu(g[:21])))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_silu_mul_strided_and_extremes():
    """A row-strided view (slice of a wider GEMM output), 3-D input, large |gate| and zeros."""
    base = _rand(4, 2 * 40 + 9, dtype=torch.bfloat16, seed=40, scale=3.0)
    gu = base[:, 9:]
    gu[0, :40] = torch.tensor([-100.0, 100.0, 0.0, -0.0] * 10)
    assert not gu.is_contiguous()
    want = F.silu(gu[:, :40]) * gu[:, 40:]
    close(fo.silu_mul_triton(gu), want, 1)
    g3 = _rand(2, 3, 2 * 24, dtype=torch.float16, seed=41)
    got = fo.silu_mul_triton(g3)
    assert got.shape == (2, 3, 24)
    close(got, F.silu(g3[..., :24]) * g3[..., 24:], 1)


# -- dispatch and module wiring ------------------------------------------------------------------

def test_dispatch_uses_fallback_off_cuda():
    x = torch.randn(3, 16)
    assert not fo.use_triton(x)
    with mock.patch.object(fo, "run_kernel", side_effect=AssertionError("launched")):
        w = torch.rand(16)
        assert torch.equal(fo.rms_norm(x, w, EPS), original_rms_norm(x, w, EPS))
        y, h = fo.add_rms_norm(x, x * 2, w, EPS)
        assert torch.equal(h, x * 3) and torch.equal(y, original_rms_norm(x * 3, w, EPS))
        cos, sin = torch.rand(10, 4), torch.rand(10, 4)
        p = torch.tensor([3, 1, 3])
        assert torch.equal(fo.rope(x.view(3, 2, 8), cos, sin, p, True),
                           original_rope(x.view(3, 2, 8), cos, sin, p, True))
        assert torch.equal(fo.silu_mul(x), F.silu(x[:, :8]) * x[:, 8:])


def test_rms_norm_module_routes_to_kernel():
    """RMSNorm.forward / add_forward go through fused_ops (kernel when use_triton says so)."""
    norm = RMSNorm(48, EPS, torch.bfloat16).to(DEV)
    norm.weight.data = (1 + _rand(48, seed=50, scale=0.2)).to(torch.bfloat16)
    x = _rand(3, 48, dtype=torch.bfloat16, seed=51)
    r = _rand(3, 48, dtype=torch.bfloat16, seed=52)
    calls = []
    real = fo.run_kernel

    def spy(kernel, grid, *a, **kw):
        calls.append(kernel)
        return real(kernel, grid, *a, **kw)

    with mock.patch.object(fo, "use_triton", lambda t: True), \
            mock.patch.object(fo, "run_kernel", spy):
        y = norm(x)
        y2, h = norm.add_forward(x, r)
    assert calls == [fo._rms_norm_kernel] * 2
    close(y, original_rms_norm(x, norm.weight, EPS), 1)
    assert torch.equal(h, r + x)
    close(y2, original_rms_norm(r + x, norm.weight, EPS), 1)


class _Attn(nn.Module):
    def __init__(self, D, dtype, seed):
        super().__init__()
        self.w = nn.Parameter(_rand(D, D, dtype=dtype, seed=seed, scale=D ** -0.5),
                              requires_grad=False)

    def forward(self, x, pos, meta, cache, backend, ctx=None):
        return x @ self.w

    def add_norm_forward(self, h, residual, norm, *args):
        x, residual = norm.add_forward(h, residual)        # the consumer's contract
        return self(x, *args), residual


class _MLP(_Attn):
    def forward(self, x, ctx=None):
        return torch.tanh(x @ self.w) * 3


@pytest.mark.parametrize("kernels", [False, True])
def test_decoder_layers_fused_residual(kernels):
    """The stack of DecoderLayers with the residual adds deferred to the next norm gives the
    original h = h + attn(norm(h)); h = h + mlp(norm(h)) recurrence: bitwise on the torch path,
    within bf16 rounding through the kernels. Parameter names are unchanged."""
    D, T, L, dtype = 40, 3, 3, torch.bfloat16
    cfg = SimpleNamespace(hidden_size=D, rms_eps=EPS)
    layers = [DecoderLayer(cfg, _Attn(D, dtype, 60 + i), _MLP(D, dtype, 70 + i), dtype).to(DEV)
              for i in range(L)]
    for i, layer in enumerate(layers):
        layer.input_layernorm.weight.data = (1 + _rand(D, seed=80 + i, scale=0.2)).to(dtype)
        w = (1 + _rand(D, seed=90 + i, scale=0.2)).to(dtype)
        layer.post_attention_layernorm.weight.data = w
    assert sorted(n for n, _ in layers[0].named_parameters()) == [
        "input_layernorm.weight", "mlp.w", "post_attention_layernorm.weight", "self_attn.w"]
    h0 = _rand(T, D, dtype=dtype, seed=99, scale=2.0)

    want = h0
    for layer in layers:                     # the original DecoderLayer.forward
        want = want + layer.self_attn(original_rms_norm(want, layer.input_layernorm.weight, EPS),
                                      None, None, None, None)
        want = want + layer.mlp(original_rms_norm(want, layer.post_attention_layernorm.weight,
                                                  EPS))
    with mock.patch.object(fo, "use_triton", lambda t: kernels):
        h, residual = h0, None
        for layer in layers:
            h, residual = layer(h, None, None, None, None, None, residual)
        final = RMSNorm(D, EPS, dtype).to(DEV)
        normed, full = final.add_forward(h, residual)
    if kernels:   # one-ulp differences of a norm propagate through the layers' matmuls
        torch.testing.assert_close(full, want, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(normed, original_rms_norm(want, final.weight, EPS),
                                   rtol=3e-2, atol=3e-2)
    else:
        assert torch.equal(full, want)
        assert torch.equal(normed, original_rms_norm(want, final.weight, EPS))


# -- graph safety: grids from shapes only (meta tensors carry no data) ---------------------------

def test_launchers_on_meta_tensors():
    m = dict(device="meta")
    bf = torch.bfloat16
    grids = []
    with mock.patch.object(fo, "run_kernel", lambda k, grid, *a, **kw: grids.append((k, grid))):
        y = fo.rms_norm_triton(torch.empty(4, 4096, dtype=bf, **m),
                               torch.empty(4096, dtype=bf, **m), EPS)
        y2, h = fo.add_rms_norm_triton(torch.empty(4, 7168, dtype=bf, **m),
                                       torch.empty(4, 7168, dtype=bf, **m),
                                       torch.empty(7168, dtype=bf, **m), EPS)
        qk = fo.rms_norm_triton(torch.empty(4, 32, 128, dtype=bf, **m),
                                torch.empty(128, dtype=bf, **m), EPS)
        q = fo.rope_triton(torch.empty(4, 32, 128, dtype=bf, **m),
                           torch.empty(8192, 64, **m), torch.empty(8192, 64, **m),
                           torch.empty(4, dtype=torch.int64, **m), False)
        a = fo.silu_mul_triton(torch.empty(4, 2 * 14336, dtype=bf, **m))
    assert y.shape == (4, 4096) and y2.shape == h.shape == (4, 7168) and qk.shape == (4, 32, 128)
    assert q.shape == (4, 32, 128) and a.shape == (4, 14336) and a.dtype == bf
    assert grids == [(fo._rms_norm_kernel, (4,)), (fo._rms_norm_kernel, (4,)),
                     (fo._rms_norm_kernel, (4,)),        # 32 rows of 128 per program
                     (fo._rope_kernel, (4, 2)),          # 16 heads x 64 pairs per program
                     (fo._silu_mul_kernel, (4, 14))]


# -- the launches compile for Hopper ---------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    from unittest import mock
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from helix.layers import fused_ops as fo
    from profiling.kernel_resources import _signature
    m = dict(device="meta")
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, **m)
    launches = []
    with mock.patch.object(fo, "run_kernel", lambda k, g, *a, **kw: launches.append((k, a, kw))):
        for dt in (torch.bfloat16, torch.float32):
            fo.rms_norm_triton(e(4, 4096, dt=dt), e(4096, dt=dt), 1e-6)
            fo.add_rms_norm_triton(e(4, 7168, dt=dt), e(4, 7168, dt=dt), e(7168, dt=dt), 1e-6)
            fo.add_rms_norm_triton(e(4, 16384, dt=dt), e(4, 16384, dt=dt), e(16384, dt=dt), 1e-6)
            fo.rms_norm_triton(e(4, 32, 128, dt=dt)[:, :8], e(128, dt=dt), 1e-6)
            fo.rope_triton(e(4, 48, 128, dt=dt)[:, :32], e(8192, 64, dt=torch.float32),
                           e(8192, 64, dt=torch.float32), e(4, dt=torch.int64), True)
            fo.silu_mul_triton(e(4, 2 * 14336, dt=dt))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    target = GPUTarget("cuda", 90, 32)
    out = []
    for k, a, kw in launches:
        sig, consts, attrs, options = _signature(k, a, kw)
        if "enable_fp_fusion" in kw:
            options["enable_fp_fusion"] = kw["enable_fp_fusion"]
        src = triton.compiler.ASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs)
        opts = triton.compiler.make_backend(target).parse_options(options)
        cc = triton.compile(src, target=target, options=opts.__dict__)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cc.asm["cubin"])
            f.flush()
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", f.name],
                                  capture_output=True, text=True, check=True).stdout
        out.append(dict(kernel=k.fn.__name__, fusion=opts.enable_fp_fusion,
                        local=sass.count("LDL") + sass.count("STL"), ffma=sass.count("FFMA"),
                        shared=cc.metadata.shared))
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.sm90
def test_kernels_compile_for_sm90(tmp_path):
    out = tmp_path / "records.json"
    sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT, str(out)])
    records = json.loads(out.read_text())
    assert len(records) == 12
    for r in records:
        assert r["local"] == 0, r                    # no register spills
        if r["kernel"] == "_rope_kernel":            # products and sums rounded separately
            assert r["fusion"] is False and r["ffma"] == 0, r


# -- select_tokens ---------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 5, 1300])
def test_select_tokens(T):
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(0, 1000, (64,), generator=g)
    src = torch.randint(-1, 64, (T,), generator=g)
    src[0] = -1
    ids = torch.randint(0, 1000, (T,), generator=g)
    want = torch.tensor([tokens[s].item() if s >= 0 else i
                         for s, i in zip(src.tolist(), ids.tolist())])
    assert torch.equal(fo.select_tokens_torch(src, ids, tokens), want)
    assert torch.equal(fo.select_tokens_triton(src.to(DEV), ids.to(DEV), tokens.to(DEV)).cpu(),
                       want)
