"""helix.layers.fused_qk_norm: Qwen3's q / k norms and both rotations in one launch, against the
two fused_ops functions composed (the layer's previous path) and a float64 formula; q / k as
views of the fused qkv projection, head counts that do not fill a block, positions out of
order; the dispatch; the attention layer's use of it. Without CUDA the kernel runs in Triton's
interpreter (rounding like the GPU: triton_mode.gpu_rounding)."""

import torch

from triton_mode import DEV, gpu_rounding  # first: chooses the interpreter before triton loads

import json  # noqa: E402
import textwrap  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402

import sm90_compile  # noqa: E402
from helix.layers import fused_qk_norm as fq  # noqa: E402
from test_fused_ops import _rand, _tables  # noqa: E402

EPS = 1e-6


@pytest.fixture(autouse=True)
def _gpu_rounding():
    with gpu_rounding():
        yield


def _case(dtype, hq, hk, d, T=5, seed=0):
    qkv = _rand(T, (hq + 2 * hk) * d, dtype=dtype, seed=seed, scale=3.0)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)          # views, as the layer has
    qw = (1 + 0.5 * _rand(d, seed=seed + 1)).to(dtype)
    kw = (1 + 0.5 * _rand(d, seed=seed + 2)).to(dtype)
    return q.view(T, hq, d), k.view(T, hk, d), qw, kw


def _f64(x, w, cos, sin, pos, interleave):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w.double()
    c, s = cos.double()[pos].unsqueeze(1), sin.double()[pos].unsqueeze(1)
    a, b = (y[..., 0::2], y[..., 1::2]) if interleave else y.chunk(2, dim=-1)
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


