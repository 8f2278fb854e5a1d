"""The few-heads MLA decode kernel (helix.attention.triton_mla_few) against the torch reference:
both orientations (heads as M; tokens as M, "swap AB"), forced and planned splits, padded head
and width blocks, empty sequences and splits; mla_decode's routing to it; its launches compile
for sm_90 with wgmma in the swapped orientation.

Without CUDA the kernels run through Triton's interpreter (fp32 and fp16; bf16 dot products are
wrong there, so bf16 runs only on a GPU)."""

import os

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

import sm90_compile  # noqa: E402

import json  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402

from helix.attention import triton_mla, triton_mla_few  # noqa: E402
from helix.attention.torch_ref import TorchAttention  # noqa: E402
from helix.kv.manager import LocalKVMeta  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _meta(lens, page, num_pages, gen):
    B = len(lens)
    width = max([1] + [-(-n // page) for n in lens]) + 1
    perm = torch.randperm(num_pages, generator=gen)[:B * width].view(B, width)
    return LocalKVMeta(
        slots=torch.full((B,), -1, dtype=torch.int64, device=DEV),
        block_tables=perm.int().to(DEV), kv_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        cu_q=torch.arange(B + 1, dtype=torch.int32, device=DEV),
        q_pos=torch.tensor([max(0, n - 1) for n in lens], dtype=torch.int64, device=DEV),
        kvp_rank=0, kvp=1, interleave=1, page_size=page, num_decode=len(lens))


CASES = [  # (B, H, Dl, Dr, page, lens, splits, config)
    (2, 16, 64, 16, 16, [77, 5], 3, dict(SWAP=True, BLOCK_N=16)),
    (2, 16, 64, 16, 16, [77, 5], 3, dict(SWAP=False, BLOCK_N=16)),
    (1, 5, 48, 8, 8, [33], None, dict(BLOCK_N=16, min_tokens=16)),        # padded heads / dims
    (3, 32, 32, 16, 32, [0, 64, 1], 2, dict(SWAP=True, BLOCK_N=32)),      # empty, one token
    (1, 16, 512, 64, 64, [130], 2, dict(BLOCK_N=32)),                     # DeepSeek's widths
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-h{c[1]}-dl{c[2]}-s{c[6]}-"
                         + ",".join(f"{k}={v}" for k, v in c[7].items()))
def test_few_heads_matches_torch(case, dtype):
    B, H, Dl, Dr, page, lens, splits, config = case
    gen = torch.Generator().manual_seed(B * 100 + H + sum(lens))
    meta = _meta(lens, page, 24, gen)
    kv = torch.randn(24, page, Dl + Dr, generator=gen).to(DEV, dtype)
    q = torch.randn(B, H, Dl + Dr, generator=gen).to(DEV, dtype)
    ql, qr = q.split([Dl, Dr], dim=-1)                             # non-contiguous views
    o, lse = triton_mla_few.mla_decode_few(ql, qr, kv, meta.block_tables, meta.kv_lens, 0.3,
                                           num_splits=splits, config=config)
    ro, rl = TorchAttention().attend_mla(ql, qr, kv, Dl, meta, 0.3)
    assert o.dtype == dtype and o.shape == (B, H, Dl) and not torch.isnan(o).any()
    torch.testing.assert_close(o.float(), ro.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    fin = torch.isfinite(rl)
    torch.testing.assert_close(lse[fin], rl[fin], atol=1e-4, rtol=1e-4)


def test_plan_and_routing(monkeypatch):
    with pytest.raises(ValueError, match="unknown few-heads MLA tunables"):
        triton_mla_few.few_plan(1, 16, 512, 64, torch.bfloat16, 1024, torch.device("cpu"),
                                {"BLOCK_H": 16})
    with pytest.raises(ValueError, match="split_policy"):
        triton_mla_few.few_plan(1, 16, 512, 64, torch.bfloat16, 1024, torch.device("cpu"),
                                {"split_policy": "many"})
    cfg, splits, _ = triton_mla_few.few_plan(1, 16, 512, 64, torch.bfloat16, 32768,
                                             torch.device("cpu"))
    assert cfg["SWAP"] and cfg["BLOCK_H"] == 16 and splits >= 1
    calls = []
    monkeypatch.setattr(triton_mla_few, "mla_decode_few", lambda *a, **k: calls.append(a) or "few")
    args = (torch.zeros(1, 16, 16), torch.zeros(1, 16, 16), torch.zeros(2, 16, 32),
            torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1)
    monkeypatch.setattr(triton_mla_few, "MODE", "")          # the default: 16 heads go there
    assert triton_mla.mla_decode(*args) == "few" and len(calls) == 1
    monkeypatch.setattr(triton_mla_few, "MODE", "0")
    triton_mla.mla_decode(*[a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args])
    assert len(calls) == 1                                        # off: the 128-head kernel


_COMPILE_SCRIPT = textwrap.dedent("""
    import json
    from unittest import mock
    import torch
    from helix.attention import triton_mla_few as few, triton_splits
    from profiling.kernel_resources import compile_sm90
    m = dict(device="meta")
    launches = []
    rec = lambda k, g, *a, **kw: launches.append((k, a, kw))
    with mock.patch.object(few, "run_kernel", rec), \
            mock.patch.object(triton_splits, "run_kernel", rec):
        for swap in (True, False):
            ql = torch.empty(1, 16, 512, dtype=torch.bfloat16, **m)
            qr = torch.empty(1, 16, 64, dtype=torch.bfloat16, **m)
            kv = torch.empty(1024, 64, 576, dtype=torch.bfloat16, **m)
            few.mla_decode_few(ql, qr, kv, torch.empty(1, 512, dtype=torch.int32, **m),
                               torch.empty(1, dtype=torch.int32, **m), 0.07, num_splits=64,
                               config=dict(SWAP=swap))
    print(json.dumps([compile_sm90(k, a, kw) for k, a, kw in launches
                      if k.fn.__name__ == "_mla_few_kernel"]))
""")


@pytest.mark.sm90
def test_few_heads_compiles_for_sm90(tmp_path):
    """DeepSeek-V2-Lite's rank (16 heads, Dl 512, Dr 64, bf16): both orientations compile for
    sm_90 without spills within one block's shared memory; swapped, the products are wgmma."""
    from profiling.kernel_resources import SM90_SMEM_LIMIT
    res = sm90_compile.run(tmp_path, ["-c", _COMPILE_SCRIPT], timeout=600, fp_fusion=True)
    swap, plain = json.loads(res.stdout.strip().splitlines()[-1])
    for r in (swap, plain):
        assert r["local_loads"] == 0 and r["shared_bytes"] <= SM90_SMEM_LIMIT, r
    assert swap["hgmma"] > 0, swap
