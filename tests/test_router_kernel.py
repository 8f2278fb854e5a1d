"""The MoE router: route_torch (the tie rule) against the router's previous torch code, and the
Triton kernels (selection only; GEMM + selection in one launch) against route_torch, in every
routing mode (softmax greedy, DeepSeek-V2 group_limited_greedy, DeepSeek-V3 sigmoid noaux_tc
with and without groups, norm_topk_prob on / off, scaling); exact ties; the Router's path
choice; the fused launch's memory ordering in its sm_90 PTX.

Without CUDA the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by
triton_mode before triton is imported)."""

import os

import torch

from triton_mode import DEV, ON_GPU, gpu_rounding  # first: picks the interpreter

import sm90_compile  # noqa: E402

import json  # noqa: E402
import textwrap  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helix.layers import router as rt  # noqa: E402
from helix.layers import triton_router as tr  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, spec, experts): every routing rule of the supported models
MODES = [
    ("qwen3-softmax-norm", tr.RouteSpec(8, False, 1, 1, "none", True, 1.0), 128),
    ("v2lite-softmax-greedy", tr.RouteSpec(6, False, 1, 1, "none", False, 1.0), 64),
    ("v2-group-limited", tr.RouteSpec(6, False, 8, 3, "max", False, 16.0), 160),
    ("v2-group-limited-norm", tr.RouteSpec(4, False, 4, 2, "max", True, 1.0), 24),
    ("v3-sigmoid-groups", tr.RouteSpec(8, True, 8, 4, "top2", True, 2.5), 256),
    ("v3-sigmoid-groups-no-norm", tr.RouteSpec(2, True, 4, 2, "top2", False, 1.0), 8),
    ("v3-sigmoid-no-groups", tr.RouteSpec(4, True, 1, 1, "none", True, 1.5), 40),
]
IDS = [m[0] for m in MODES]