def _agrees(got, want, dtype):
    """The sum of squares in another order may move rstd by an ulp, so a few elements of the
    norm's output differ by a unit of the dtype, which the rotation carries (near a cancelling
    a*cos - b*sin that is many of the output's ulps, but one of its inputs'). In 16 bits
    nearly all elements equal bitwise (an fp32 rstd ulp rarely moves a rounded element); in
    fp32 every element of a head moves with its rstd, within a few of its ulps."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if dtype != torch.float32:
        assert (got == want).float().mean().item() >= 0.9
    tol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=4 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("hq,hk,d", [(8, 2, 16), (6, 1, 32), (5, 3, 8)])
def test_matches_the_two_kernels_composed(dtype, interleave, hq, hk, d):
    q, k, qw, kw = _case(dtype, hq, hk, d, seed=hq * d)
    cos, sin = _tables(64, d // 2)
    pos = torch.tensor([9, 2, 63, 2, 0], device=DEV)
    got_q, got_k = fq.qk_norm_rope_triton(q, k, qw, kw, EPS, cos, sin, pos, interleave)
    want_q, want_k = fq.qk_norm_rope_composed(q, k, qw, kw, EPS, cos, sin, pos, interleave)
    _agrees(got_q, want_q, dtype)
    _agrees(got_k, want_k, dtype)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got_q.double(), _f64(q, qw, cos, sin, pos, interleave),
                               rtol=tol, atol=tol * 4)
    torch.testing.assert_close(got_k.double(), _f64(k, kw, cos, sin, pos, interleave),
                               rtol=tol, atol=tol * 4)


def test_a_block_spans_q_and_k_heads_and_each_gets_its_weight():
    """With q and k weights far apart, a k head normalised with q's weight (or the reverse)
    would be off by their ratio; heads past Hq + Hk in the last block write nothing."""
    q, k, _, _ = _case(torch.float32, 3, 2, 16)
    qw = torch.full((16,), 2.0, device=DEV)
    kw = torch.full((16,), 0.5, device=DEV)
    cos, sin = _tables(8, 8)
    pos = torch.zeros(5, dtype=torch.long, device=DEV)       # cos 1, sin 0 scaled: no mixing
    got_q, got_k = fq.qk_norm_rope_triton(q, k, qw, kw, EPS, cos, sin, pos, False)
    want_q, want_k = fq.qk_norm_rope_composed(q, k, qw, kw, EPS, cos, sin, pos, False)
    _agrees(got_q, want_q, torch.float32)
    _agrees(got_k, want_k, torch.float32)
    # a k head normalised with q's weight would be 4 x too large
    torch.testing.assert_close(got_k.double(), _f64(k, kw, cos, sin, pos, False), rtol=1e-5,
                               atol=1e-5)
    assert fq.launch_config(3 + 2, 8)["BLOCK_H"] == 8          # one block: 3 q, 2 k, 3 idle


def test_dispatch():
    q, k, qw, kw = _case(torch.bfloat16, 4, 2, 16)
    cos, sin = _tables(64, 8)
    pos = torch.tensor([1, 2, 3, 4, 5], device=DEV)
    want = fq.qk_norm_rope_composed(q, k, qw, kw, EPS, cos, sin, pos, False)
    with mock.patch.object(fq, "use_triton", lambda t: True), \
            mock.patch.object(fq, "qk_norm_rope_triton", lambda *a: "kernel"):
        assert fq.qk_norm_rope(q, k, qw, kw, EPS, cos, sin, pos, False) == "kernel"
        for args in ((q, k, qw.float(), kw), (q, k, qw, kw.float())):    # weight dtype differs
            got = fq.qk_norm_rope(*args, EPS, cos, sin, pos, False)
            assert got != "kernel" and got[0].shape == q.shape
        with mock.patch.object(fq, "FUSE", False):
            got = fq.qk_norm_rope(q, k, qw, kw, EPS, cos, sin, pos, False)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_qwen3_attention_takes_the_fused_launch(monkeypatch):
    """GQAAttention with qk_norm hands q, k and both norm weights to qk_norm_rope, once a layer
    and forward pass (not two norms and two ropes)."""
    from helix import LLM, Layout, RuntimeConfig, SamplingParams
    from helix.layers import attention_gqa
    calls = []
    real = attention_gqa.qk_norm_rope

    def spy(q, k, qw, kw, *rest):
        calls.append((q.shape, k.shape, qw.data_ptr(), kw.data_ptr()))
        return real(q, k, qw, kw, *rest)
    monkeypatch.setattr(attention_gqa, "qk_norm_rope", spy)
    with LLM("tiny-qwen3-moe", Layout(), RuntimeConfig(page_size=4, max_batch=1)) as llm:
        llm.add_request([5, 17, 42, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
        while llm.has_unfinished():
            llm.step()
        layers = llm.cfg.num_layers
        norms = {(a.q_norm.weight.data_ptr(), a.k_norm.weight.data_ptr())
                 for a in (layer.self_attn for layer in llm.engine.model.model.layers)}
    assert len(calls) >= 3 * layers and len(calls) % layers == 0     # prefill + 2 decode steps
    assert {(qw, kw) for _, _, qw, kw in calls} == norms


def _pools(hk, d, dtype, pages=6, page=4):
    """A K and a V pool [pages, page, hk, d], NaN everywhere (what no launch writes stays NaN)."""
    return (torch.full((pages, page, hk, d), float("nan"), dtype=dtype, device=DEV),
            torch.full((pages, page, hk, d), float("nan"), dtype=dtype, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk-norm-rope"])
@pytest.mark.parametrize("hq,hk,d", [(8, 2, 16), (5, 3, 8)])
def test_rope_append_equals_the_rotation_then_the_append(dtype, interleave, norm, hq, hk, d):
    """One launch (q rotated; rotated k and v into the caches at their slots, -1 skipped)
    against the two launches it replaces: the rotation (qk_norm_rope's kernel with the norms,
    fused_ops' rope kernel without) and triton_append.append_kv_pair: bitwise without the
    norms; with them, as the two-kernel comparison above (the launch's head blocks differ). q /
    k / v are views of one qkv row; heads do not fill the last block; row 1's slot is -1."""
    from helix.attention import triton_append
    from helix.layers import fused_ops
    T = 5
    qkv = _rand(T, (hq + 2 * hk) * d, dtype=dtype, seed=hq + d, scale=3.0)
    q, k, v = (t.view(T, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    _, _, qw, kw = _case(dtype, hq, hk, d, seed=7)
    if not norm:
        qw = kw = None
    cos, sin = _tables(64, d // 2)
    pos = torch.tensor([9, 2, 63, 2, 0], device=DEV)
    slots = torch.tensor([3, -1, 22, 0, 9], device=DEV)        # row 1: another rank's position
    kc, vc = _pools(hk, d, dtype)
    got_q = fq.rope_append(q, k, v, qw, kw, EPS, cos, sin, pos, interleave, kc, vc, slots)
    if norm:
        want_q, want_k = fq.qk_norm_rope_triton(q, k, qw, kw, EPS, cos, sin, pos, interleave)
    else:
        want_q = fused_ops.rope_triton(q, cos, sin, pos, interleave)
        want_k = fused_ops.rope_triton(k, cos, sin, pos, interleave)
    want_kc, want_vc = _pools(hk, d, dtype)
    triton_append.append_kv_pair(want_kc, want_vc, want_k, v, slots)
    flat_k = kc.view(-1, hk, d)
    assert torch.isnan(flat_k).all(dim=(1, 2)).sum().item() == kc.shape[0] * kc.shape[1] - 4
    assert torch.equal(vc.nan_to_num(7.0), want_vc.nan_to_num(7.0))     # NaN: not written
    assert torch.equal(vc.view(-1, hk, d)[9], v[4])
    if norm:      # a block of other heads may sum the squares in another order: _agrees
        _agrees(got_q, want_q, dtype)
        written = ~torch.isnan(flat_k).all(dim=(1, 2))
        _agrees(flat_k[written], want_kc.view(-1, hk, d)[written], dtype)
        _agrees(flat_k[22].contiguous(), want_k[2], dtype)
    else:         # no reduction: bitwise
        assert got_q.shape == q.shape and got_q.is_contiguous() and torch.equal(got_q, want_q)
        assert torch.equal(kc.nan_to_num(7.0), want_kc.nan_to_num(7.0))
        assert torch.equal(flat_k[22], want_k[2])


def test_rope_append_dispatch():
    """rope_append_fits: CUDA, FUSE_APPEND, one dtype, unit-stride heads, the caches of k's
    heads; anything else takes the rotation and the backend's append."""
    q, k, qw, kw = _case(torch.bfloat16, 4, 2, 16)
    v = k.clone()
    kc, vc = _pools(2, 16, torch.bfloat16)
    with mock.patch.object(fq, "use_triton", lambda t: True):
        assert fq.rope_append_fits(q, k, v, kc, vc) and fq.rope_append_fits(q, k, v, kc, vc, qw, kw)
        assert not fq.rope_append_fits(q, k, v, kc, vc, qw.float(), kw)
        assert not fq.rope_append_fits(q, k, v.float(), kc, vc)
        assert not fq.rope_append_fits(q, k, v, kc[:, :, :1], vc[:, :, :1])
        assert not fq.rope_append_fits(q, k, v, kc.transpose(0, 1), vc.transpose(0, 1))
        with mock.patch.object(fq, "FUSE_APPEND", False):
            assert not fq.rope_append_fits(q, k, v, kc, vc)
        with mock.patch.object(fq, "FUSE", False):     # the norms as launches of their own
            assert not fq.rope_append_fits(q, k, v, kc, vc, qw, kw)
            assert fq.rope_append_fits(q, k, v, kc, vc)
    with mock.patch.object(fq, "use_triton", lambda t: False):
        assert not fq.rope_append_fits(q, k, v, kc, vc)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_attention_folds_the_append_into_the_rotation(model, monkeypatch):
    """GQAAttention without context parallelism: one rope_append a layer and forward pass, no
    append launch, and the same greedy tokens and KV as the rotation + append path (on CPU the
    kernel runs in the interpreter: use_triton patched for this module only; on a GPU, eager
    steps so every launch is a Python call)."""
    from helix import LLM, Layout, RuntimeConfig, SamplingParams
    from helix.attention.backend import AttentionBackend
    from helix.attention.triton_backend import TritonAttention
    from helix.layers import attention_gqa

    real = attention_gqa.rope_append
    pairs = {cls: cls.append_kv_pair for cls in (AttentionBackend, TritonAttention)}

    def run(fused):
        calls, appends = [], []
        monkeypatch.setattr(fq, "use_triton", lambda t: True)
        monkeypatch.setattr(fq, "FUSE_APPEND", fused)
        monkeypatch.setattr(attention_gqa, "rope_append",
                            lambda *a: calls.append(a[0].shape) or real(*a))
        for cls, pair in pairs.items():      # the CPU backends' append and the Triton one's
            monkeypatch.setattr(cls, "append_kv_pair",
                                lambda self, *a, pair=pair: appends.append(1) or pair(self, *a))
        runtime = RuntimeConfig(device=DEV, page_size=4, max_batch=2, cuda_graphs=False)
        with LLM(model, Layout(), runtime) as llm:
            out = llm.generate([[5, 17, 42, 3], [9, 8, 7]],
                               SamplingParams(max_new_tokens=4, ignore_eos=True))
            layers = llm.cfg.num_layers
            kv = [c.clone() for layer in llm.engine.caches for c in layer]
        return out, calls, appends, layers, kv

    got, calls, appends, layers, kv = run(True)
    want, no_calls, want_appends, _, want_kv = run(False)
    assert got == want and not no_calls and want_appends
    assert len(calls) >= 4 * layers and len(calls) % layers == 0 and not appends
    for a, b in zip(kv, want_kv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)    # Qwen3: the norms' sums


_COMPILE = textwrap.dedent("""
    import json, sys
    from unittest import mock
    import torch
    from helix.layers import fused_qk_norm as fq
    from profiling.kernel_resources import compile_sm90
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="meta")
    got = []
    with mock.patch.object(fq, "run_kernel", lambda k, g, *a, **kw: got.append((k, a, kw))):
        for dt in (torch.bfloat16, torch.float32):
            qkv = e(4, (64 + 2 * 4) * 128, dt=dt)                # Qwen3-235B's rank: 64 q, 4 kv
            q, k = qkv[:, :64 * 128].view(4, 64, 128), qkv[:, 64 * 128:68 * 128].view(4, 4, 128)
            fq.qk_norm_rope_triton(q, k, e(128, dt=dt), e(128, dt=dt), 1e-6,
                                   e(8192, 64, dt=torch.float32), e(8192, 64, dt=torch.float32),
                                   e(4, dt=torch.int64), False)
        # rope_append, bf16: Llama-3.1-8B (32 q, 8 kv, no norms) and Qwen3-235B's rank
        for hq, hk, norm in ((32, 8, False), (64, 4, True)):
            qkv = e(4, (hq + 2 * hk) * 128)
            q, k, v = (t.view(4, -1, 128) for t in qkv.split([hq * 128, hk * 128, hk * 128], 1))
            w = e(128) if norm else None
            fq.rope_append(q, k, v, w, w, 1e-6, e(8192, 64, dt=torch.float32),
                           e(8192, 64, dt=torch.float32), e(4, dt=torch.int64), False,
                           e(64, 16, hk, 128), e(64, 16, hk, 128), e(4, dt=torch.int64))
    json.dump([compile_sm90(k, a, kw) for k, a, kw in got], open(sys.argv[1], "w"))
""")


@pytest.mark.sm90
def test_compiles_for_sm90(tmp_path):
    """Compiled for sm_90 (no GPU needed): no spills, and compiled without FMA contraction (the
    rotation's products and sums are rounded separately, as the torch formula does; the FFMAs
    left are those of the correctly rounded sqrt and division); rope_append's launches too."""
    out = tmp_path / "records.json"
    sm90_compile.run(tmp_path, ["-c", _COMPILE, str(out)])
    recs = json.loads(out.read_text())
    assert len(recs) == 4
    for r in recs:
        assert r["kernel"] == "_qk_norm_rope_kernel" and r["local_loads"] == 0
        assert r["stack_bytes"] == 0 and r["fp_fusion"] is False, r
