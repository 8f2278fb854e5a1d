"""fused_moe (Triton: the sorted v1 kernels and the decode kernels of helix.layers.moe_decode,
each inner-product mode) and fused_moe_torch against a pair-by-pair reference and LocalExperts;
graph safety of the routing metadata (no host sync, value-independent shapes); only experts
with tokens read; 64-bit expert offsets; the launches compile for sm_90 (no GPU needed).

Without CUDA the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported). The interpreter computes bf16 dot products wrongly, so bf16 runs only on a
GPU, where this module runs the compiled kernels if TRITON_INTERPRET is unset."""

import os

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

import sm90_compile  # noqa: E402

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from helix.layers import fused_moe as fm  # noqa: E402
from helix.layers import moe_decode as md  # noqa: E402
from helix.layers.moe import LocalExperts  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _problem(T, D, I, E, k, first, n_global, dtype, seed):
    """Random weights / routing; ids mix local experts [first, first+E) and other ranks'."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    gate = torch.randn(E, I, D, generator=g) / D ** 0.5
    up = torch.randn(E, I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    ids = torch.stack([torch.randperm(n_global, generator=g)[:k] for _ in range(T)])    # [T, k]
    weights = torch.rand(T, k, generator=g)
    cast = lambda t: t.to(DEV, dtype)  # noqa: E731
    return cast(x), cast(gate), cast(up), cast(down), cast(weights), ids.to(DEV)


def _reference(x, gate, up, down, weights, ids, first):
    """Loop over pairs (t, j), fp32 from the same (rounded) inputs."""
    T, k = ids.shape
    E = gate.shape[0]
    x, gate, up, down, weights = (t.float().cpu() for t in (x, gate, up, down, weights))
    out = torch.zeros(T, x.shape[1])
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - first
            if 0 <= e < E:
                h = F.silu(gate[e] @ x[t]) * (up[e] @ x[t])
                out[t] += weights[t, j] * (down[e] @ h)
    return out


def _check(out, ref, x, dtype):
    assert out.shape == x.shape and out.dtype == x.dtype
    err = (out.float().cpu() - ref).abs().max().item()
    assert err <= TOL[dtype] * (1 + ref.abs().max().item()), err


CASES = [  # T, D, I, E_local, k, first, n_global
    (1, 32, 16, 1, 1, 0, 1),
    (1, 32, 16, 1, 1, 3, 4),       # the only expert is non-local: zero output
    (5, 48, 40, 4, 2, 4, 12),
    (9, 64, 48, 8, 4, 8, 24),
    (7, 40, 24, 3, 3, 0, 3),       # every expert local, odd D / I
    (6, 64, 32, 8, 1, 16, 32),     # k = 1, many empty experts
]


VARIANTS = ["v1", "decode"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_matches_pair_loop(case, dtype, variant):
    T, D, I, E, k, first, n_global = case
    args = _problem(T, D, I, E, k, first, n_global, dtype, seed=hash(case) % 1000)
    ref = _reference(*args, first)
    _check(fm.fused_moe(*args, first, variant=variant), ref, args[0], dtype)
    if variant == "v1":
        _check(fm.fused_moe_torch(*args, first), ref, args[0], dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_shapes(dtype, variant):
    g = torch.Generator().manual_seed(7)
    rand = lambda a, b: int(torch.randint(a, b + 1, (1,), generator=g))  # noqa: E731
    for i in range(4):
        T, D, I, E, k = rand(1, 9), rand(32, 64), rand(16, 48), rand(1, 8), rand(1, 4)
        first = rand(0, 2) * E
        n_global = max(first + E + rand(0, 8), k)
        args = _problem(T, D, I, E, k, first, n_global, dtype, seed=100 + i)
        _check(fm.fused_moe(*args, first, variant=variant), _reference(*args, first), args[0],
               dtype)


WIDE = dict(up_BLOCK_N=32, down_BLOCK_N=64)   # one feature block: few interpreted programs
DECODE_CONFIGS = [  # every inner-product mode, row blocking, split-K, the unfused k-sum
    dict(mode="fma", **WIDE), dict(mode="fma", BLOCK_M=2, up_BLOCK_N=4, down_BLOCK_N=8),
    dict(mode="fma", BLOCK_M=4, K_SPLITS=2, up_BLOCK_K=16, **WIDE),
    dict(mode="dot", K_SPLITS=3, FUSED_COMBINE=False, **WIDE),
    dict(mode="dot", down_BLOCK_N=16, up_BLOCK_K=16, num_stages=1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", DECODE_CONFIGS,
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_decode_kernel_configs(config, dtype):
    """Experts with 1-5 rows (token 4 repeats one expert), other ranks' experts, D / I not
    multiples of the tiles, K splits past the end of I (empty ranges)."""
    E, first = 6, 6
    x, gate, up, down, _, _ = _problem(6, 40, 24, E, 4, first, 18, dtype, seed=21)
    ids = torch.tensor([[7, 6, 0, 11], [7, 9, 17, 6], [7, 8, 6, 1], [7, 3, 6, 10],
                        [7, 7, 9, 2], [6, 7, 4, 5]], device=DEV)
    weights = torch.rand(6, 4, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    out = md.moe_decode(x, gate, up, down, weights, ids, first, config)
    _check(out, _reference(x, gate, up, down, weights, ids, first), x, dtype)


def _shared_shard(Is, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gs = torch.randn(2 * Is, D, generator=g) / D ** 0.5        # [gate | up] as gate_up_proj
    ds = torch.randn(D, Is, generator=g) / Is ** 0.5
    gs, ds = gs.to(DEV, dtype), ds.to(DEV, dtype)
    return gs[:Is], gs[Is:], ds                                  # views, as ParallelMLP.shards


def _shared_reference(x, gs, us, ds):
    x, gs, us, ds = (t.float().cpu() for t in (x, gs, us, ds))
    return (F.silu(x @ gs.t()) * (x @ us.t())) @ ds.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [dict(mode="dot", **WIDE),
                                    dict(mode="fma", BLOCK_M=2, K_SPLITS=2, **WIDE),
                                    dict(mode="dot", K_SPLITS=3, FUSED_COMBINE=False, **WIDE)],
                         ids=["dot", "fma-ks2", "dot-ks3-unfused"])
@pytest.mark.parametrize("T,Is", [(1, 24), (3, 2 * 24 - 5), (5, 3 * 24)])
def test_decode_kernels_add_shared_experts(T, Is, config, dtype):
    """moe_decode with the shared-expert shard: routed pairs (repeats, other ranks' experts)
    plus the shared MLP for every token, the shard cut into cdiv(Is, I) pieces (the last one
    short: 2 * I - 5), every inner-product mode, split-K, the unfused k-sum."""
    E, first, k = 6, 6, 4
    x, gate, up, down, weights, ids = _problem(T, 40, 24, E, k, first, 18, dtype, seed=31 + T)
    ids[0, :2] = 7                                             # one expert twice in a token
    gs, us, ds = _shared_shard(Is, 40, dtype, seed=T)
    ref = _reference(x, gate, up, down, weights, ids, first) + _shared_reference(x, gs, us, ds)
    out = md.moe_decode(x, gate, up, down, weights, ids, first, config, shared=(gs, us, ds))
    _check(out, ref, x, dtype)
    assert md.shared_pieces((gs, us, ds), 24) == -(-Is // 24)


def test_shared_experts_only_on_the_decode_kernels():
    x, gate, up, down, weights, ids = _problem(2, 32, 16, 4, 2, 0, 4, torch.float32, seed=4)
    shared = _shared_shard(16, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="decode kernels"):
        fm.fused_moe(x, gate, up, down, weights, ids, 0, variant="v1", shared=shared)
    assert fm.decode_kernels(2 * 2) and not fm.decode_kernels(4, "v1")
    assert not fm.decode_kernels(md.MAX_PAIRS + 1) and not fm.decode_kernels(0)


def test_moe_layer_same_with_shared_experts_folded():
    """The MoE layer (router, experts, shared experts, one all-reduce) gives the same output
    with the shared experts in the decode kernels as with the separate MLP, and only folds
    them where the decode kernels run."""
    from helix.config import Layout, ModelConfig
    from helix.layers.moe import MoE
    from helix.parallel.comm import LocalComm
    from helix.parallel.mesh import Mesh
    cfg = ModelConfig(arch="deepseek_v2", vocab_size=64, hidden_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32,
                      num_experts=8, experts_per_token=3, moe_intermediate_size=16,
                      num_shared_experts=2, moe_layers=(True,))
    moe = MoE(cfg, LocalComm(Mesh(Layout(), 0)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    moe = moe.to(DEV)
    x = torch.randn(4, 32, generator=g).to(DEV)
    calls = []
    real = md.moe_decode

    def spy(*a, **kw):
        calls.append(a[-1] if len(a) > 8 else kw.get("shared"))
        return real(*a, **kw)

    with mock.patch.object(LocalExperts, "graph_safe", True), \
            mock.patch.object(md, "moe_decode", spy):
        folded = moe(x)
        with mock.patch.object(fm, "FOLD_SHARED", False):
            separate = moe(x)
        with mock.patch.object(fm, "VARIANT", "v1"):
            v1 = moe(x)
    assert len(calls) == 2 and calls[0] is not None and calls[1] is None
    torch.testing.assert_close(folded, separate, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v1, separate, rtol=1e-4, atol=1e-4)


def test_decode_config_validated():
    with pytest.raises(ValueError, match="unknown MoE decode tunables"):
        md.moe_decode_config(1, 6, 64, 1408, 2048, torch.bfloat16, config={"BLOCK": 1})
    with pytest.raises(ValueError, match="mode"):
        md.moe_decode_config(1, 6, 64, 1408, 2048, torch.bfloat16, config={"mode": "x"})
    with pytest.raises(ValueError, match="variant"):
        fm.fused_moe(*_problem(1, 32, 16, 1, 1, 0, 1, torch.float32, 0), 0, variant="v2")
    # FMA accumulators stay within 32 fp32 per thread: BM x BN x BK <= 4096
    for T in (1, 8):
        c = md.moe_decode_config(T, 6, 64, 1408, 2048, torch.bfloat16, 132,
                                 dict(mode="fma", BLOCK_M=4))
        assert all(4 * c[p]["BLOCK_N"] * c[p]["BLOCK_K"] <= 4096 for p in ("up", "down")), c
    # one row, 16-bit weights (measured in whole steps): gate/up in 32-wide feature blocks, the
    # down projection in 128-wide ones over 2 K splits; the same down tiles for two rows
    c = md.moe_decode_config(1, 6, 64, 1408, 2048, torch.bfloat16, 132, shared=2)
    assert c["up"]["BLOCK_N"] == 32 and c["down"]["BLOCK_N"] == 128 and c["K_SPLITS"] == 2
    assert c["MODE"] == md.MODES["dot"] and c["up"]["BLOCK_K"] == 64 and c["num_stages"] == 3
    # two rows: the same down tiles, 1 K split once 2 would not fit one wave of the down launch
    # (14 experts x 16 blocks x 2 > 2 x 132); Qwen3-235B's shape at one row likewise
    c = md.moe_decode_config(2, 6, 64, 1408, 2048, torch.bfloat16, 132, shared=2)
    assert c["down"]["BLOCK_N"] == 128 and c["K_SPLITS"] == 1 and c["num_stages"] == 4
    c = md.moe_decode_config(1, 8, 128, 1536, 4096, torch.bfloat16, 132)
    assert c["down"]["BLOCK_N"] == 128 and c["K_SPLITS"] == 1
    # several rows: 128-element K tiles over 4 stages, feature blocks from the programs rule
    c = md.moe_decode_config(8, 6, 64, 1408, 2048, torch.bfloat16, 132)
    assert c["up"]["BLOCK_K"] == c["down"]["BLOCK_K"] == 128 and c["num_stages"] == 4
    assert c["down"]["BLOCK_N"] == 64 and c["K_SPLITS"] == 1      # 48 experts can be hit
    # fp32 (the CPU oracle's dtype) and explicit tunables keep the plain rule
    c = md.moe_decode_config(8, 6, 64, 1408, 2048, torch.float32, 132, dict(num_stages=2))
    assert c["up"]["BLOCK_K"] == 32 and c["num_stages"] == 2
    # one expert (EP), narrow D: split K to fill the GPU
    c = md.moe_decode_config(1, 1, 8, 4096, 256, torch.bfloat16, 132)
    assert c["K_SPLITS"] == 8


def test_edge_routing_zero_rows_and_empty_experts():
    """first > 0; token 1 routed only to other ranks' experts -> exact zeros; experts 1 and 3 get
    no tokens; a repeated expert id within one token counts twice (as LocalExperts does)."""
    E, first = 4, 8
    x, gate, up, down, _, _ = _problem(4, 32, 16, E, 3, first, 16, torch.float32, seed=3)
    ids = torch.tensor([[8, 10, 0], [0, 1, 15], [10, 10, 20], [12, 8, 7]], device=DEV)
    weights = torch.rand(4, 3, device=DEV)
    ref = _reference(x, gate, up, down, weights, ids, first)
    for fn in (fm.fused_moe, fm.fused_moe_torch):
        out = fn(x, gate, up, down, weights, ids, first)
        _check(out, ref, x, torch.float32)
        assert torch.all(out[1] == 0)


def _local_experts(gate, up, down, first, device=DEV):
    """A LocalExperts holding these stacks (fake config / mesh, no process group)."""
    E, I, D = gate.shape
    cfg = SimpleNamespace(num_experts=E * 4, moe_intermediate_size=I, hidden_size=D)
    mesh = SimpleNamespace(layout=SimpleNamespace(ep=4, tpf=1), ep_rank=first // E, tpf_rank=0)
    mod = LocalExperts(cfg, SimpleNamespace(mesh=mesh), dtype=gate.dtype).to(device)
    with torch.no_grad():
        mod.gate_proj.copy_(gate)
        mod.up_proj.copy_(up)
        mod.down_proj.copy_(down)
    assert mod.first == first
    return mod


def test_same_result_as_local_experts():
    E, first = 4, 8
    args = _problem(8, 48, 32, E, 3, first, 16, torch.float32, seed=11)
    x, gate, up, down, weights, ids = args
    want = _local_experts(gate, up, down, first)(x, weights, ids)
    for variant in VARIANTS:
        torch.testing.assert_close(fm.fused_moe(*args, first, variant=variant), want,
                                   rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fm.fused_moe_torch(*args, first), want, rtol=1e-4, atol=1e-4)


# -- graph safety: no host sync, shapes independent of the routing values ----------------------

def test_routing_metadata():
    ids = torch.tensor([[5, 2], [9, 3], [3, 0], [4, 2]], device=DEV)        # local: 2..5
    order, bounds = fm.moe_routing(ids, first=2, n_local=4)
    assert order.shape == (8,) and bounds.shape == (6,)
    # sorted keys: e0 (2) x2, e1 (3) x2, e2 (4) x1, e3 (5) x1, dropped (9, 0) x2
    assert bounds.tolist() == [0, 2, 4, 5, 6, 8]
    assert order.tolist() == [1, 7, 3, 4, 6, 0, 2, 5]
    other = fm.moe_routing(torch.full_like(ids, 100), first=2, n_local=4)  # all dropped
    assert other[0].shape == order.shape and other[1].shape == bounds.shape
    assert other[1].tolist() == [0, 0, 0, 0, 0, 8]


_SYNC_OPS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "item", "equal",
             "is_nonzero")


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _syncs(fn) -> list[str]:
    with _OpLog() as log:
        fn()
    return [op for op in log.ops if any(s in op for s in _SYNC_OPS)]


def test_no_host_sync_ops():
    """The ops dispatched by moe_routing / fused_moe_torch include none that reads a value to
    the host (.item / .tolist -> _local_scalar_dense, nonzero, unique, masked_select); the same
    probe does catch LocalExperts.forward's."""
    E, first = 4, 4
    args = _problem(5, 32, 16, E, 2, first, 12, torch.float32, seed=5)
    assert _syncs(lambda: fm.moe_routing(args[5], first, E)) == []
    assert _syncs(lambda: fm.fused_moe_torch(*args, first)) == []
    # the probe works: it catches the host-side loop (on CUDA LocalExperts takes the fused path)
    x, gate, up, down, weights, ids = (t.cpu() for t in args)
    mod = _local_experts(gate, up, down, first, device="cpu")
    assert not mod.graph_safe
    assert _syncs(lambda: mod(x, weights, ids))


def test_runs_on_meta_tensors():
    """Meta tensors carry no data: any value-dependent shape or host read would raise. The
    whole fused_moe (kernel launches recorded, not run) and fused_moe_torch go through, and the
    launch grids depend on E, I, D only."""
    m = dict(device="meta")
    T, D, I, E, k = 6, 7168, 2048, 32, 8
    x = torch.empty(T, D, dtype=torch.bfloat16, **m)
    gate, up = (torch.empty(E, I, D, dtype=torch.bfloat16, **m) for _ in range(2))
    down = torch.empty(E, D, I, dtype=torch.bfloat16, **m)
    weights = torch.empty(T, k, dtype=torch.bfloat16, **m)
    ids = torch.empty(T, k, dtype=torch.int64, **m)
    grids = []
    record = lambda kern, grid, *a, **kw: grids.append(grid)  # noqa: E731
    with mock.patch.object(fm, "run_kernel", record), mock.patch.object(md, "run_kernel", record):
        out = fm.fused_moe(x, gate, up, down, weights, ids, first=64, variant="v1")
        assert out.shape == (T, D) and out.dtype == torch.bfloat16
        cfg = fm.moe_launch_config(T * k, E, I, D, torch.bfloat16)
        assert grids == [(E, -(-I // cfg["up"]["BLOCK_N"]), cfg["M_SPLITS"]),
                         (E + 1, -(-D // cfg["down"]["BLOCK_N"]), cfg["M_SPLITS"])]
        grids.clear()
        out = fm.fused_moe(x, gate, up, down, weights, ids, first=64)     # decode kernels
        assert out.shape == (T, D) and out.dtype == torch.bfloat16
        c = md.moe_decode_config(T, k, E, I, D, torch.bfloat16, 2)      # 2: sm_count_of(meta)
        assert grids == [(T * k, -(-I // c["up"]["BLOCK_N"])),
                         (T * k, -(-D // c["down"]["BLOCK_N"]), c["K_SPLITS"])]
        grids.clear()
        shared = (torch.empty(2 * I + 8, D, dtype=torch.bfloat16, **m)[:I + 4],
                  torch.empty(I + 4, D, dtype=torch.bfloat16, **m),
                  torch.empty(D, I + 4, dtype=torch.bfloat16, **m))
        out = fm.fused_moe(x, gate, up, down, weights, ids, first=64, shared=shared)
        c = md.moe_decode_config(T, k, E, I, D, torch.bfloat16, 2, shared=2)
        assert out.shape == (T, D) and grids[0][0] == grids[1][0] == T * k + 2
    order, bounds = fm.moe_routing(ids, 64, E)
    assert order.shape == (T * k,) and bounds.shape == (E + 2,)
    assert fm.fused_moe_torch(x[:, :64], gate[:2, :16, :64], up[:2, :16, :64],
                              down[:2, :64, :16], weights, ids, 64).shape == (T, 64)


# -- only experts with tokens are read ---------------------------------------------------------

@pytest.mark.skipif(ON_GPU, reason="instruments the interpreter's loads")
@pytest.mark.parametrize("variant", VARIANTS)
def test_reads_only_experts_with_tokens(variant):
    """Every address the kernels load is recorded: none falls in the gate / up / down slices of
    the experts that received no token, and every hit expert's slices are read."""
    from triton.runtime import interpreter
    E, first = 6, 6
    x, gate, up, down, _, _ = _problem(3, 32, 16, E, 2, first, 12, torch.float32, seed=9)
    ids = torch.tensor([[7, 0], [10, 7], [3, 11]])                  # local experts 1, 4, 5
    weights = torch.rand(3, 2)
    loaded = []
    real = interpreter.InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, other, *a, **kw):
        loaded.append(ptrs.data[mask.data].astype("int64").ravel())
        return real(self, ptrs, mask, other, *a, **kw)

    with mock.patch.object(interpreter.InterpreterBuilder, "create_masked_load", spy):
        out = fm.fused_moe(x, gate, up, down, weights, ids, first, variant=variant)
    _check(out, _reference(x, gate, up, down, weights, ids, first), x, torch.float32)
    addrs = torch.from_numpy(__import__("numpy").concatenate(loaded))

    def touched(t):
        lo = t.data_ptr()
        return bool(((addrs >= lo) & (addrs < lo + t.numel() * t.element_size())).any())

    for e in range(E):
        hit = e in (1, 4, 5)
        assert [touched(w[e]) for w in (gate, up, down)] == [hit] * 3, e


# -- 64-bit expert offsets ---------------------------------------------------------------------

_BIG_SCRIPT = textwrap.dedent("""
    import os, sys
    dev = sys.argv[1]
    if dev == "cpu":                  # the interpreter only off the GPU (triton 3.6's cannot run
        os.environ.setdefault("TRITON_INTERPRET", "1")      # this kernel's loop)
    import torch
    import torch.nn.functional as F
    from helix.layers.fused_moe import fused_moe
    torch.manual_seed(0)
    # 3 experts whose stride S < 2^31 but 2 * S > 2^31 elements: expert 2 needs 64-bit offsets.
    # One fp16 buffer holds gate / up / down; only the touched pages are committed.
    I, D, S = 16, 32, 2**30 + 64
    buf = torch.empty(2 * S + 3 * I * D, dtype=torch.float16, device=dev)
    gate = buf.as_strided((3, I, D), (S, D, 1), 0)
    up = buf.as_strided((3, I, D), (S, D, 1), I * D)
    down = buf.as_strided((3, D, I), (S, I, 1), 2 * I * D)
    for e in (0, 2):
        for w in (gate, up, down):
            w[e].copy_(torch.randn(w.shape[1:]) / 5)
    x = torch.randn(4, D, device=dev).half()
    ids = torch.tensor([[2, 0], [2, 9], [0, 2], [2, 2]], device=dev)
    weights = torch.rand(4, 2, device=dev).half()
    ref = torch.zeros(4, D)
    for t in range(4):
        for j in range(2):
            e = int(ids[t, j])
            if e < 3:
                g, u, d = (w[e].float().cpu() for w in (gate, up, down))
                h = F.silu(g @ x[t].float().cpu()) * (u @ x[t].float().cpu())
                ref[t] += weights[t, j].float().cpu() * (d @ h)
    for variant in ("v1", "decode"):
        out = fused_moe(x, gate, up, down, weights, ids, first=0, variant=variant).float()
        err = (out.cpu() - ref).abs().max().item()
        assert err < 2e-2 * (1 + ref.abs().max().item()), (variant, err)
    print("ok")
""")


def _run_big(dev: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
    res = subprocess.run([sys.executable, "-c", _BIG_SCRIPT, dev], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="the GPU variant below covers it")
def test_expert_offsets_over_2_31_elements_cpu():
    _run_big("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_expert_offsets_over_2_31_elements_gpu():
    _run_big("cuda")


# -- the launches compile for Hopper -----------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent("""
    import json, sys
    from unittest import mock
    import torch
    from helix.layers import fused_moe as fm, moe_decode as md
    from profiling.kernel_resources import compile_sm90
    launches = []
    m = dict(device="meta")
    # DeepSeek-V3 EP=8 decode and prefill (bf16), Qwen3-MoE-like decode (fp16, fp32)
    cases = [(4, 32, 2048, 7168, 8, torch.bfloat16), (4096, 32, 2048, 7168, 8, torch.bfloat16),
             (8, 16, 768, 4096, 8, torch.float16), (8, 16, 768, 4096, 8, torch.float32)]
    record = lambda k, g, *a, **kw: launches.append((k, a, kw))
    with mock.patch.object(fm, "run_kernel", record), mock.patch.object(md, "run_kernel", record), \
            mock.patch.object(md, "sm_count_of", lambda d: 132):
        for T, E, I, D, k, dt in cases:
            w = lambda *s: torch.empty(*s, dtype=dt, **m)
            fm.fused_moe(w(T, D), w(E, I, D), w(E, I, D), w(E, D, I), w(T, k),
                         torch.empty(T, k, dtype=torch.int64, **m), 0, variant="v1")
        # decode kernels: DeepSeek-V2-Lite (64 experts), batch 1 on tensor cores, 8 by FMA
        for T, mode in ((1, "dot"), (8, "fma")):
            w = lambda *s: torch.empty(*s, dtype=torch.bfloat16, **m)
            md.moe_decode(w(T, 2048), w(64, 1408, 2048), w(64, 1408, 2048), w(64, 2048, 1408),
                          w(T, 6), torch.empty(T, 6, dtype=torch.int64, **m), 0, dict(mode=mode))
    json.dump([compile_sm90(k, a, kw) for k, a, kw in launches], open(sys.argv[1], "w"))
""")


@pytest.mark.sm90
def test_kernels_compile_for_sm90(tmp_path):
    from profiling.kernel_resources import SM90_SMEM_LIMIT
    out = tmp_path / "resources.json"
    sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT, str(out)], fp_fusion=True)
    records = json.loads(out.read_text())
    assert len(records) == 8 + 4
    for r in records:
        assert r["shared_bytes"] <= SM90_SMEM_LIMIT, r
        assert r["stack_bytes"] <= 64, r
    prefill = [r for r in records[:8] if r["constexprs"]["BLOCK_M"] == 64]
    assert prefill and all(r["hgmma"] > 0 for r in prefill), prefill   # wgmma at 64 rows
    decode = records[8:]
    assert all(r["local_loads"] == 0 for r in decode), decode               # no spills
    assert all((r["hmma"] > 0) == (r["constexprs"]["MODE"] == 2) for r in decode), decode
    # the down launch on tensor cores holds DOWN_CTAS_PER_SM programs an SM, no more (registers)
    down = next(r for r in decode if r["kernel"] == "_down_kernel" and r["constexprs"]["MODE"] == 2)
    per_cta = down["registers"] * 32 * down["num_warps"]
    assert per_cta * md.DOWN_CTAS_PER_SM <= 65536 < per_cta * (md.DOWN_CTAS_PER_SM + 1), down
    # the down launch's fused k-sum (the interpreter runs programs one at a time, so its memory
    # ordering is checked in the PTX): a CTA barrier between the partial stores and the one
    # acq_rel GPU-scope atomic; the summing program reads the partials through L2 (.cg)
    ptxs = [p.read_text() for p in (tmp_path / "cache").rglob("_down_kernel.ptx")]
    fused = [p for p in ptxs if "atom." in p]
    assert len(fused) == 2, len(fused)
    for ptx in fused:
        lines = [ln.strip() for ln in ptx.splitlines()]
        atoms = [i for i, ln in enumerate(lines) if "atom." in ln]
        assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in lines[atoms[0]], atoms
        before = lines[:atoms[0]]
        last_store = max(i for i, ln in enumerate(before) if "st.global" in ln)
        last_bar = max(i for i, ln in enumerate(before) if ln.startswith("bar.sync"))
        assert last_store < last_bar, "no CTA barrier between the partial stores and the atomic"
        assert any("ld.global.cg" in ln for ln in lines[atoms[0]:])
