"""fp8 (e4m3) expert weights with 128 x 128 block scales (the DeepSeek-V3 checkpoint format) in
fused_moe's sorted v1 kernels and the decode kernels of helix.layers.moe_decode (`scales=`, both
inner-product modes) and fused_moe_torch, against a pair-by-pair fp32 reference over the
dequantized weights: partial scale blocks, K tiles of every width up to the 128-block, several
rows per expert, pairs of other ranks' experts, decode batches taking the decode kernels and
larger ones v1, never the one-row Gluon launch, fp8 shared experts folded into the decode
launches (`shared_scales`), the launch parameters, and the launches compile for sm_90 (no GPU
needed).

Without CUDA the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by
triton_mode before triton is imported). The interpreter's dot takes bf16 operands as their raw
16-bit integers and truncates fp32 -> bf16 casts, so bf16 activations run there under
`_bf16_interpreter`, which widens bf16 dot operands to fp32 (exact, as tensor cores multiply) and
rounds like the GPU (triton_mode.gpu_rounding); on a GPU both are no-ops."""

import contextlib
import json
import textwrap

import torch

from triton_mode import DEV, ON_GPU, gpu_rounding  # first: chooses the interpreter before triton

import sm90_compile  # noqa: E402

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helix.layers import fp8  # noqa: E402
from helix.layers import fused_moe as fm  # noqa: E402
from helix.layers import moe_decode as md  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
B = 128
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2}      # against the fp32 reference, x max|ref|

SHAPES = [  # E_local, I, D, first, n_global
    (4, 200, 136, 4, 12),     # partial last blocks along both axes of every stack
    (3, 256, 128, 0, 5),      # whole blocks; experts 3, 4 are another rank's
]


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, n, k] float -> (w8 [E, n, k] e4m3, s [E, cdiv(n, 128), cdiv(k, 128)] fp32), one
    scale per 128 x 128 block (the last ones partial): s = amax / 448, w8 = w / s saturated."""
    E, n, k = w.shape
    nb, kb = -(-n // B), -(-k // B)
    padded = torch.zeros(E, nb * B, kb * B)
    padded[:, :n, :k] = w.float()
    blocks = padded.view(E, nb, B, kb, B)
    s = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / FP8_MAX          # [E, nb, kb]
    q = (blocks / s[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(E, nb * B, kb * B)
    return q[:, :n, :k].to(FP8).contiguous(), s.float().contiguous()


def _dequantize(w8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The reference dequantization, by index: w8[e, i, j] * s[e, i // 128, j // 128] (fp32)."""
    _, n, k = w8.shape
    rows = torch.arange(n) // B
    cols = torch.arange(k) // B
    return w8.float().cpu() * s.float().cpu()[:, rows][:, :, cols]


