"""The MLA kernel's loop variants against the torch reference (helix/attention/triton_mla.py):
PIPE_QK (software-pipelined S: the QK^T of tile i + 1 issued before the softmax of tile i, the
loop started one empty tile early) and USE_TMA (full tiles through tensor descriptors, the
partial last tile through masked loads; shapes a descriptor cannot address fall back to the
pointer loop). Odd lengths, page boundaries, several splits, empty sequences and empty splits
(LSE -inf, O 0), head blocks with masked heads, eager / lazy rescale, row-summed / deferred
denominator. Without CUDA the kernels run through Triton's interpreter (fp32, fp16)."""

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

import pytest  # noqa: E402

from helix.attention import triton_mla  # noqa: E402
from helix.attention.torch_ref import TorchAttention  # noqa: E402
from helix.kv.manager import LocalKVMeta  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def _meta(lens: list[int], page: int, num_pages: int, gen: torch.Generator) -> LocalKVMeta:
    B = len(lens)
    width = max([1] + [-(-n // page) for n in lens]) + 1
    perm = torch.randperm(num_pages, generator=gen)[:B * width].view(B, width)
    return LocalKVMeta(
        slots=torch.full((B,), -1, dtype=torch.int64, device=DEV),
        block_tables=perm.int().to(DEV), kv_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        cu_q=torch.arange(B + 1, dtype=torch.int32, device=DEV),
        q_pos=torch.tensor([n - 1 for n in lens], dtype=torch.int64, device=DEV).clamp(min=0),
        kvp_rank=0, kvp=1, interleave=1, page_size=page, num_decode=len(lens))


def _check(o, lse, ro, rl, dtype):
    atol, rtol = TOL[dtype]
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.float(), ro.float(), atol=atol, rtol=rtol)
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(rl)), (lse, rl)
    fin = torch.isfinite(rl)
    torch.testing.assert_close(lse[fin], rl[fin], atol=1e-4, rtol=1e-4)
    empty = torch.isinf(rl)
    assert (lse[empty] == float("-inf")).all() and (o[empty] == 0).all()


def _run(case, variant, dtype, seed, poison=False):
    """Runs the case; returns the kernel meta-parameters of the launch (what really ran)."""
    B, H, Dl, Dr, page, lens, splits, block_h = case
    gen = torch.Generator().manual_seed(seed)
    P = 48
    meta = _meta(lens, page, P, gen)
    kv = torch.randn(P, page, Dl + Dr, generator=gen).to(DEV, dtype)
    if poison:       # slots past each sequence's end: non-finite, must never reach O
        for b, n in enumerate(lens):
            pages = meta.block_tables[b].long()
            flat = kv[pages].reshape(-1, Dl + Dr)
            flat[n:] = float("nan")
            kv[pages] = flat.view(len(pages), page, Dl + Dr)
    q = torch.randn(B, H, Dl + Dr, generator=gen).to(DEV, dtype)
    ql, qr = q.split([Dl, Dr], dim=-1)
    launched = []
    run = triton_mla.run_kernel

    def spy(kernel, grid, *args, **kw):
        if kernel is triton_mla._mla_split_kernel:
            launched.append(kw)
        return run(kernel, grid, *args, **kw)

    triton_mla.run_kernel = spy
    try:
        o, lse = triton_mla.mla_decode(ql, qr, kv, meta.block_tables, meta.kv_lens, 0.3,
                                       num_splits=splits, block_h=block_h, config=variant)
    finally:
        triton_mla.run_kernel = run
    ro, rl = TorchAttention().attend_mla(ql, qr, kv, Dl, meta, 0.3)
    assert o.dtype == dtype and o.shape == (B, H, Dl)
    _check(o, lse, ro, rl, dtype)
    return launched[0]


CASES = [  # (B, H, Dl, Dr, page, lens, splits, block_h): TMA-able widths (Dl, Dr powers of 2)
    (3, 8, 64, 16, 16, [1, 40, 77], 2, None),               # odd lengths, page boundaries
    (2, 20, 32, 16, 32, [100, 0], 3, 16),                   # two head blocks, an empty row
    (1, 4, 32, 16, 16, [64], 8, None),                      # whole pages; empty splits
    (2, 6, 16, 16, 8, [0, 0], 2, None),                     # all empty
    (1, 16, 64, 32, 64, [130], None, None),                 # one page = one tile
]
VARIANTS = [
    dict(PIPE_QK=True),
    dict(PIPE_QK=True, BLOCK_N=16),
    dict(PIPE_QK=True, BLOCK_N=16, RESCALE_LOG2=8.0, DEFER_L=True),
    dict(PIPE_QK=True, BLOCK_N=16, SPLIT_QK=False, num_stages=3),
    dict(USE_TMA=True),
    dict(USE_TMA=True, BLOCK_N=16, DEFER_L=True),
    dict(USE_TMA=True, BLOCK_N=16, RESCALE_LOG2=8.0, SPLIT_QK=False),
]


DEFAULTS = triton_mla.mla_launch_config(16, 64, 32, torch.float16)


def _vid(v):
    return ",".join(f"{k}={v[k]}" for k in sorted(v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-h{c[1]}-dl{c[2]}-dr{c[3]}-p{c[4]}")
def test_mla_loop_variants(case, variant, dtype):
    meta = _run(case, variant, dtype, seed=7 * case[0] + sum(case[5]))
    if case[4] % meta["BLOCK_N"] == 0:          # tiles inside a page: the variant itself ran
        pipe = variant.get("PIPE_QK", DEFAULTS["PIPE_QK"])
        assert meta["PIPE_QK"] == pipe, meta
        assert meta["USE_TMA"] == (variant.get("USE_TMA", DEFAULTS["USE_TMA"]) and not pipe), meta


@pytest.mark.parametrize("variant", [dict(USE_TMA=True, BLOCK_N=16),
                                     dict(PIPE_QK=True, BLOCK_N=16)], ids=_vid)
def test_mla_stale_slots_never_reach_the_output(variant):
    """Slots past a sequence's end hold NaN: the partial last tile must be masked (TMA cannot
    mask rows, so USE_TMA loads that tile through masked loads)."""
    meta = _run((2, 8, 32, 16, 16, [37, 50], 2, None), variant, torch.float32, seed=3,
                poison=True)
    assert meta["PIPE_QK"] == variant.get("PIPE_QK", False)
    assert meta["USE_TMA"] == (not meta["PIPE_QK"])           # the default is TMA


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", [dict(PIPE_QK=True), dict(USE_TMA=True)], ids=_vid)
def test_mla_variants_fall_back_on_unaddressable_shapes(variant, dtype):
    """Padded widths (Dl 24, Dr 4: BLOCK_DL != Dl) or tiles larger than a page: the launcher
    turns the variant off and the default loop runs, exactly."""
    meta = _run((2, 4, 24, 4, 8, [9, 30], 2, None), dict(variant, BLOCK_N=16), dtype, seed=5)
    assert not meta["PIPE_QK"] and not meta["USE_TMA"]
    assert not triton_mla.tma_ok(torch.empty(4, 8, 28, device=DEV), 16, 32, 16, 24, 4)


@pytest.mark.parametrize("variant", [dict(PIPE_QK=True, BLOCK_N=16),
                                     dict(PIPE_QK=True, BLOCK_N=16, RESCALE_LOG2=8.0),
                                     dict(USE_TMA=True, BLOCK_N=16, DEFER_L=True)], ids=_vid)
@pytest.mark.parametrize("trend", [1.0, -1.0], ids=["rising", "falling"])
def test_mla_variants_rescale(trend, variant):
    """Logits climbing / falling by far more than 2^8 along the sequence: exact softmax (PIPE_QK
    starts its running max at -FLT_MAX, not -inf)."""
    gen = torch.Generator().manual_seed(5)
    Dl, Dr, page, n = 32, 16, 16, 150
    meta = _meta([n], page, 16, gen)
    q = torch.randn(1, 4, Dl + Dr, generator=gen)
    kv = torch.randn(16, page, Dl + Dr, generator=gen) * 0.1
    pos = torch.arange(n)
    pages, offs = meta.block_tables[0].long().cpu()[pos // page], pos % page
    kv[pages, offs] += trend * (pos[:, None] / 3.0) * q[0, 0] / q[0, 0].norm()
    kv, q = kv.to(DEV), q.to(DEV)
    o, lse = triton_mla.mla_decode(q[..., :Dl], q[..., Dl:], kv, meta.block_tables,
                                   meta.kv_lens, 1.0, num_splits=2, config=variant)
    ro, rl = TorchAttention().attend_mla(q[..., :Dl], q[..., Dl:], kv, Dl, meta, 1.0)
    _check(o, lse, ro, rl, torch.float32)


def test_tunable_defaults():
    """TMA on (measured best on an H200, tune_mla_h200_v2.json), the pipelined loop off."""
    cfg = triton_mla.mla_launch_config(128, 512, 64, torch.bfloat16)
    assert cfg["PIPE_QK"] is False and cfg["USE_TMA"] is True and cfg["split_policy"] == "fill"
    assert {"PIPE_QK", "USE_TMA"} <= set(triton_mla.MLA_TUNABLES)