def _legacy_route(logits, bias, spec):
    """The router's torch code before the Triton router (the oracle of route_torch)."""
    def group_mask(scores, n_group, topk_group, v3):
        T, E = scores.shape
        grouped = scores.view(T, n_group, E // n_group)
        gs = grouped.topk(2, dim=-1).values.sum(-1) if v3 else grouped.max(-1).values
        keep = torch.zeros_like(gs, dtype=torch.bool)
        keep.scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
        return keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)

    k = spec.k
    if spec.sigmoid:
        scores = logits.sigmoid()
        choice = scores + bias.float()
        if spec.groups > 1:
            choice = choice.masked_fill(~group_mask(choice, spec.groups, spec.topk_group, True),
                                        float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        w = scores.gather(1, ids)
        if spec.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * spec.scaling, ids
    scores = logits.softmax(dim=-1)
    if spec.group_rule == "max":
        scores = scores.masked_fill(~group_mask(scores, spec.groups, spec.topk_group, False), 0.0)
    w, ids = scores.topk(k, dim=-1)
    if spec.norm:
        w = w / w.sum(-1, keepdim=True)
    return w * spec.scaling, ids


def _problem(E, T, sigmoid, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    bias = (torch.randn(E, generator=g) * 0.5) if sigmoid else None
    return logits, bias


@pytest.mark.parametrize("name,spec,E", MODES, ids=IDS)
def test_route_torch_matches_previous_router(name, spec, E):
    """Without ties the tie rule changes nothing: same ids in the same order, same weights."""
    logits, bias = _problem(E, 33, spec.sigmoid, seed=E)
    w, ids = rt.route_torch(logits, bias, spec)
    w0, ids0 = _legacy_route(logits, bias if bias is not None else torch.zeros(E), spec)
    assert torch.equal(ids, ids0)
    torch.testing.assert_close(w, w0, rtol=1e-6, atol=0)


def _close_weights(w, ref, dtype):
    tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(w.float().cpu(), ref.float(), rtol=tol, atol=tol * 1e-3)


@pytest.mark.parametrize("name,spec,E", MODES, ids=IDS)
def test_select_kernel_matches_torch(name, spec, E):
    """T = 11 rows: several programs of BLOCK_T rows and a partial last one."""
    logits, bias = _problem(E, 11, spec.sigmoid, seed=E + 1)
    ref_w, ref_ids = rt.route_torch(logits, bias, spec)
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    w, ids = tr.route_select_triton(dev(logits), dev(bias), spec, torch.float32)
    assert ids.dtype == torch.int64 and w.shape == (11, spec.k)
    assert torch.equal(ids.cpu(), ref_ids)
    _close_weights(w, ref_w, torch.float32)


FUSED = [MODES[1], MODES[2], MODES[4], MODES[6]]


def test_fused_launch_config_takes_d_in_one_tile_where_it_fits():
    """DeepSeek-V2-Lite (64 experts, D 2048) at 1-8 rows and Qwen3 (128, 4096) at 1-2: one
    tile (8 warps past 8K elements); DeepSeek-V3 (256, 7168) and 4 rows of Qwen3: chunks."""
    cfg = tr.fused_launch_config
    assert [cfg(T, 64, 2048)["BLOCK_D"] for T in (1, 4, 8)] == [2048, 2048, 2048]
    assert [cfg(T, 64, 2048)["num_warps"] for T in (1, 4, 8)] == [4, 4, 8]
    assert cfg(1, 128, 4096)["BLOCK_D"] == 4096 and cfg(2, 128, 4096)["BLOCK_D"] == 4096
    assert cfg(4, 128, 4096)["BLOCK_D"] == 1024 and cfg(4, 128, 4096)["num_warps"] == 4
    assert cfg(1, 256, 7168)["BLOCK_D"] == 1024


@pytest.mark.parametrize("block_d", [32, 128], ids=["chunked", "one-tile"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,spec,E", FUSED, ids=[m[0] for m in FUSED])
def test_fused_kernel_matches_torch(name, spec, E, wdtype, T, block_d):
    """GEMM + routing in one launch against F.linear + route_torch: x in fp16 cast to the
    router's dtype (fp32 for DeepSeek; fp16 logits rounded like F.linear's output); D in
    32-wide chunks, or in one tile (its router rows loaded before the PDL wait)."""
    g = torch.Generator().manual_seed(T * E)
    D = 96
    x = (torch.randn(T, D, generator=g)).half()
    weight = (torch.randn(E, D, generator=g) / D ** 0.5).to(wdtype)
    bias = (torch.randn(E, generator=g) * 0.5) if spec.sigmoid else None
    logits = F.linear(x.to(wdtype).float(), weight.float()).to(wdtype).float()
    ref_w, ref_ids = rt.route_torch(logits, bias, spec)
    w, ids = tr.route_fused_triton(x.to(DEV), weight.to(DEV), None if bias is None else
                                   bias.to(DEV), spec, config=dict(BLOCK_D=block_d))
    assert w.dtype == torch.float16
    assert torch.equal(ids.cpu(), ref_ids)
    _close_weights(w, ref_w.half(), torch.float16)
    # the arrival counter is back to zero: the next launch starts clean
    from helix.triton_util import arrival_counters
    assert int(arrival_counters(DEV, 1)[0]) == 0


@pytest.mark.parametrize("block_d", [32, 128], ids=["chunked", "one-tile"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("name,spec,E", [MODES[1], MODES[4]], ids=[MODES[1][0], MODES[4][0]])
def test_fused_kernel_with_the_norm_before_it(name, spec, E, T, block_d):
    """route_add_norm_triton: the residual add and RMS norm in the router's launch give
    add_rms_norm's h bitwise and its y within one ulp (the sum of squares in another order),
    and the routing of that y; the output buffers are new, contiguous, in the norm's dtypes;
    D in chunks (two passes) or in one tile (x and the residual loaded once)."""
    from helix.layers.fused_ops import add_rms_norm_torch
    g = torch.Generator().manual_seed(7 * T + E)
    D = 96
    a = (torch.randn(T, D + 8, generator=g) * 2).bfloat16()[:, 4:4 + D]      # strided rows
    res = (torch.randn(T, D, generator=g) * 3).bfloat16()
    nw = (torch.rand(D, generator=g) + 0.5).bfloat16()
    weight = torch.randn(E, D, generator=g) / D ** 0.5                         # fp32 router
    bias = (torch.randn(E, generator=g) * 0.5) if spec.sigmoid else None
    ref_y, ref_h = add_rms_norm_torch(a, res, nw, 1e-6)
    with gpu_rounding():
        y, h, w, ids = tr.route_add_norm_triton(a.to(DEV), res.to(DEV), nw.to(DEV), 1e-6,
                                                weight.to(DEV), None if bias is None else
                                                bias.to(DEV), spec,
                                                config=dict(BLOCK_D=block_d))
    assert y.dtype == h.dtype == w.dtype == torch.bfloat16 and y.is_contiguous()
    assert torch.equal(h.cpu(), ref_h)
    diff = (y.cpu().float() - ref_y.float()).abs()
    ulp = ref_y.float().abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool((diff <= ulp).all())
    logits = F.linear(y.cpu().float(), weight)
    ref_w, ref_ids = rt.route_torch(logits, bias, spec)
    assert torch.equal(ids.cpu(), ref_ids)
    _close_weights(w, ref_w.bfloat16(), torch.bfloat16)
    from helix.triton_util import arrival_counters
    assert int(arrival_counters(DEV, 1)[0]) == 0


def test_router_add_norm_forward_is_norm_then_router():
    """Off the fused path (CPU) Router.add_norm_forward is RMSNorm.add_forward, then the
    router: the same tensors as the two calls."""
    from helix.layers.norm import RMSNorm
    cfg = SimpleNamespace(arch="deepseek_v2", num_experts=8, hidden_size=16, scoring="softmax",
                          experts_per_token=2, topk_method="greedy", n_group=1, topk_group=1,
                          norm_topk_prob=False, routed_scaling_factor=1.0)
    router, norm = rt.Router(cfg, torch.bfloat16), RMSNorm(16, 1e-6, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    a, res = torch.randn(3, 16, generator=g).bfloat16(), torch.randn(3, 16, generator=g).bfloat16()
    got = router.add_norm_forward(a, res, norm)
    y, h = norm.add_forward(a, res)
    want = (y, h, *router(y))
    assert all(torch.equal(u, v) for u, v in zip(got, want))


def test_ties_lowest_expert_first():
    """Equal scores: the lowest expert id first, in both paths; equal group scores: the
    lowest group; -inf (other groups) never above a kept expert, even when k exceeds the
    finite candidates."""
    E = 16
    logits = torch.zeros(4, E)
    logits[1, [3, 7, 11]] = 1.0                       # three equal maxima
    logits[2] = torch.tensor([0.5, 2.0] * 8)          # eight equal maxima: 1, 3, 5, ...
    logits[3, 9] = -1.0
    cases = [
        (tr.RouteSpec(4, False, 1, 1, "none", False, 1.0), None),
        (tr.RouteSpec(4, False, 4, 2, "max", False, 1.0), None),
        (tr.RouteSpec(4, True, 4, 2, "top2", True, 1.0), torch.zeros(E)),
        (tr.RouteSpec(6, True, 8, 1, "top2", True, 1.0), torch.zeros(E)),  # k > kept experts
    ]
    for spec, bias in cases:
        w, ids = rt.route_torch(logits, bias, spec)
        kw, kids = tr.route_select_triton(logits.to(DEV), None if bias is None else bias.to(DEV),
                                          spec, torch.float32)
        assert torch.equal(kids.cpu(), ids), (spec, kids, ids)
        _close_weights(kw, w, torch.float32)
    w, ids = rt.route_torch(logits, None, cases[0][0])
    assert ids.tolist() == [[0, 1, 2, 3], [3, 7, 11, 0], [1, 3, 5, 7], [0, 1, 2, 3]]
    _, ids = rt.route_torch(logits, None, cases[1][0])
    # group scores (max logit) of row 1: groups 0, 1, 2 tie at 1.0 -> keep groups 0 and 1
    assert ids[1].tolist() == [3, 7, 0, 1]
    _, ids = rt.route_torch(logits, torch.zeros(E), cases[3][0])
    assert ids[0].tolist()[:2] == [0, 1] and ids[0].tolist()[2:] == [2, 3, 4, 5]


def test_topk_lowest_id_orders_like_floats():
    key = torch.tensor([[-0.0, 0.0, -1.5, float("-inf"), 3.0, -1.5, 1e-30, -1e-30]])
    ids = rt.topk_lowest_id(key, 8)
    assert ids.tolist() == [[4, 6, 0, 1, 7, 2, 5, 3]]


def test_router_path_choice(monkeypatch):
    cfg = SimpleNamespace(arch="qwen3_moe", num_experts=8, hidden_size=16, scoring="softmax",
                          experts_per_token=2, topk_method="greedy", n_group=1, topk_group=1,
                          norm_topk_prob=True, routed_scaling_factor=1.0)
    router = rt.Router(cfg)
    cuda = lambda T: SimpleNamespace(is_cuda=True, shape=(T, 16))  # noqa: E731
    assert router.path(torch.zeros(2, 16)) == "torch"                # CPU
    assert router.path(cuda(tr.MAX_FUSED_ROWS)) == "fused"
    assert router.path(cuda(tr.MAX_FUSED_ROWS + 1)) == "select"
    monkeypatch.setattr(rt, "KERNEL", "select")
    assert router.path(cuda(1)) == "select"
    monkeypatch.setattr(rt, "KERNEL", "torch")
    assert router.path(cuda(1)) == "torch"


def test_router_module_on_cpu_uses_route_torch():
    cfg = SimpleNamespace(arch="deepseek_v3", num_experts=8, hidden_size=16, scoring="sigmoid",
                          experts_per_token=2, topk_method="noaux_tc", n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=2.5)
    router = rt.Router(cfg, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g))
    x = torch.randn(3, 16, generator=g).bfloat16()
    w, ids = router(x)
    ref_w, ref_ids = _legacy_route(F.linear(x.float(), router.weight),
                                   router.e_score_correction_bias, router.spec)
    assert w.dtype == torch.bfloat16 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.bfloat16())


_COMPILE_SCRIPT = textwrap.dedent("""
    import json, sys
    from unittest import mock
    import torch
    from helix.layers import triton_router as tr
    from profiling.kernel_resources import compile_sm90
    m = dict(device="meta")
    launches = []
    with mock.patch.object(tr, "run_kernel", lambda k, g, *a, **kw: launches.append((k, a, kw))), \\
            mock.patch.object(tr, "arrival_counters",
                              lambda d, n: torch.empty(4096, dtype=torch.int32, **m)):
        for spec, E, D, wdt, T in [
                (tr.RouteSpec(8, True, 8, 4, "top2", True, 2.5), 256, 7168, torch.float32, 8),
                (tr.RouteSpec(8, False, 1, 1, "none", True, 1.0), 128, 4096, torch.bfloat16, 1)]:
            b = torch.empty(E, **m) if spec.sigmoid else None
            tr.route_fused_triton(torch.empty(T, D, dtype=torch.bfloat16, **m),
                                  torch.empty(E, D, dtype=wdt, **m), b, spec)
        bf = dict(dtype=torch.bfloat16, **m)
        for T in (1, 8):      # DeepSeek-V2-Lite: one tile at 4 and at 8 warps
            tr.route_add_norm_triton(torch.empty(T, 2048, **bf), torch.empty(T, 2048, **bf),
                                     torch.empty(2048, **bf), 1e-6, torch.empty(64, 2048, **m),
                                     None, tr.RouteSpec(6, False, 1, 1, "none", False, 1.0))
        tr.route_select_triton(torch.empty(64, 256, **m), torch.empty(256, **m),
                               tr.RouteSpec(8, True, 8, 4, "top2", True, 2.5), torch.bfloat16)
    print(json.dumps([compile_sm90(k, a, kw) for k, a, kw in launches]))
""")


@pytest.mark.sm90
def test_router_kernels_compile_for_sm90(tmp_path):
    """DeepSeek-V3 (batch 8), Qwen3 (batch 1) and DeepSeek-V2-Lite (batch 1 and 8: one tile at
    4 and 8 warps) routers compile for sm_90 without spills, and
    the fused launch orders its workspace (the interpreter runs programs one at a time, so
    this is checked in the PTX): a CTA barrier between the logits stores and the one
    acq_rel GPU-scope atomic, and the last program reads the logits through L2 (.cg)."""
    res = sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT], timeout=600, fp_fusion=True)
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in recs] == ["_route_fused_kernel"] * 4 + ["_route_select_kernel"]
    for r in recs:
        assert r["stack_bytes"] == 0 and r["local_loads"] == 0, r
    ptxs = [p.read_text() for p in (tmp_path / "cache").rglob("_route_fused_kernel.ptx")]
    assert len(ptxs) == 4            # DeepSeek-V3, Qwen3, V2-Lite with the norm at 1 and 8 rows
    for ptx in ptxs:
        lines = [ln.strip() for ln in ptx.splitlines()]
        atoms = [i for i, ln in enumerate(lines) if "atom." in ln]
        assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in lines[atoms[0]], atoms
        before = lines[:atoms[0]]
        last_store = max(i for i, ln in enumerate(before) if "st.global" in ln)
        last_bar = max(i for i, ln in enumerate(before) if ln.startswith("bar.sync"))
        assert last_store < last_bar
        assert any("ld.global.cg" in ln for ln in lines[atoms[0]:])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_fused_router_bf16_gpu():
    """bf16 router weights (Qwen3) on the GPU: the fused launch against cuBLAS + route_torch;
    the logits' accumulation orders differ, so only weights agree to rounding and ids agree
    where the top-k is separated by more than the logits' rounding."""
    spec = tr.RouteSpec(8, False, 1, 1, "none", True, 1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4096, generator=g).bfloat16().cuda()
    w = (torch.randn(128, 4096, generator=g) / 64).bfloat16().cuda()
    kw, kids = tr.route_fused_triton(x, w, None, spec)
    logits = F.linear(x, w).float()
    rw, rids = rt.route_torch(logits, None, spec)
    top = logits.sort(-1, descending=True).values
    separated = (top[:, 7] - top[:, 8]) > 0.05
    assert torch.equal(kids[separated], rids[separated])
    torch.testing.assert_close(kw[separated].float(), rw[separated], rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_add_norm_router_one_tile_on_8_warps_gpu():
    """DeepSeek-V2-Lite's router at 8 rows on the GPU: one [8, 2048] tile on 8 warps
    (ONE_TILE_ELEMENTS), the add + norm in the launch, against fused_ops' add + RMS norm, then
    F.linear and route_torch (fp32 router weights, as the model's): the new residual bitwise,
    the normed rows to an ulp of rstd (the sum of squares in another order), the ids where the
    top-k is separated by more than the logits' accumulation order, the weights (bf16, the
    rows' dtype) to an ulp."""
    from helix.layers.fused_ops import add_rms_norm
    spec = tr.RouteSpec(6, False, 1, 1, "none", False, 1.0)
    assert tr.fused_launch_config(8, 64, 2048) == dict(BLOCK_T=8, BLOCK_E=1, BLOCK_D=2048,
                                                      num_warps=8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2048, generator=g).bfloat16().cuda()
    res = torch.randn(8, 2048, generator=g).bfloat16().cuda()
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).bfloat16().cuda()
    w = (torch.randn(64, 2048, generator=g) / 45).cuda()
    y, h, kw, kids = tr.route_add_norm_triton(x, res, nw, 1e-6, w, None, spec)
    ry, rh = add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(h, rh) and (y == ry).float().mean().item() >= 0.99
    torch.testing.assert_close(y.float(), ry.float(), rtol=1.6e-2, atol=1.6e-2)
    logits = F.linear(ry.float(), w)
    rw, rids = rt.route_torch(logits, None, spec)
    top = logits.sort(-1, descending=True).values
    separated = (top[:, 5] - top[:, 6]) > 1e-3
    assert separated.sum() >= 6
    assert torch.equal(kids[separated], rids[separated])
    assert kw.dtype == torch.bfloat16                 # the weights come in the rows' dtype
    torch.testing.assert_close(kw[separated].float(), rw[separated].bfloat16().float(),
                               rtol=8e-3, atol=1e-4)  # an ulp of bf16 either way


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_captured_decode_with_the_norm_in_the_router(model, monkeypatch):
    """Whole captured decodes: the post-attention norm inside the router's launch against the
    norm kernel, then the same fused router (Router.add_norm_forward's fallback): the same
    greedy tokens, logits to bf16 rounding."""
    from gpu_decode import captured_decode

    launches = []
    real = tr.route_add_norm_triton
    monkeypatch.setattr(tr, "route_add_norm_triton",
                        lambda *a, **k: launches.append(1) or real(*a, **k))
    fused_tokens, fused_logits = captured_decode(model)
    assert launches                                   # the fused path ran (eager warm-up)

    def unfused(self, x, residual, norm):
        y, h = norm.add_forward(x, residual)
        return (y, h, *self(y))
    monkeypatch.setattr(rt.Router, "add_norm_forward", unfused)
    tokens, logits = captured_decode(model)
    assert fused_tokens == tokens
    for a, b in zip(fused_logits, logits):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