def _problem(T, E, I, D, k, first, n_global, seed):
    """Random fp8 stacks (quantized from random weights) and routing; the ids mix this rank's
    experts [first, first + E) with other ranks'. Everything fp32 but the stacks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    gate, gs = _quantize(torch.randn(E, I, D, generator=g) / D ** 0.5)
    up, us = _quantize(torch.randn(E, I, D, generator=g) / D ** 0.5)
    down, ds = _quantize(torch.randn(E, D, I, generator=g) / I ** 0.5)
    ids = torch.stack([torch.randperm(n_global, generator=g)[:k] for _ in range(T)])    # [T, k]
    weights = torch.rand(T, k, generator=g)
    dev = lambda *ts: tuple(t.to(DEV) for t in ts)  # noqa: E731
    return (*dev(x, gate, up, down, weights, ids), dev(gs, us, ds))


def _reference(x, gate, up, down, weights, ids, first, scales):
    """Loop over pairs (t, j) in fp32 over the dequantized stacks."""
    T, k = ids.shape
    E = gate.shape[0]
    g, u, d = (_dequantize(w, s) for w, s in zip((gate, up, down), scales))
    x, weights = x.float().cpu(), weights.float().cpu()
    out = torch.zeros(T, x.shape[1])
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - first
            if 0 <= e < E:
                h = F.silu(g[e] @ x[t]) * (u[e] @ x[t])
                out[t] += weights[t, j] * (d[e] @ h)
    return out


@contextlib.contextmanager
def _bf16_interpreter():
    """In the interpreter: bf16 dot operands widened to fp32 (its own dot multiplies their
    bit patterns as integers) and fp32 -> bf16 casts rounded to nearest even; on a GPU nothing."""
    if ON_GPU:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter as it
    real = it.InterpreterBuilder.create_dot

    def dot(self, a, b, d, *args):
        a, b = (self.cast_impl(v, tl.float32) if v.dtype.scalar == tl.bfloat16 else v
                for v in (a, b))
        return real(self, a, b, d, *args)
    with mock.patch.object(it.InterpreterBuilder, "create_dot", dot), gpu_rounding():
        yield


def _check(out, ref, x, dtype):
    assert out.shape == x.shape and out.dtype == dtype
    out = out.float().cpu()
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        err = (out - ref).abs().max().item()
        assert err <= TOL[dtype] * (1 + ref.abs().max().item()), err


# -- the helpers ---------------------------------------------------------------------------------

def test_quantized_stacks_and_their_dequantization():
    """The test's quantizer is faithful (block-relative error of e4m3), and fp8.dequantize
    equals the by-index dequantization, cast to the dtype asked for."""
    w = torch.randn(3, 200, 136, generator=torch.Generator().manual_seed(0))
    w8, s = _quantize(w)
    assert w8.dtype == FP8 and s.shape == (3, 2, 2) and s.dtype == torch.float32
    ref = _dequantize(w8, s)
    assert (ref - w).abs().max() <= 0.07 * w.abs().max()        # e4m3: 3 mantissa bits
    torch.testing.assert_close(fp8.dequantize(w8, s, torch.float32), ref, rtol=0, atol=0)
    bf = fp8.dequantize(w8, s, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, ref.to(torch.bfloat16))
    with pytest.raises(ValueError):
        fm.fp8.dequantize(w8, s[:, :1], torch.float32)


# -- the kernels against the reference -----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-I{}-D{}".format(*s[:3]))
def test_fused_moe_fp8_matches_reference(shape, T, dtype):
    E, I, D, first, n_global = shape
    x, gate, up, down, weights, ids, scales = _problem(T, E, I, D, 2, first, n_global,
                                                       seed=T * 7 + E)
    ref = _reference(x, gate, up, down, weights, ids, first, scales)
    ctx = _bf16_interpreter() if dtype == torch.bfloat16 else contextlib.nullcontext()
    with ctx:
        out = fm.fused_moe(x.to(dtype), gate, up, down, weights.to(dtype), ids, first,
                           variant="v1", scales=scales)
    _check(out, ref, x, dtype)


@pytest.mark.parametrize("block_k", [16, 32, 128, 256])
def test_every_k_tile_width(block_k):
    """K tiles narrower than a scale block read its scale once per tile; 128 is one tile per
    block; a launch config asking for more is capped at 128 (a tile never straddles blocks)."""
    E, I, D, first, n_global = SHAPES[0]
    x, gate, up, down, weights, ids, scales = _problem(5, E, I, D, 2, first, n_global, seed=3)
    ref = _reference(x, gate, up, down, weights, ids, first, scales)
    real = fm.moe_launch_config
    seen = []

    def config(*a):
        cfg = real(*a)
        cfg["up"]["BLOCK_K"] = cfg["down"]["BLOCK_K"] = block_k
        return cfg

    def record(kernel, grid, *args, **meta):
        seen.append(meta["BLOCK_K"])
        return kernel[grid](*args, **meta)
    with mock.patch.object(fm, "moe_launch_config", config), \
            mock.patch.object(fm, "run_kernel", record):
        out = fm.fused_moe(x, gate, up, down, weights, ids, first, variant="v1", scales=scales)
    assert seen == [min(block_k, 128)] * 2
    _check(out, ref, x, torch.float32)


@pytest.mark.parametrize("variant", ["decode", "auto", None])
def test_decode_variants_take_the_decode_kernels_with_scales(variant):
    """Where the variant picks moe_decode (T * k <= MAX_PAIRS), scales go with it: the decode
    kernels run (the sorted v1 launches never), with these scales."""
    E, I, D, first, n_global = SHAPES[0]
    x, gate, up, down, weights, ids, scales = _problem(3, E, I, D, 2, first, n_global, seed=11)
    ref = _reference(x, gate, up, down, weights, ids, first, scales)
    calls, real = [], md.moe_decode

    def spy(*a, **kw):
        calls.append(kw["scales"])
        return real(*a, **kw)
    with mock.patch.object(fm, "VARIANT", "auto"), mock.patch.object(md, "moe_decode", spy), \
            mock.patch.object(fm, "run_kernel", side_effect=AssertionError("v1 ran")):
        assert fm.decode_kernels(3 * 2, variant)                 # the decode kernels' batch
        out = fm.fused_moe(x, gate, up, down, weights, ids, first, variant=variant,
                           scales=scales)
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], scales))
    _check(out, ref, x, torch.float32)


@pytest.mark.parametrize("variant", ["decode", "auto", None])
def test_fp8_batches_past_max_pairs_take_v1(variant):
    """Recorded launches (meta tensors): MAX_PAIRS pairs run the decode kernels, one pair more
    the sorted v1 kernels, whatever the variant; variant v1 takes v1 at decode batches too."""
    m = dict(device="meta")
    E, I, D, k = 8, 256, 512, 4
    gate, up = (torch.empty(E, I, D, dtype=FP8, **m) for _ in range(2))
    down = torch.empty(E, D, I, dtype=FP8, **m)
    scales = (torch.empty(E, 2, 4, **m), torch.empty(E, 2, 4, **m), torch.empty(E, 4, 2, **m))
    kernels = []
    record = lambda kern, grid, *a, **kw: kernels.append(kern)  # noqa: E731

    def run(T, var):
        kernels.clear()
        x = torch.empty(T, D, **m)
        ids = torch.empty(T, k, dtype=torch.int64, **m)
        out = fm.fused_moe(x, gate, up, down, torch.empty(T, k, **m), ids, 0, variant=var,
                           scales=scales)
        assert out.shape == (T, D)
        return list(kernels)
    v1, decode = [fm._gate_up_kernel, fm._down_kernel], [md._gate_up_kernel, md._down_kernel]
    with mock.patch.object(fm, "VARIANT", "auto"), mock.patch.object(fm, "run_kernel", record), \
            mock.patch.object(md, "run_kernel", record):
        assert run(md.MAX_PAIRS // k, variant) == decode
        assert run(md.MAX_PAIRS // k + 1, variant) == v1
        assert run(md.MAX_PAIRS // k, "v1") == v1


# -- the decode kernels (helix.layers.moe_decode) with scales --------------------------------------

WIDE = dict(up_BLOCK_N=64, down_BLOCK_N=64)       # few feature blocks: few interpreted programs
DECODE_MODES = [dict(mode="fma", **WIDE), dict(mode="dot", **WIDE)]   # K tiles of 128: the block
DECODE_BATCHES = [(1, 2), (6, 4), (md.MAX_PAIRS // 4, 4)]   # T, k: up to MAX_PAIRS pairs


def _decode_problem(shape, T, k, seed):
    """_problem, with one expert twice in token 0 (k > 1) and, from 2 tokens, an expert of
    several rows."""
    E, I, D, first, n_global = shape
    x, gate, up, down, weights, ids, scales = _problem(T, E, I, D, k, first, n_global, seed)
    if k > 1:
        ids[0, 1] = ids[0, 0]
    if T > 1:
        local = ids[(ids >= first) & (ids < first + E)] - first
        assert torch.bincount(local.cpu(), minlength=E).max() >= 2, ids     # several rows
    return x, gate, up, down, weights, ids, scales


def _ids(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if k not in WIDE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", DECODE_MODES, ids=_ids)
@pytest.mark.parametrize("T,k", DECODE_BATCHES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-I{}-D{}".format(*s[:3]))
def test_decode_kernels_fp8_match_reference(shape, T, k, config, dtype):
    """moe_decode with scales, FMA and tensor-core products: partial scale blocks (I 200,
    D 136), first > 0 and other ranks' experts, experts of several rows (up to MAX_PAIRS pairs),
    one expert twice in a token."""
    x, gate, up, down, weights, ids, scales = _decode_problem(shape, T, k, seed=T * 13 + k)
    first = shape[3]
    ref = _reference(x, gate, up, down, weights, ids, first, scales)
    ctx = _bf16_interpreter() if dtype == torch.bfloat16 else contextlib.nullcontext()
    with ctx:
        out = md.moe_decode(x.to(dtype), gate, up, down, weights.to(dtype), ids, first, config,
                            scales=scales)
    _check(out, ref, x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("config", [
    dict(mode="fma", BLOCK_M=2, K_SPLITS=2, up_BLOCK_K=32, down_BLOCK_K=64, **WIDE),
    dict(mode="dot", K_SPLITS=3, FUSED_COMBINE=False, up_BLOCK_K=64, down_BLOCK_K=32, **WIDE),
    dict(mode="dot", up_BLOCK_N=16, down_BLOCK_N=32, up_BLOCK_K=16, num_stages=1)], ids=_ids)
def test_decode_kernels_fp8_tiles(config, dtype):
    """Several K tiles per scale block, row blocks of 2 (FMA), K splits not on block edges
    (I 200 in 3: 0, 96, 192), the unfused k-sum, narrow feature blocks."""
    shape = SHAPES[0]
    x, gate, up, down, weights, ids, scales = _decode_problem(shape, 6, 4, seed=17)
    ref = _reference(x, gate, up, down, weights, ids, shape[3], scales)
    out = md.moe_decode(x.to(dtype), gate, up, down, weights.to(dtype), ids, shape[3], config,
                        scales=scales)
    _check(out, ref, x, dtype)


@pytest.mark.parametrize("mode", ["fma", "dot"])
@pytest.mark.parametrize("block_k", [16, 32, 128, 256])
def test_decode_kernels_every_k_tile_width(block_k, mode):
    """Asked K tiles narrower than a scale block read its scale once per tile; wider ones are
    capped at 128 (a tile never straddles blocks)."""
    E, I, D, first, n_global = SHAPES[0]
    x, gate, up, down, weights, ids, scales = _problem(5, E, I, D, 2, first, n_global, seed=3)
    ref = _reference(x, gate, up, down, weights, ids, first, scales)
    seen = []

    def record(kernel, grid, *args, **meta):
        seen.append(meta["BLOCK_K"])
        return kernel[grid](*args, **meta)
    config = dict(mode=mode, up_BLOCK_K=block_k, down_BLOCK_K=block_k, **WIDE)
    with mock.patch.object(md, "run_kernel", record):
        out = md.moe_decode(x, gate, up, down, weights, ids, first, config, scales=scales)
    assert seen == [min(block_k, 128)] * 2
    _check(out, ref, x, torch.float32)


def test_decode_config_for_fp8_weights():
    """One byte a weight element: K tiles of the 128-element scale block (the bytes of the
    16-bit tiles), the 16-bit rules otherwise; the 16-bit choices are unchanged."""
    shape = (1, 8, 32, 2048, 7168)                       # DeepSeek-V3 EP = 8: T, k, E, I, D
    c8 = md.moe_decode_config(*shape, FP8, 132)
    c16 = md.moe_decode_config(*shape, torch.bfloat16, 132)
    assert c16["up"]["BLOCK_K"] == c16["down"]["BLOCK_K"] == 64              # 128 bytes
    assert c8["up"]["BLOCK_K"] == c8["down"]["BLOCK_K"] == 128               # 128 bytes
    assert {k: v for k, v in c8.items() if k not in ("up", "down")} == \
        {k: v for k, v in c16.items() if k not in ("up", "down")}
    assert c8["up"]["BLOCK_N"] == c16["up"]["BLOCK_N"] == 32
    assert c8["down"]["BLOCK_N"] == c16["down"]["BLOCK_N"] == 128
    for T in (2, 8):                                     # deep tiles: 128 elements, 4 stages
        c = md.moe_decode_config(T, 8, 32, 2048, 7168, FP8, 132)
        assert c["up"]["BLOCK_K"] == c["down"]["BLOCK_K"] == 128 and c["num_stages"] == 4
    c = md.moe_decode_config(8, 8, 32, 2048, 7168, FP8, 132, dict(mode="fma"))
    assert c["up"]["BLOCK_K"] == 128 and c["up"]["BLOCK_N"] * 128 <= 4096   # FMA, 32 / thread


def test_fused_moe_torch_with_scales():
    for (E, I, D, first, n_global), T in zip(SHAPES, (3, 20)):
        x, gate, up, down, weights, ids, scales = _problem(T, E, I, D, 2, first, n_global, 5)
        ref = _reference(x, gate, up, down, weights, ids, first, scales)
        out = fm.fused_moe_torch(x, gate, up, down, weights, ids, first, scales=scales)
        _check(out, ref, x, torch.float32)
        out = fm.fused_moe_torch(x.to(torch.bfloat16), gate, up, down,
                                 weights.to(torch.bfloat16), ids, first, scales=scales)
        _check(out, ref, x, torch.bfloat16)


def test_bad_arguments_raise():
    E, I, D, first, n_global = SHAPES[0]
    x, gate, up, down, weights, ids, scales = _problem(2, E, I, D, 2, first, n_global, seed=1)
    gs, us, ds = scales
    shared = (torch.zeros(8, D), torch.zeros(8, D), torch.zeros(D, 8))
    for variant in ("v1", "decode", "auto"):         # shared with scales: no shared_scales
        with pytest.raises(ValueError, match="shared"):
            fm.fused_moe(x, gate, up, down, weights, ids, first, variant=variant,
                         shared=shared, scales=scales)
    with pytest.raises(ValueError):                      # scale blocks that do not fit
        fm.fused_moe(x, gate, up, down, weights, ids, first, scales=(gs, us[:, :1], ds))
    with pytest.raises(ValueError):
        fm.fused_moe_torch(x, gate, up, down, weights, ids, first, scales=(gs, us, ds[:, :, :1]))
    with pytest.raises(ValueError):                      # the variant is still checked
        fm.fused_moe(x, gate, up, down, weights, ids, first, variant="v2", scales=scales)
    with pytest.raises(ValueError, match="shared_scales"):   # the decode kernels themselves
        md.moe_decode(x, gate, up, down, weights, ids, first, shared=shared, scales=scales)
    with pytest.raises(ValueError, match="scales"):      # fp8 stacks without their scales
        md.moe_decode(x, gate, up, down, weights, ids, first)
    with pytest.raises(ValueError):
        md.moe_decode(x, gate, up, down, weights, ids, first, scales=(gs, us, ds[:, :1]))


# -- fp8 shared experts folded into the decode launches (shared_scales) --------------------------

FOLD_SHAPES = [  # E_local, I, D, first, n_global, Is: I % 128 == 0 (shared_scales_fit)
    (3, 128, 136, 0, 5, 256),     # Is = 2 I; partial last blocks of D (gate / up K, down rows)
    (4, 128, 256, 4, 12, 384),    # Is = 3 I: pieces starting on scale columns 0, 1, 2
]


def _fp8_shared(Is, D, seed, k_major=False):
    """An fp8 shared-expert shard as ParallelMLP's fp8 views give it: gate and up the rows
    [0, Is) and [Is, 2 Is) of ONE merged [2 Is, D] gate_up weight quantized as one tensor, their
    scales the rows [0, Is/128) and [Is/128, 2 Is/128) of its scale grid (views: row strides of
    the merged tensors); down [D, Is]. k_major: the scale grids stored K-major (their stride
    along K is not 1). -> ((gate, up, down), (gate_ss, up_ss, down_ss))"""
    g = torch.Generator().manual_seed(seed)
    gu, gus = _quantize(torch.randn(1, 2 * Is, D, generator=g) / D ** 0.5)
    dn, dns = _quantize(torch.randn(1, D, Is, generator=g) / Is ** 0.5)
    gu, gus, dn, dns = (t[0].to(DEV) for t in (gu, gus, dn, dns))
    if k_major:
        gus, dns = (t.t().contiguous().t() for t in (gus, dns))
        assert gus.stride(1) != 1 and dns.stride(1) != 1
    nb = Is // B
    return (gu[:Is], gu[Is:], dn), (gus[:nb], gus[nb:], dns)


def _shared_reference(x, shared, shared_scales):
    """The shared MLP in fp32 over the dequantized shard: silu(x Wg^T) * (x Wu^T) Wd^T."""
    g, u, d = (_dequantize(w[None], s[None])[0] for w, s in zip(shared, shared_scales))
    x = x.float().cpu()
    return (F.silu(x @ g.t()) * (x @ u.t())) @ d.t()


def _fold_problem(shape, T, k, seed, **kw):
    E, I, D, first, n_global, Is = shape
    x, gate, up, down, weights, ids, scales = _decode_problem((E, I, D, first, n_global), T, k,
                                                              seed)
    shared, shared_scales = _fp8_shared(Is, D, seed + 1, **kw)
    ref = (_reference(x, gate, up, down, weights, ids, first, scales)
           + _shared_reference(x, shared, shared_scales))
    return x, gate, up, down, weights, ids, scales, shared, shared_scales, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", DECODE_MODES, ids=_ids)
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", FOLD_SHAPES, ids=lambda s: "I{1}-D{2}-Is{5}".format(*s))
def test_decode_kernels_fold_fp8_shared_experts(shape, T, config, dtype):
    """moe_decode with fp8 routed experts and the fp8 shared-expert shard (views of a merged
    gate_up weight and of its scale grid) = the routed pairs plus the shared MLP of every token
    over the dequantized weights; FMA and tensor-core products; both launches lead the shared
    pieces (grid N + S)."""
    x, gate, up, down, weights, ids, scales, shared, ss, ref = _fold_problem(shape, T, 2,
                                                                             seed=T * 5 + 1)
    grids, real = [], md.run_kernel

    def record(kernel, grid, *a, **meta):
        grids.append((grid[0], meta["SCALED"], meta["SHARED"]))
        return real(kernel, grid, *a, **meta)
    ctx = _bf16_interpreter() if dtype == torch.bfloat16 else contextlib.nullcontext()
    with ctx, mock.patch.object(md, "run_kernel", record):
        out = md.moe_decode(x.to(dtype), gate, up, down, weights.to(dtype), ids, shape[3],
                            config, shared=shared, scales=scales, shared_scales=ss)
    S = shape[5] // shape[1]
    assert grids == [(T * 2 + S, True, S)] * 2
    _check(out, ref, x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("config", [
    dict(mode="fma", BLOCK_M=2, K_SPLITS=2, up_BLOCK_K=32, down_BLOCK_K=32, **WIDE),
    dict(mode="dot", K_SPLITS=3, FUSED_COMBINE=False, up_BLOCK_K=64, down_BLOCK_K=32, **WIDE),
    dict(mode="dot", up_BLOCK_N=16, down_BLOCK_N=32, K_SPLITS=2, num_stages=1)], ids=_ids)
def test_decode_kernels_fold_fp8_shared_tiles(config, dtype):
    """Folded fp8 shared experts of wider pieces (I 256: a piece's K blocks 2 s and 2 s + 1)
    with K splits inside the pieces (256 in 2: ranges from 0 and 128; in 3 of 32-wide tiles:
    from 0, 96 and 192, BLOCK_K multiples), several K tiles per block, row blocks of 2, the
    unfused k-sum, narrow feature blocks, scale grids stored K-major (a K stride other than 1)."""
    shape = (3, 256, 136, 0, 5, 512)
    x, gate, up, down, weights, ids, scales, shared, ss, ref = _fold_problem(
        shape, 6, 4, seed=23, k_major=True)
    out = md.moe_decode(x.to(dtype), gate, up, down, weights.to(dtype), ids, shape[3], config,
                        shared=shared, scales=scales, shared_scales=ss)
    _check(out, ref, x, dtype)


def test_fold_fp8_shared_a_short_last_piece():
    """Is not a multiple of I (nor of 128): the last piece is short and its last scale block
    partial (gate / up quantized on their own: no merged grid splits there)."""
    E, I, D, first, n_global, Is = 3, 128, 136, 0, 5, 200
    x, gate, up, down, weights, ids, scales = _decode_problem((E, I, D, first, n_global), 3, 2,
                                                              seed=29)
    g = torch.Generator().manual_seed(30)
    ws = [_quantize(torch.randn(1, *s, generator=g) / s[1] ** 0.5)
          for s in ((Is, D), (Is, D), (D, Is))]
    shared = tuple(w[0].to(DEV) for w, _ in ws)
    ss = tuple(s[0].to(DEV) for _, s in ws)
    ref = (_reference(x, gate, up, down, weights, ids, first, scales)
           + _shared_reference(x, shared, ss))
    for mode in ("fma", "dot"):
        out = md.moe_decode(x, gate, up, down, weights, ids, first, dict(mode=mode, **WIDE),
                            shared=shared, scales=scales, shared_scales=ss)
        _check(out, ref, x, torch.float32)


def test_fused_moe_folds_fp8_shared_experts_on_the_decode_kernels():
    """fused_moe passes shared_scales to moe_decode where the decode kernels run; v1 (past
    MAX_PAIRS, or asked for) still refuses any `shared`."""
    shape = FOLD_SHAPES[0]
    x, gate, up, down, weights, ids, scales, shared, ss, ref = _fold_problem(shape, 3, 2, seed=8)
    calls, real = [], md.moe_decode

    def spy(*a, **kw):
        calls.append(kw["shared_scales"])
        return real(*a, **kw)
    with mock.patch.object(md, "moe_decode", spy):
        out = fm.fused_moe(x, gate, up, down, weights, ids, shape[3], variant="decode",
                           shared=shared, scales=scales, shared_scales=ss,
                           config=dict(mode="dot", **WIDE))
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], ss))
    _check(out, ref, x, torch.float32)
    with pytest.raises(ValueError, match="decode kernels"):
        fm.fused_moe(x, gate, up, down, weights, ids, shape[3], variant="v1", shared=shared,
                     scales=scales, shared_scales=ss)


def test_shared_scales_fit():
    assert md.shared_scales_fit(128) and md.shared_scales_fit(256)
    assert md.shared_scales_fit(1408) and md.shared_scales_fit(2048)
    assert not md.shared_scales_fit(200) and not md.shared_scales_fit(64)
    assert not md.shared_scales_fit(0)


def test_fold_fp8_shared_bad_arguments_raise():
    """shared with scales but no shared_scales; shared_scales without scales or without shared;
    routed experts of a width I % 128 != 0; shared scales that do not fit their weights;
    16-bit shared weights beside scales."""
    shape = FOLD_SHAPES[0]
    E, I, D, first = shape[:4]
    x, gate, up, down, weights, ids, scales, shared, ss, _ = _fold_problem(shape, 2, 2, seed=3)
    call = lambda **kw: md.moe_decode(x, gate, up, down, weights, ids, first, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="shared_scales"):
        call(shared=shared, scales=scales)
    w16 = [fp8.dequantize(w, s, torch.float32) for w, s in zip((gate, up, down), scales)]
    s16 = tuple(fp8.dequantize(w, s, torch.float32) for w, s in zip(shared, ss))
    with pytest.raises(ValueError, match="shared_scales"):           # no scales: 16-bit stacks
        md.moe_decode(x, *w16, weights, ids, first, shared=s16, shared_scales=ss)
    with pytest.raises(ValueError, match="shared_scales"):           # no shared
        call(scales=scales, shared_scales=ss)
    with pytest.raises(ValueError, match="shared_scales"):
        fm.fused_moe(x, *w16, weights, ids, first, variant="decode", shared=s16,
                     shared_scales=ss)
    with pytest.raises(ValueError, match="float8"):                  # 16-bit shared weights
        call(shared=s16, scales=scales, shared_scales=ss)
    with pytest.raises(ValueError, match="want"):                    # a grid that does not fit
        call(shared=shared, scales=scales, shared_scales=(ss[0], ss[1], ss[2][:, :1]))
    with pytest.raises(ValueError, match="float32"):
        call(shared=shared, scales=scales, shared_scales=(ss[0].double(), *ss[1:]))
    # routed experts of I = 200: pieces of 200 columns would cut the shard's scale blocks
    x2, g2, u2, d2, w2, i2, sc2 = _problem(2, 3, 200, D, 2, 0, 5, seed=4)
    with pytest.raises(ValueError, match="multiple of 128"):
        md.moe_decode(x2, g2, u2, d2, w2, i2, 0, shared=shared, scales=sc2, shared_scales=ss)
    with pytest.raises(ValueError, match="multiple of 128"):
        fm.fused_moe(x2, g2, u2, d2, w2, i2, 0, variant="decode", shared=shared, scales=sc2,
                     shared_scales=ss)


def test_one_row_takes_the_gluon_launch_with_fp8_where_checked():
    """row_launch (the one-row Gluon path) takes fp8 experts with their scales where
    gluon_moe.FP8 is on and the launch's fp8 self-check passed (available(scaled=True)), and
    not where either is off while the 16-bit launch is available; the launch's own rules see
    the scales (unsupported gets them and the top-k)."""
    from types import SimpleNamespace

    from helix.layers import gluon_moe
    E, I, D, first, n_global = SHAPES[1]
    x, gate, up, down, weights, ids, scales = _problem(1, E, I, D, 2, first, n_global, seed=2)
    row = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))     # as on an sm_90 GPU
    w16 = [w.float().to(torch.bfloat16) for w in (gate, up, down)]
    seen, fp8_ok = [], [True]

    def unsupported(*a, topk, **kw):
        seen.append((a[4:], topk))
        return None

    with mock.patch.object(gluon_moe, "ENABLED", True), \
            mock.patch.object(gluon_moe, "unsupported", unsupported), \
            mock.patch.object(gluon_moe, "available",
                              lambda device, scaled=False: fp8_ok[0] or not scaled):
        assert md.row_launch(row, *w16, None, 2)
        assert md.row_launch(row, gate, up, down, None, 2, scales)
        assert seen[-1] == ((None, scales, None), 2)
        fp8_ok[0] = False                                  # the fp8 self-check failed
        assert md.row_launch(row, *w16, None, 2)
        assert not md.row_launch(row, gate, up, down, None, 2, scales)
        fp8_ok[0] = True
        with mock.patch.object(gluon_moe, "FP8", False):
            assert md.row_launch(row, *w16, None, 2)
            assert not md.row_launch(row, gate, up, down, None, 2, scales)


def test_launch_parameters_on_meta_tensors():
    """Recorded launches (meta tensors: no value read, no host sync): SCALED with the scale
    stacks and their strides only where scales are given; the products run in x.dtype (ieee for
    fp32 x, the pipeline depth of x.dtype); without scales the launch is the 16-bit one."""
    m = dict(device="meta")
    T, D, I, E, k = 6, 7168, 2048, 32, 8
    launches = []
    record = lambda kern, grid, *a, **kw: launches.append((kern, grid, a, kw))  # noqa: E731
    gate, up = (torch.empty(E, I, D, dtype=FP8, **m) for _ in range(2))
    down = torch.empty(E, D, I, dtype=FP8, **m)
    scales = (torch.empty(E, I // B, D // B, **m), torch.empty(E, I // B, D // B, **m),
              torch.empty(E, D // B, I // B, **m))
    ids = torch.empty(T, k, dtype=torch.int64, **m)
    with mock.patch.object(fm, "run_kernel", record), mock.patch.object(md, "run_kernel", record):
        for dt in (torch.bfloat16, torch.float32):
            launches.clear()
            x = torch.empty(T, D, dtype=dt, **m)
            out = fm.fused_moe(x, gate, up, down, torch.empty(T, k, dtype=dt, **m), ids, 64,
                               variant="v1", scales=scales)
            assert out.shape == (T, D) and out.dtype == dt
            cfg = fm.moe_launch_config(T * k, E, I, D, dt)
            (k1, g1, a1, m1), (k2, g2, a2, m2) = launches
            assert (k1, k2) == (fm._gate_up_kernel, fm._down_kernel)
            assert g1 == (E, -(-I // cfg["up"]["BLOCK_N"]), cfg["M_SPLITS"])
            assert g2 == (E + 1, -(-D // cfg["down"]["BLOCK_N"]), cfg["M_SPLITS"])
            for meta, c in ((m1, cfg["up"]), (m2, cfg["down"])):
                assert meta["SCALED"] is True
                assert meta["DOT_PRECISION"] == ("ieee" if dt == torch.float32 else "tf32")
                assert meta["num_stages"] == c["num_stages"] and 128 % meta["BLOCK_K"] == 0
            assert a1[6] is scales[0] and a1[7] is scales[1] and a2[6] is scales[2]
            assert a1[-6:] == (*scales[0].stride(), *scales[1].stride())
            assert a2[-3:] == scales[2].stride()
            # the decode kernels (T * k = 48 pairs): their config for one-byte weights (fp32
            # rows: fp32's), the products in x.dtype, the scales and their strides
            launches.clear()
            out = fm.fused_moe(x, gate, up, down, torch.empty(T, k, dtype=dt, **m), ids, 64,
                               variant="decode", scales=scales)
            assert out.shape == (T, D) and out.dtype == dt
            c = md.moe_decode_config(T, k, E, I, D, FP8 if dt != torch.float32 else dt, 2)
            (k1, g1, a1, m1), (k2, g2, a2, m2) = launches          # 2: sm_count_of(meta)
            assert (k1, k2) == (md._gate_up_kernel, md._down_kernel)
            assert g1 == (T * k, -(-I // c["up"]["BLOCK_N"]))
            assert g2 == (T * k, -(-D // c["down"]["BLOCK_N"]), c["K_SPLITS"])
            for meta, cc in ((m1, c["up"]), (m2, c["down"])):
                assert meta["SCALED"] is True and meta["BLOCK_K"] == cc["BLOCK_K"]
                assert meta["DOT_PRECISION"] == ("ieee" if dt == torch.float32 else "tf32")
                assert meta["num_stages"] == c["num_stages"] and 128 % meta["BLOCK_K"] == 0
            assert a1[7] is scales[0] and a1[8] is scales[1] and a2[8] is scales[2]
            assert a1[-10:-4] == (*scales[0].stride(), *scales[1].stride())
            assert a2[-5:-2] == scales[2].stride()
            assert a1[-4:] == (0,) * 4 and a2[-2:] == (0,) * 2      # no shared scales
            assert m1["SHARED"] == m2["SHARED"] == 0
            # fp8 shared experts folded (DeepSeek-V3 tpf = 8: I 256, Is 256): SHARED = S in both
            # launches, the shard's scale views and their strides (a merged grid's row views)
            I8, Is = 256, 256
            g8, u8 = (torch.empty(E, I8, D, dtype=FP8, **m) for _ in range(2))
            d8 = torch.empty(E, D, I8, dtype=FP8, **m)
            sc8 = (torch.empty(E, I8 // B, D // B, **m), torch.empty(E, I8 // B, D // B, **m),
                   torch.empty(E, D // B, I8 // B, **m))
            gu, gus = torch.empty(2 * Is, D, dtype=FP8, **m), torch.empty(2 * Is // B, D // B, **m)
            shared = (gu[:Is], gu[Is:], torch.empty(D, Is, dtype=FP8, **m))
            ss = (gus[:Is // B], gus[Is // B:], torch.empty(D // B, Is // B, **m))
            launches.clear()
            out = fm.fused_moe(x, g8, u8, d8, torch.empty(T, k, dtype=dt, **m), ids, 64,
                               variant="decode", scales=sc8, shared=shared, shared_scales=ss)
            assert out.shape == (T, D) and out.dtype == dt
            (k1, g1, a1, m1), (k2, g2, a2, m2) = launches
            assert g1[0] == g2[0] == T * k + 1
            assert m1["SCALED"] is m2["SCALED"] is True and m1["SHARED"] == m2["SHARED"] == 1
            assert a1[5] is shared[0] and a1[6] is shared[1] and a2[7] is shared[2]
            assert a1[9] is ss[0] and a1[10] is ss[1] and a2[9] is ss[2]
            assert a1[-4:] == (*ss[0].stride(), *ss[1].stride()) and a2[-2:] == ss[2].stride()
        w = lambda *s: torch.empty(*s, dtype=torch.bfloat16, **m)  # noqa: E731
        for variant in ("v1", "decode"):         # 16-bit stacks: the launches without scales
            launches.clear()
            fm.fused_moe(w(T, D), w(E, I, D), w(E, I, D), w(E, D, I), w(T, k), ids, 64,
                         variant=variant)
            assert [kw.get("SCALED", False) for _, _, _, kw in launches] == [False, False]
            assert all(kw["DOT_PRECISION"] == "tf32" for _, _, _, kw in launches)
            if variant == "decode":              # SCALED off is the kernels' default: unsaid
                assert all("SCALED" not in kw for _, _, _, kw in launches)


# -- the launches compile for Hopper -------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent("""
    import json, sys
    from unittest import mock
    import torch
    from helix.layers import fused_moe as fm, moe_decode as md
    from profiling.kernel_resources import compile_sm90
    launches = []
    m = dict(device="meta")
    record = lambda k, g, *a, **kw: launches.append((k, a, kw))
    # DeepSeek-V3 EP=8 (32 local experts, I 2048, D 7168, k 8), fp8 weights. The sorted v1
    # kernels: decode and prefill under bf16 activations, decode under fp16 and fp32; the decode
    # kernels: bf16 at 1 and 4 rows (tensor cores, their default) and 8 rows by FMA, fp16 and
    # fp32 at 8 rows (132 SMs, as on an H100 / H200)
    v1 = [(4, torch.bfloat16), (4096, torch.bfloat16), (8, torch.float16), (8, torch.float32)]
    decode = [(1, torch.bfloat16, None), (4, torch.bfloat16, None),
              (8, torch.bfloat16, dict(mode="fma")), (8, torch.float16, None),
              (8, torch.float32, None)]
    E, I, D, k = 32, 2048, 7168, 8
    f8 = lambda *s: torch.empty(*s, dtype=torch.float8_e4m3fn, **m)
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, **m)
    scales = (f32(E, I // 128, D // 128), f32(E, I // 128, D // 128), f32(E, D // 128, I // 128))
    with mock.patch.object(fm, "run_kernel", record), mock.patch.object(md, "run_kernel", record), \
            mock.patch.object(md, "sm_count_of", lambda d: 132):
        for T, dt, variant, config in ([(T, dt, "v1", None) for T, dt in v1]
                                       + [(T, dt, "decode", c) for T, dt, c in decode]):
            ids = torch.empty(T, k, dtype=torch.int64, **m)
            fm.fused_moe(torch.empty(T, D, dtype=dt, **m), f8(E, I, D), f8(E, I, D), f8(E, D, I),
                         torch.empty(T, k, dtype=dt, **m), ids, 0, variant=variant,
                         config=config, scales=scales)
        # fp8 shared experts folded into the decode kernels, bf16 at 1 and 4 rows: DeepSeek-V3
        # with the experts split 8 ways (256 local experts of I 2048 / 8, the shared expert's
        # shard Is 256 as views of the merged gate_up weight and of its scale grid)
        E, I, Is = 256, 256, 256
        scales = (f32(E, I // 128, D // 128), f32(E, I // 128, D // 128),
                  f32(E, D // 128, I // 128))
        gu, gus = f8(2 * Is, D), f32(2 * Is // 128, D // 128)
        shared = (gu[:Is], gu[Is:], f8(D, Is))
        shared_scales = (gus[:Is // 128], gus[Is // 128:], f32(D // 128, Is // 128))
        for T in (1, 4):
            fm.fused_moe(torch.empty(T, D, dtype=torch.bfloat16, **m), f8(E, I, D), f8(E, I, D),
                         f8(E, D, I), torch.empty(T, k, dtype=torch.bfloat16, **m),
                         torch.empty(T, k, dtype=torch.int64, **m), 0, variant="decode",
                         scales=scales, shared=shared, shared_scales=shared_scales)
    json.dump([compile_sm90(k, a, kw) for k, a, kw in launches], open(sys.argv[1], "w"))
""")


@pytest.mark.sm90
def test_fp8_launches_compile_for_sm90(tmp_path):
    """What the interpreter cannot check: the fp8-weight launches compile for sm_90 (triton's
    bundled ptxas) within the shared-memory limit; those of 16-bit activations without real
    spills: v1 on mma (decode) and wgmma (64 rows, prefill), the decode kernels on mma or FMA
    (their down launch on tensor cores at one row still DOWN_CTAS_PER_SM programs an SM). fp32
    activations (a checking dtype: ieee FMA products) compile but spill: the e4m3 -> fp32 tile
    conversion, not the scaling. The decode kernels with fp8 shared experts folded (bf16, 1 and
    4 rows): no spills either, the one-row down launch still DOWN_CTAS_PER_SM programs an SM."""
    from profiling.kernel_resources import SM90_SMEM_LIMIT
    out = tmp_path / "resources.json"
    sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT, str(out)], timeout=600, fp_fusion=True)
    records = json.loads(out.read_text())
    assert len(records) == 4 * 2 + 5 * 2 + 2 * 2
    for r in records:
        assert r["constexprs"]["SCALED"] is True, r
        assert r["shared_bytes"] <= SM90_SMEM_LIMIT, r
    v1, decode, folded = records[:8], records[8:18], records[18:]
    half = v1[:6]                                        # bf16 and fp16 activations
    assert all(r["stack_bytes"] <= 64 and r["local_loads"] == 0 for r in half), half
    assert all(r["constexprs"]["DOT_PRECISION"] == "ieee" for r in v1[6:]), v1[6:]
    small, prefill = half[:2] + half[4:], half[2:4]
    assert all(r["hmma"] > 0 for r in small), small
    assert all(r["constexprs"]["BLOCK_M"] == 64 and r["hgmma"] > 0 for r in prefill), prefill
    half = decode[:8]                                    # bf16 and fp16 activations: no spills
    assert all(r["stack_bytes"] == 0 and r["local_loads"] == 0 for r in half), half
    assert all((r["hmma"] > 0) == (r["constexprs"]["MODE"] == md.MODES["dot"]) for r in half)
    assert [r["constexprs"]["MODE"] for r in half[4:6]] == [md.MODES["fma"]] * 2, half[4:6]
    assert all(r["constexprs"]["DOT_PRECISION"] == "ieee" for r in decode[8:]), decode[8:]
    assert all(r["constexprs"]["BLOCK_K"] <= 128 for r in decode), decode
    assert all(r["constexprs"]["SHARED"] == 0 for r in decode), decode
    down = half[1]                                       # one row, 128-wide feature blocks
    assert down["kernel"] == "_down_kernel" and down["constexprs"]["BLOCK_N"] == 128, down
    assert down["registers"] * 32 * down["num_warps"] * md.DOWN_CTAS_PER_SM <= 65536, down
    # fp8 shared experts folded: the shared branch compiled (SHARED = 1 piece), tensor cores,
    # K tiles of the scale block, no spills
    assert [r["kernel"] for r in folded] == ["_gate_up_kernel", "_down_kernel"] * 2, folded
    for r in folded:
        c = r["constexprs"]
        assert c["SHARED"] == 1 and c["MODE"] == md.MODES["dot"] and c["BLOCK_K"] == 128, r
        assert r["stack_bytes"] == 0 and r["local_loads"] == 0 and r["hmma"] > 0, r
    down = folded[1]
    assert down["constexprs"]["BLOCK_N"] == 128, down
    assert down["registers"] * 32 * down["num_warps"] * md.DOWN_CTAS_PER_SM <= 65536, down
