"""Triton kernels against the torch reference: decode (GQA, MLA), KV append, the exchange's
pack / merge, the TritonAttention backend end to end over simulated KVP ranks, 64-bit offsets,
and the production launches compiled for sm_90 (no GPU needed).

Without CUDA the kernels run through Triton's interpreter. TRITON_INTERPRET must be set before
triton is first imported (triton.jit reads it at decoration, triton's own library included):
this module sets it at its top, and .ci/run exports TRITON_INTERPRET=1 for the whole suite. If
triton was imported earlier in the process without it, collection fails here naming that fix.
The interpreter (triton 3.9) computes bf16 dot products wrongly, so bf16 decode runs only on a
GPU, where this same module runs the compiled kernels (bf16 included) if TRITON_INTERPRET is
unset."""

import os

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

import sm90_compile  # noqa: E402

import inspect  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402


from helix.attention import merge as torch_merge  # noqa: E402
from helix.attention import (triton_append, triton_backend, triton_decode,  # noqa: E402
                             triton_merge, triton_mla, triton_splits)
from helix.attention.torch_ref import TorchAttention  # noqa: E402
from helix.kv.manager import KVManager, LocalKVMeta  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def _decode_meta(lens: list[int], page: int, num_pages: int, gen: torch.Generator) -> LocalKVMeta:
    """Decode metadata for len(lens) sequences with random (disjoint) pages; query at the end."""
    B = len(lens)
    width = max([1] + [-(-n // page) for n in lens]) + 1           # spare column, like a bucket
    perm = torch.randperm(num_pages, generator=gen)[:B * width].view(B, width)
    return LocalKVMeta(
        slots=torch.full((B,), -1, dtype=torch.int64, device=DEV),
        block_tables=perm.int().to(DEV), kv_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        cu_q=torch.arange(B + 1, dtype=torch.int32, device=DEV),
        q_pos=torch.tensor([n - 1 for n in lens], dtype=torch.int64, device=DEV).clamp(min=0),
        kvp_rank=0, kvp=1, interleave=1, page_size=page, num_decode=len(lens))


def _close(out, ref, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _lse_close(lse, ref):
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), (lse, ref)
    fin = torch.isfinite(ref)
    torch.testing.assert_close(lse[fin], ref[fin], atol=1e-4, rtol=1e-4)


# -- the split heuristic --------------------------------------------------------------------

def test_choose_num_splits():
    s = triton_splits.choose_num_splits
    for batch in (1, 2, 8, 64):
        for ctx in (16, 4096, 65536, 1 << 19):
            n = s(batch, 8, ctx, 132)
            assert n >= 1 and n & (n - 1) == 0 and n <= 64
            assert n == 1 or ctx // n >= 256                 # splits stay >= min_tokens long
    assert s(1, 8, 65536, 132) >= 32                         # batch 1 long context: fill the GPU
    assert s(64, 8, 65536, 132) == 1                         # big batch: enough programs already
    assert s(1, 8, 100, 132) == 1                            # short context: no split
    assert s(1, 2, 1 << 16, 132, min_tokens=1024) == 64


# -- GQA decode ------------------------------------------------------------------------------

GQA_CASES = [  # (B, Hq, Hkv, d, page, lens, splits, block_n)
    (3, 8, 8, 32, 16, [1, 16, 17], None, None),              # MHA, page boundary +- 1
    (4, 16, 4, 16, 8, [0, 33, 7, 64], None, None),           # group 4, an empty shard
    (2, 8, 1, 64, 16, [31, 0], 4, None),                     # group 8 (MQA), odd length
    (2, 16, 2, 24, 32, [95, 64], 3, 16),                     # d not a power of two, 3 splits
    (2, 4, 2, 32, 4, [13, 5], 2, 16),                        # pages smaller than the block
    (1, 8, 2, 16, 16, [0], 2, None),                         # everything empty
    (2, 16, 2, 40, 16, [70, 33], 4, 16),                     # group 8, d 40: the one-launch
]                                                            # merge in 2 masked column chunks


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GQA_CASES, ids=lambda c: f"B{c[0]}-hq{c[1]}-hkv{c[2]}-d{c[3]}"
                         f"-p{c[4]}-s{c[6]}")
def test_gqa_decode(case, dtype, fused, monkeypatch):
    """Against the torch reference; the splits merged in the split launch (its last program of
    a (batch, KV head)) or by the second kernel."""
    monkeypatch.setattr(triton_decode, "FUSED_MERGE", fused)
    B, hq, hkv, d, page, lens, splits, block_n = case
    gen = torch.Generator().manual_seed(B * 1000 + sum(lens))
    P = 40
    meta = _decode_meta(lens, page, P, gen)
    k = torch.randn(P, page, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(P, page, hkv, d, generator=gen).to(DEV, dtype)
    q = torch.randn(B, hq, 2 * d, generator=gen).to(DEV, dtype)[..., ::2]    # strided view
    o, lse = triton_decode.gqa_decode(q, k, v, meta.block_tables, meta.kv_lens, d ** -0.5,
                                      num_splits=splits, block_n=block_n)
    ro, rl = TorchAttention().attend_gqa(q, k, v, meta, d ** -0.5)
    assert o.dtype == dtype and o.shape == (B, hq, d) and not torch.isnan(o).any()
    _close(o, ro, dtype)
    _lse_close(lse, rl)
    empty = meta.kv_lens == 0
    assert torch.all(lse[empty] == float("-inf")) and torch.all(o[empty] == 0)


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launch"])
def test_gqa_short_sequences_in_a_wide_table(fused, monkeypatch):
    """Default splits from a wide block table (the static count of a graph bucket: 8 at 132
    SMs) over short and empty sequences: the splits past a sequence's tokens are empty (the
    one-launch merge does not read them); the arrival counters are all zero after each launch,
    and a second launch gives bitwise the same result."""
    from helix.triton_util import arrival_counters
    monkeypatch.setattr(triton_decode, "FUSED_MERGE", fused)
    monkeypatch.setattr(triton_decode, "sm_count_of", lambda device: 132)
    gen = torch.Generator().manual_seed(7)
    page, hkv, group, d = 16, 2, 4, 32
    lens = [300, 0, 129, 1024]
    meta = _decode_meta(lens, page, 300, gen)
    bt = torch.cat([meta.block_tables, torch.randint(0, 300, (4, 96 - meta.block_tables.shape[1]),
                                                     generator=gen).int().to(DEV)], dim=1)
    assert triton_decode.gqa_num_splits(4, hkv, bt.shape[1] * page, torch.device(DEV)) == 8
    k = torch.randn(300, page, hkv, d, generator=gen).to(DEV)
    v = torch.randn(300, page, hkv, d, generator=gen).to(DEV)
    q = torch.randn(4, hkv * group, d, generator=gen).to(DEV)
    o, lse = triton_decode.gqa_decode(q, k, v, bt, meta.kv_lens, 0.3)
    assert int(arrival_counters(torch.device(DEV), 8).abs().sum()) == 0
    ro, rl = TorchAttention().attend_gqa(q, k, v, meta, 0.3)
    _close(o, ro, torch.float32)
    _lse_close(lse, rl)
    o2, lse2 = triton_decode.gqa_decode(q, k, v, bt, meta.kv_lens, 0.3)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_gqa_merge_in_the_split_launch_only_for_small_tiles(monkeypatch):
    """The one-launch merge is taken while pow2(group) x splits x pow2(d) <= its tile bound
    (Llama-3.1-8B's group of 4 at 8 splits); past it the second kernel merges (a Llama-70B rank's
    group of 8 at 8 splits, Qwen3-235B's group of 16 at 8)."""
    seen = []
    monkeypatch.setattr(triton_decode, "run_kernel",
                        lambda k, grid, *a, **kw: seen.append((k.fn.__name__, kw.get("FUSED"))))
    monkeypatch.setattr(triton_decode, "reduce_splits", lambda *a: seen.append(("merge", None)))
    k = torch.empty(4, 16, 2, 128, device="meta", dtype=torch.bfloat16)
    lens = torch.empty(1, dtype=torch.int32, device="meta")
    bt = torch.empty(1, 4, dtype=torch.int32, device="meta")
    for hq, splits in ((8, 8), (16, 8), (32, 8), (8, 1)):
        q = torch.empty(1, hq, 128, device="meta", dtype=torch.bfloat16)
        triton_decode.gqa_decode(q, k, k, bt, lens, 0.1, num_splits=splits)
    assert seen == [("_gqa_split_kernel", True), ("_gqa_split_kernel", False), ("merge", None),
                    ("_gqa_split_kernel", False), ("merge", None), ("_gqa_split_kernel", False)]


@pytest.mark.parametrize("seed", range(6))
def test_gqa_decode_random_shapes(seed):
    """Random batch, group (1 / 4 / 8), head dim, page size, lengths (0 and page multiples
    included), splits; fp32 and fp16 alternate."""
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    B, hkv, group, d, page = pick([1, 2, 5]), pick([1, 2]), pick([1, 4, 8]), pick([16, 40, 64]), \
        pick([4, 16, 64])
    lens = [pick([0, page, 2 * page - 1, int(torch.randint(1, 150, (1,), generator=gen))])
            for _ in range(B)]
    dtype = (torch.float32, torch.float16)[seed % 2]
    meta = _decode_meta(lens, page, B * (150 // page + 3), gen)
    P = meta.block_tables.max().item() + 1
    k = torch.randn(P, page, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(P, page, hkv, d, generator=gen).to(DEV, dtype)
    q = torch.randn(B, hkv * group, d, generator=gen).to(DEV, dtype)
    o, lse = triton_decode.gqa_decode(q, k, v, meta.block_tables, meta.kv_lens, 0.2,
                                      num_splits=pick([None, 1, 2, 4]))
    ro, rl = TorchAttention().attend_gqa(q, k, v, meta, 0.2)
    _close(o, ro, dtype)
    _lse_close(lse, rl)


def _stub_bench_timing(monkeypatch, bench):
    """bench_attention's ceilings, timer, L2 flush and device queries stubbed for a CPU run."""
    monkeypatch.setattr(bench, "DEVICE", DEV)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench, "matmul_rate", lambda: 1e14)
    monkeypatch.setattr(bench, "L2Flush", lambda: None)
    monkeypatch.setattr(bench, "graph_time_us", lambda fn, iters, flush: (fn(), 10.0)[1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_bench_attention_gqa_splits(monkeypatch, tmp_path):
    """profiling/bench_attention.py times GQA split counts side by side (CPU smoke:
    tiny heads, the kernels in the interpreter on fp32 copies, timing stubbed), keeping every
    record field of the default run."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from profiling import bench_attention as bench
    real = triton_decode.gqa_decode

    def gqa_fp32(q, k, v, *args, **kw):  # the interpreter's bf16 dot is wrong (module doc)
        o, lse = real(q.float(), k.float(), v.float(), *args, **kw)
        return o.to(q.dtype), lse

    monkeypatch.setattr(bench, "GQA", dict(hq=8, hkv=2, d=16))
    monkeypatch.setattr(bench, "gqa_decode", gqa_fp32)
    _stub_bench_timing(monkeypatch, bench)
    monkeypatch.setattr(bench, "sdpa_time", lambda *a, **k: 9.0)
    base = ["bench_attention.py", "--kernels", "gqa", "--batches", "1,2", "--contexts", "128",
            "--page-size", "16", "--mem-cap-gb", "1"]
    out = tmp_path / "variants.json"
    monkeypatch.setattr(sys, "argv", base + ["--out", str(out), "--gqa-splits", "auto,4",
                                             "--gqa-min-tokens", "32"])
    bench.main()
    recs = json.loads(out.read_text())
    got = [(r["batch"], r["num_splits"], r["splits_forced"]) for r in recs]
    auto = [triton_splits.choose_num_splits(b, 2, 128, triton_splits.sm_count_of(
        torch.device(DEV)), min_tokens=32) for b in (1, 2)]
    assert got == [(b, n, f) for b, a in zip((1, 2), auto) for n, f in ((a, False), (4, True))], got
    fields = {"kernel", "batch", "context", "sdpa_us", "shape", "max_err", "time_us", "floor_us",
              "roofline_fraction", "achieved_GBps", "copy_GBps", "matmul_TFLOPs", "bytes",
              "flops", "page_size", "device"}
    assert all(fields <= set(r) and r["sdpa_us"] == 9.0 for r in recs)
    default = tmp_path / "default.json"
    monkeypatch.setattr(sys, "argv", base + ["--out", str(default)])
    bench.main()
    recs = json.loads(default.read_text())
    assert [(r["batch"], r["splits_forced"]) for r in recs] == [(1, False), (2, False)]
    assert all(fields <= set(r) for r in recs)


def test_bench_attention_mla_splits(monkeypatch, tmp_path):
    """--mla-splits times forced split counts beside mla_plan's own choice (CPU smoke)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from profiling import bench_attention as bench
    real = triton_mla.mla_decode

    def mla_fp32(ql, qr, kv, *args, **kw):
        o, lse = real(ql.float(), qr.float(), kv.float(), *args, **kw)
        return o.to(ql.dtype), lse

    monkeypatch.setattr(bench, "MLA", dict(h=4, dl=16, dr=16))
    monkeypatch.setattr(bench, "mla_decode", mla_fp32)
    # dims only the Triton kernel takes: on an sm_90 machine the Gluon kernel is not timed too
    monkeypatch.setattr(bench, "gluon_runs", lambda: False)
    _stub_bench_timing(monkeypatch, bench)
    out = tmp_path / "mla.json"
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--kernels", "mla", "--batches", "1",
                                      "--contexts", "128", "--page-size", "16", "--mem-cap-gb",
                                      "1", "--mla-splits", "auto,2,4", "--out", str(out)])
    bench.main()
    recs = json.loads(out.read_text())
    auto = triton_mla.mla_plan(1, 4, 16, 16, torch.bfloat16, 128, torch.device(DEV))[1]
    assert [(r["num_splits"], r["splits_forced"]) for r in recs] == [(auto, False), (2, True),
                                                                      (4, True)]
    assert all(r["kernel"] == "triton-mla" and r["max_err"] < 0.05 for r in recs)


# -- MLA decode ------------------------------------------------------------------------------

MLA_CASES = [  # (B, H, Dl, Dr, page, lens, splits, block_h)
    (2, 4, 16, 4, 16, [37, 0], None, None),
    (3, 8, 64, 16, 8, [1, 8, 9], 2, None),
    (2, 2, 64, 16, 32, [100, 63], 4, None),
    (1, 20, 32, 8, 16, [50], 1, 16),                         # two head blocks, one masked
    (2, 6, 24, 8, 4, [0, 0], 2, None),                       # all empty
    (1, 16, 512, 64, 64, [70], 2, None),                     # DeepSeek's Dl, Dr
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: f"B{c[0]}-h{c[1]}-dl{c[2]}-dr{c[3]}"
                         f"-p{c[4]}-s{c[6]}")
def test_mla_decode(case, dtype):
    B, H, Dl, Dr, page, lens, splits, block_h = case
    gen = torch.Generator().manual_seed(B * 1000 + sum(lens))
    P = 40
    meta = _decode_meta(lens, page, P, gen)
    kv = torch.randn(P, page, Dl + Dr, generator=gen).to(DEV, dtype)
    q = torch.randn(B, H, Dl + Dr, generator=gen).to(DEV, dtype)
    ql, qr = q.split([Dl, Dr], dim=-1)                                    # non-contiguous views
    o, lse = triton_mla.mla_decode(ql, qr, kv, meta.block_tables, meta.kv_lens, 0.3,
                                   num_splits=splits, block_h=block_h)
    ro, rl = TorchAttention().attend_mla(ql, qr, kv, Dl, meta, 0.3)
    assert o.dtype == dtype and o.shape == (B, H, Dl) and not torch.isnan(o).any()
    _close(o, ro, dtype)
    _lse_close(lse, rl)


@pytest.mark.parametrize("seed", range(4))
def test_mla_decode_random_shapes(seed):
    gen = torch.Generator().manual_seed(200 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    B, H, Dl, Dr, page = pick([1, 3]), pick([2, 5, 8]), pick([16, 64]), pick([4, 16]), pick([8, 32])
    lens = [pick([0, page, int(torch.randint(1, 120, (1,), generator=gen))]) for _ in range(B)]
    dtype = (torch.float32, torch.float16)[seed % 2]
    meta = _decode_meta(lens, page, B * (120 // page + 3), gen)
    P = meta.block_tables.max().item() + 1
    kv = torch.randn(P, page, Dl + Dr, generator=gen).to(DEV, dtype)
    ql = torch.randn(B, H, Dl, generator=gen).to(DEV, dtype)
    qr = torch.randn(B, H, Dr, generator=gen).to(DEV, dtype)
    o, lse = triton_mla.mla_decode(ql, qr, kv, meta.block_tables, meta.kv_lens, 0.25,
                                   num_splits=pick([None, 1, 2, 4]))
    ro, rl = TorchAttention().attend_mla(ql, qr, kv, Dl, meta, 0.25)
    _close(o, ro, dtype)
    _lse_close(lse, rl)


@pytest.mark.parametrize("trend", [1.0, -1.0], ids=["rising", "falling"])
def test_mla_decode_lazy_rescale(trend):
    """Scores that climb (or fall) by far more than 2^8 along the sequence: the lazy running-max
    rescale must still give the exact softmax."""
    gen = torch.Generator().manual_seed(4)
    Dl, Dr, page, n = 32, 8, 16, 150
    meta = _decode_meta([n], page, 16, gen)
    q = torch.randn(1, 4, Dl + Dr, generator=gen)
    kv = torch.randn(16, page, Dl + Dr, generator=gen) * 0.1
    pos = torch.arange(n)
    pages, offs = meta.block_tables[0].long().cpu()[pos // page], pos % page
    kv[pages, offs] += trend * (pos[:, None] / 3.0) * q[0, 0] / q[0, 0].norm()   # logit ~ +-t/3
    kv, q = kv.to(DEV), q.to(DEV)
    o, lse = triton_mla.mla_decode(q[..., :Dl], q[..., Dl:], kv, meta.block_tables, meta.kv_lens,
                                   1.0, num_splits=2)
    ro, rl = TorchAttention().attend_mla(q[..., :Dl], q[..., Dl:], kv, Dl, meta, 1.0)
    _close(o, ro, torch.float32)
    _lse_close(lse, rl)


# The structural variants of the MLA kernel (helix/attention/triton_mla.py's tunables; the GPU
# run of profiling/tune_mla.py compares them): QK^T hidden from the PV dot or chained, eager or
# lazy rescale, row-summed or deferred denominator, tiles smaller than / equal to / larger than
# a page (page-id prefetch vs per-token page ids), and the launcher's split choices.
MLA_VARIANTS = [
    dict(SPLIT_QK=False, RESCALE_LOG2=8.0, DEFER_L=False, BLOCK_N=32),   # the pre-split kernel
    dict(SPLIT_QK=True, RESCALE_LOG2=0.0, DEFER_L=False),
    dict(SPLIT_QK=True, RESCALE_LOG2=8.0, DEFER_L=True),
    dict(SPLIT_QK=True, RESCALE_LOG2=0.0, DEFER_L=True, BLOCK_N=16, num_stages=4),
    dict(SPLIT_QK=False, RESCALE_LOG2=0.0, DEFER_L=True, BLOCK_N=64, num_warps=16),
    dict(split_policy="1wave"),
    dict(split_policy="fill", BLOCK_N=16),
]
MLA_VARIANT_CASES = [  # (B, H, Dl, Dr, page, lens, splits, block_h)
    (3, 8, 64, 16, 16, [1, 40, 77], 2, None),
    (2, 20, 32, 8, 32, [100, 0], 3, 16),                     # two head blocks, an empty row
    (1, 4, 16, 4, 8, [61], None, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("variant", MLA_VARIANTS, ids=lambda v: ",".join(
    f"{k}={v[k]}" for k in sorted(v)))
@pytest.mark.parametrize("case", MLA_VARIANT_CASES, ids=lambda c: f"B{c[0]}-h{c[1]}-p{c[4]}")
def test_mla_decode_variants(case, variant, dtype):
    B, H, Dl, Dr, page, lens, splits, block_h = case
    gen = torch.Generator().manual_seed(7 * B + sum(lens))
    P = 40
    meta = _decode_meta(lens, page, P, gen)
    kv = torch.randn(P, page, Dl + Dr, generator=gen).to(DEV, dtype)
    q = torch.randn(B, H, Dl + Dr, generator=gen).to(DEV, dtype)
    ql, qr = q.split([Dl, Dr], dim=-1)
    o, lse = triton_mla.mla_decode(ql, qr, kv, meta.block_tables, meta.kv_lens, 0.3,
                                   num_splits=splits, block_h=block_h, config=variant)
    ro, rl = TorchAttention().attend_mla(ql, qr, kv, Dl, meta, 0.3)
    assert o.dtype == dtype and not torch.isnan(o).any()
    _close(o, ro, dtype)
    _lse_close(lse, rl)


@pytest.mark.parametrize("variant", MLA_VARIANTS[:4], ids=lambda v: ",".join(
    f"{k}={v[k]}" for k in sorted(v)))
@pytest.mark.parametrize("trend", [1.0, -1.0], ids=["rising", "falling"])
def test_mla_decode_variants_rescale(trend, variant):
    """Logits climbing / falling by far more than 2^8 along the sequence: eager and lazy
    rescale, with the denominator row-summed or deferred, give the exact softmax."""
    gen = torch.Generator().manual_seed(5)
    Dl, Dr, page, n = 32, 8, 16, 150
    meta = _decode_meta([n], page, 16, gen)
    q = torch.randn(1, 4, Dl + Dr, generator=gen)
    kv = torch.randn(16, page, Dl + Dr, generator=gen) * 0.1
    pos = torch.arange(n)
    pages, offs = meta.block_tables[0].long().cpu()[pos // page], pos % page
    kv[pages, offs] += trend * (pos[:, None] / 3.0) * q[0, 0] / q[0, 0].norm()
    kv, q = kv.to(DEV), q.to(DEV)
    o, lse = triton_mla.mla_decode(q[..., :Dl], q[..., Dl:], kv, meta.block_tables,
                                   meta.kv_lens, 1.0, num_splits=2,
                                   config=dict(variant, BLOCK_N=16))
    ro, rl = TorchAttention().attend_mla(q[..., :Dl], q[..., Dl:], kv, Dl, meta, 1.0)
    _close(o, ro, torch.float32)
    _lse_close(lse, rl)


def test_mla_decode_half_precision_partials():
    """partial_dtype: the split partials stored in fp16 (bf16 on the GPU) stay within the
    output dtype's tolerance."""
    gen = torch.Generator().manual_seed(11)
    B, H, Dl, Dr, page, lens = 2, 8, 64, 16, 16, [150, 33]
    meta = _decode_meta(lens, page, 40, gen)
    kv = torch.randn(40, page, Dl + Dr, generator=gen).to(DEV, torch.float16)
    ql = torch.randn(B, H, Dl, generator=gen).to(DEV, torch.float16)
    qr = torch.randn(B, H, Dr, generator=gen).to(DEV, torch.float16)
    o, lse = triton_mla.mla_decode(ql, qr, kv, meta.block_tables, meta.kv_lens, 0.2,
                                   num_splits=4, config=dict(partial_dtype=torch.float16))
    ro, rl = TorchAttention().attend_mla(ql, qr, kv, Dl, meta, 0.2)
    _close(o, ro, torch.float16)
    _lse_close(lse, rl)


def test_mla_tunables_validated_and_planned():
    dev = torch.device("cpu")
    with pytest.raises(ValueError, match="unknown MLA tunables"):
        triton_mla.mla_plan(1, 128, 512, 64, torch.bfloat16, 4096, dev, dict(BLOCKN=64))
    with pytest.raises(ValueError, match="split_policy"):
        triton_mla.mla_plan(1, 128, 512, 64, torch.bfloat16, 4096, dev,
                            dict(split_policy="many"))
    cfg, splits, pdt = triton_mla.mla_plan(8, 128, 512, 64, torch.bfloat16, 65536, dev)
    assert cfg["BLOCK_H"] == 64 and cfg["SPLIT_QK"] and pdt == torch.float32
    assert "split_policy" not in cfg and "partial_dtype" not in cfg     # launcher-only keys
    sms = triton_splits.sm_count_of(dev)
    assert splits == triton_splits.choose_num_splits(8, 2, 65536, sms)
    for policy, expect in (("1wave", triton_splits.choose_num_splits(8, 2, 65536, sms, waves=1.0,
                                                                      round_up=False)),
                           ("fill", triton_splits.fill_num_splits(8, 2, 65536, sms))):
        _, s1, pdt = triton_mla.mla_plan(8, 128, 512, 64, torch.bfloat16, 65536, dev,
                                         dict(split_policy=policy, partial_dtype=torch.bfloat16))
        assert pdt == torch.bfloat16 and s1 == expect


@pytest.mark.parametrize("min_chunk", [0, 128])
@pytest.mark.parametrize("lens", [[0, 1, 64, 65, 300, 1000], [128] * 3], ids=str)
def test_reduce_splits_skips_the_splits_a_kernel_left_empty(lens, min_chunk):
    """reduce_splits with kv_lens and block_n reads only the splits split_range's chunks (of at
    least min_chunk tokens) give tokens (the Gluon MLA kernel writes nothing for the others):
    partials of empty splits poisoned with NaN change nothing, and it equals the merge of the
    live splits alone."""
    S, H, D, block_n = 8, 3, 40, 64
    gen = torch.Generator().manual_seed(11)
    B = len(lens)
    kl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    o_ws = torch.randn(B, H, S, D, generator=gen).to(DEV)
    lse_ws = torch.randn(B, H, S, generator=gen).to(DEV)
    live = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(lens):
        chunk = max(-(-(-(-n // S)) // block_n) * block_n, min_chunk)
        live[b] = torch.arange(S) * chunk < n
    dead = (~live)[:, None, :].expand(B, H, S).to(DEV)
    o_ws[dead] = float("nan")
    lse_ws[dead] = float("nan")
    o = torch.empty(B, H, D, device=DEV)
    lse = torch.empty(B, H, device=DEV)
    triton_splits.reduce_splits(o_ws, lse_ws, o, lse, kl, block_n, min_chunk)
    ref_l = torch.where(live[:, None, :].to(DEV), lse_ws, float("-inf"))
    want_lse = torch.logsumexp(ref_l, dim=-1)
    w = torch.nan_to_num(torch.exp(ref_l - want_lse[..., None]), nan=0.0)
    want_o = (w[..., None] * torch.nan_to_num(o_ws, nan=0.0)).sum(2)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin], want_lse[fin], atol=1e-5, rtol=1e-5)
    empty = torch.tensor([n == 0 for n in lens], device=DEV)
    assert (o[empty] == 0).all()


def test_split_policies():
    s, fill = triton_splits.choose_num_splits, triton_splits.fill_num_splits
    for batch in (1, 2, 4, 8, 16, 64):      # two head blocks, one program per SM: one wave
        n = s(batch, 2, 1 << 20, 132, waves=1.0, round_up=False)
        assert n & (n - 1) == 0 and batch * 2 * n <= 132 and (batch * 4 * n > 132 or n == 1)
        assert fill(batch, 2, 1 << 20, 132) == n
    assert s(8, 2, 65536, 132, waves=1.0, round_up=False) == 8
    assert s(8, 2, 65536, 132) == 32                          # the default: 2 waves, round up
    assert s(3, 2, 65536, 132, waves=1.0, round_up=False) == 16          # 96 programs: 73 %
    assert fill(3, 2, 65536, 132) == 64                       # 384 programs in 3 waves: 97 %
    assert fill(5, 2, 65536, 132) == 64                       # 640 in 5 waves: 97 %
    assert fill(1, 2, 4096, 132) == 16                        # capped: >= 256 tokens a split
    assert fill(1, 2, 100, 132) == 1
    for batch in range(1, 70):
        n = fill(batch, 2, 1 << 20, 132)
        assert n & (n - 1) == 0 and 1 <= n <= 64


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="interpreter smoke run for CPU CI; on a GPU run tune_mla.py itself "
                           "(triton 3.6's interpreter cannot run two of its configs)")
def test_tune_mla_smoke(tmp_path):
    """profiling/tune_mla.py end to end on the interpreter (tiny shapes, two configs)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "tune.json"
    res = subprocess.run([sys.executable, os.path.join(root, "profiling", "tune_mla.py"),
                          "--smoke", "--out", str(out), "--configs",
                          "old-bn32-dupqk,split-bn64-fill-bf16part"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert not data["failures"] and len(data["records"]) == 2 * len(data["shapes"])
    assert data["best"]["name"] in ("old-bn32-dupqk", "split-bn64-fill-bf16part")
    assert "BEST" in res.stdout


# -- KV append -------------------------------------------------------------------------------

@pytest.mark.parametrize("inner", [(2, 8), (3, 24), (20,)], ids=str)   # GQA [Hkv, d], MLA [Dl+Dr]
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_append_kv(inner, dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 4, *inner, generator=gen).to(DEV, dtype)
    rows = torch.randn(7, *inner, generator=gen).to(DEV)                  # fp32 rows: cast
    slots = torch.tensor([5, -1, 0, 23, -1, 12, 4], dtype=torch.int64, device=DEV)
    ref = cache.clone()
    TorchAttention().append_kv(ref, rows, slots)
    triton_append.append_kv(cache, rows, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_append_kv_pair_equals_two_appends(dtype):
    """K and V in one launch; V a strided view of a fused projection, as the GQA layer passes it."""
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(6, 4, 2, 8, generator=gen).to(DEV, dtype)
    v_cache = torch.randn(6, 4, 2, 8, generator=gen).to(DEV, dtype)
    k = torch.randn(5, 2, 8, generator=gen).to(DEV, dtype)
    v = torch.randn(5, 48, generator=gen).to(DEV, dtype)[:, 16:32].view(5, 2, 8)   # strided rows
    slots = torch.tensor([3, -1, 22, 0, -1], dtype=torch.int64, device=DEV)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    TorchAttention().append_kv_pair(ref_k, ref_v, k, v, slots)
    triton_append.append_kv_pair(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# -- the exchange: pack and merge ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_pack_partials_bit_identical(dtype, n):
    gen = torch.Generator().manual_seed(n)
    T, H, d = 3, 8, 20
    o = torch.randn(T, H, 2 * d, generator=gen).to(DEV, dtype)[..., :d]    # strided
    lse = torch.randn(T, H, generator=gen).to(DEV) * 10
    lse[0, 1], lse[1, :], lse[2, 3], lse[2, 4] = float("-inf"), float("-inf"), float("nan"), 3e38
    ours, ref = triton_merge.pack_partials(o, lse, n), torch_merge.pack_partials(o, lse, n)
    assert ours.shape == ref.shape == (n, T, H // n, d + ref.shape[-1] - d)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


def _recv(dtype, n, T, h, d, gen, empty_frac=0.3):
    """n partials as the all-to-all delivers them; empty partials (LSE -inf) carry O = 0."""
    o = torch.randn(n, T, h, d, generator=gen)
    lse = torch.randn(n, T, h, generator=gen) * 4
    empty = torch.rand(n, T, h, generator=gen) < empty_frac
    empty[:, 0, 0] = True                                                  # an all-empty row
    lse[empty] = float("-inf")
    o[empty] = 0
    return torch.stack([torch_merge.pack_partials(o[i].to(DEV, dtype), lse[i].to(DEV), 1)[0]
                        for i in range(n)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_merge_received(dtype, n):
    gen = torch.Generator().manual_seed(10 + n)
    T, h, d = 4, 5, 24
    recv = _recv(dtype, n, T, h, d, gen)
    ours = triton_merge.merge_received(recv, d)
    ref = torch_merge.merge_partials(*torch_merge.unpack_partials(recv, d))[0]
    assert ours.dtype == dtype and not torch.isnan(ours).any()
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=atol)
    assert torch.all(ours[0, 0] == 0)


def test_merge_received_ignores_empty_and_bad_partials():
    """-inf (and NaN / +inf) partials contribute exactly nothing, whatever their O holds."""
    T, h, d = 2, 3, 8
    o = torch.randn(3, T, h, d)
    lse = torch.tensor([1.5, float("-inf"), float("nan")]).view(3, 1, 1).expand(3, T, h).clone()
    lse[:, 1, 2] = torch.tensor([float("-inf"), float("inf"), float("-inf")])   # all-empty row
    recv = torch.stack([torch_merge.pack_partials(o[i].to(DEV), lse[i].to(DEV), 1)[0]
                        for i in range(3)])
    out = triton_merge.merge_received(recv, d).cpu()
    assert torch.equal(out[0], o[0, 0])                                    # exact: weight 1
    assert torch.equal(out[1, :2], o[0, 1, :2])
    assert torch.all(out[1, 2] == 0)


# -- the backend end to end: KVP ranks simulated in one process -------------------------------

def _to_dev(meta: LocalKVMeta) -> LocalKVMeta:
    return LocalKVMeta(**{k: (v.to(DEV) if torch.is_tensor(v) else v)
                          for k, v in vars(meta).items()})


def _rank_step(prompt_lens, kvp, rank, interleave, page):
    """Prefill every sequence, then one decode step, on KVP rank `rank`: (slots of the prefill
    rows, the decode meta)."""
    kv = KVManager(64, page, rank, kvp, interleave)
    pre = kv.prepare([(i, 0, n) for i, n in enumerate(prompt_lens)], "cpu")
    dec = kv.prepare([(i, n, 1) for i, n in enumerate(prompt_lens)], "cpu")
    return pre.slots.to(DEV), _to_dev(dec)


def _exchange(backend, parts, d):
    """parts: each rank's (o [T, H, d], lse [T, H]) -> each rank's merged o [T, H/kvp, d]."""
    n = len(parts)
    sends = [backend.pack_partials(o, lse, n) for o, lse in parts]
    return [backend.merge_received(torch.stack([s[j] for s in sends]), d) for j in range(n)]


@pytest.mark.parametrize("kvp,interleave", [(1, 1), (2, 1), (3, 4)])
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_backend_decode_over_kvp_ranks(kvp, interleave, mla):
    """append + attend + pack + merge over kvp simulated ranks == full attention (torch, kvp 1).
    The prompt lengths leave some ranks with no token of a sequence (LSE -inf there)."""
    gen = torch.Generator().manual_seed(kvp * 7 + interleave)
    page, dtype, H, dl = 4, torch.float32, 12, 16
    prompt_lens = [0, 1, 6, 13]
    B = len(prompt_lens)
    inner = (dl + 4,) if mla else (2, 8)                    # MLA [Dl + Dr]; GQA [Hkv, d]
    seq_rows = torch.randn(B, max(prompt_lens) + 1, *inner, generator=gen).to(DEV, dtype)
    prefill_rows = torch.cat([seq_rows[i, :n] for i, n in enumerate(prompt_lens)])
    decode_rows = torch.stack([seq_rows[i, n] for i, n in enumerate(prompt_lens)])
    q = torch.randn(B, H, inner[-1], generator=gen).to(DEV, dtype)

    def run(backend, kvp_, rank):
        pre_slots, meta = _rank_step(prompt_lens, kvp_, rank, interleave, page)
        caches = [torch.zeros((64, page, *inner), dtype=dtype, device=DEV)
                  for _ in range(1 if mla else 2)]
        for c_i, c in enumerate(caches):                    # V = 2 K: distinct caches
            backend.append_kv(c, prefill_rows * (c_i + 1), pre_slots)
            backend.append_kv(c, decode_rows * (c_i + 1), meta.slots)
        if mla:
            return backend.attend_mla(q[..., :dl], q[..., dl:], caches[0], dl, meta, 0.4)
        return backend.attend_gqa(q, caches[0], caches[1], meta, 0.4)

    want_o, want_lse = run(TorchAttention(), 1, 0)
    tri = triton_backend.TritonAttention()
    parts = [run(tri, kvp, r) for r in range(kvp)]
    d = dl if mla else inner[-1]
    merged = torch.cat(_exchange(tri, parts, d), dim=1) if kvp > 1 else parts[0][0]
    torch.testing.assert_close(merged, want_o, atol=2e-5, rtol=2e-5)
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    _lse_close(lse, want_lse)


def test_backend_prefill_matches_torch():
    """Prefill rows go to the flash prefill kernel (tests/test_triton_prefill.py covers it)."""
    gen = torch.Generator().manual_seed(5)
    kv = KVManager(16, 4, 0, 1, 1)
    meta = _to_dev(kv.prepare([(0, 0, 5), (1, 0, 3)], "cpu"))
    k = torch.randn(16, 4, 2, 8, generator=gen).to(DEV)
    v = torch.randn(16, 4, 2, 8, generator=gen).to(DEV)
    q = torch.randn(8, 4, 8, generator=gen).to(DEV)
    ours = triton_backend.TritonAttention().attend_gqa(q, k, v, meta, 0.5)
    ref = TorchAttention().attend_gqa(q, k, v, meta, 0.5)
    torch.testing.assert_close(ours[0], ref[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours[1], ref[1], atol=2e-5, rtol=2e-5)


# -- flash-attn (GPU machines with flash_attn installed) -------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_backend_decode():
    pytest.importorskip("flash_attn")
    from helix.attention.flash_backend import FlashAttention
    from helix.errors import ConfigError
    gen = torch.Generator().manual_seed(8)
    page, P = 256, 8
    meta = _decode_meta([300, 0, 1], page, P, gen)
    k = torch.randn(P, page, 2, 64, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(P, page, 2, 64, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(3, 8, 64, generator=gen).to("cuda", torch.bfloat16)
    o, lse = FlashAttention().attend_gqa(q, k, v, meta, 0.125)
    ro, rl = TorchAttention().attend_gqa(q, k, v, meta, 0.125)
    _close(o, ro, torch.bfloat16)
    _lse_close(lse, rl)
    small = _decode_meta([3], 16, P, gen)
    with pytest.raises(ConfigError, match="page-size"):
        FlashAttention().attend_gqa(q[:1], k.view(-1, 16, 2, 64), v.view(-1, 16, 2, 64), small,
                                    1.0)


# -- 64-bit offsets ---------------------------------------------------------------------------

def test_page_offsets_are_int64_in_source():
    """Every page / slot id is widened to int64 before it multiplies a stride."""
    rows_src = inspect.getsource(triton_splits.token_rows.fn)
    assert rows_src.count(".to(tl.int64)") >= 3 and "page * stride_page" in rows_src
    for kernel in (triton_decode._gqa_split_kernel, triton_mla._mla_split_kernel):
        src = inspect.getsource(kernel.fn)
        assert "token_rows(" in src and "tl.program_id(2).to(tl.int64)" in src
    assert "slot = tl.load(slots_ptr + t).to(tl.int64)" in inspect.getsource(
        triton_append._append_kernel.fn)


_BIG_POOL_SCRIPT = textwrap.dedent("""
    import os, sys
    if sys.argv[1] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from helix.attention import triton_append, triton_decode, triton_mla
    dev = sys.argv[1]
    torch.manual_seed(0)
    def pages_at_end(P, n):          # the last pages of a pool of P pages, shuffled
        return (P - 1 - torch.randperm(n)).int().view(1, n).to(dev)
    # MLA: [P, 16, 32] fp16 with P * 512 > 2^31 elements; only the touched pages are committed
    page, Dl, Dr = 16, 16, 16
    P = 2**31 // (page * (Dl + Dr)) + 8
    kv = torch.empty((P, page, Dl + Dr), dtype=torch.float16, device=dev)
    assert kv.numel() > 2**31
    bt = pages_at_end(P, 3)
    slots = (bt[0].long()[:, None] * page + torch.arange(page, device=dev)).reshape(-1)[:40]
    rows = torch.randn(40, Dl + Dr, device=dev).half()
    triton_append.append_kv(kv, rows, slots)
    ql, qr = torch.randn(1, 4, Dl, device=dev).half(), torch.randn(1, 4, Dr, device=dev).half()
    lens = torch.tensor([40], dtype=torch.int32, device=dev)
    o, lse = triton_mla.mla_decode(ql, qr, kv, bt, lens, 0.25, num_splits=2)
    r = rows.float()
    s = (ql[0].float() @ r[:, :Dl].T + qr[0].float() @ r[:, Dl:].T) * 0.25
    assert (o[0].float() - torch.softmax(s, -1) @ r[:, :Dl]).abs().max() < 2e-3
    assert (lse[0] - torch.logsumexp(s, -1)).abs().max() < 1e-4
    del kv
    # GQA: k, v [P, 16, 1, 16] fp16 with > 2^31 elements each
    P = 2**31 // (page * 16) + 8
    k = torch.empty((P, page, 1, 16), dtype=torch.float16, device=dev)
    v = torch.empty_like(k)
    bt = pages_at_end(P, 3)
    slots = (bt[0].long()[:, None] * page + torch.arange(page, device=dev)).reshape(-1)[:40]
    kr, vr = torch.randn(40, 1, 16, device=dev).half(), torch.randn(40, 1, 16, device=dev).half()
    triton_append.append_kv(k, kr, slots)
    triton_append.append_kv(v, vr, slots)
    q = torch.randn(1, 4, 16, device=dev).half()
    o, lse = triton_decode.gqa_decode(q, k, v, bt, lens, 0.25, num_splits=2)
    s = (q[0].float() @ kr[:, 0].float().T) * 0.25
    assert (o[0].float() - torch.softmax(s, -1) @ vr[:, 0].float()).abs().max() < 2e-3
    print("ok")
""")


def _run_big_pool(dev: str):
    # a subprocess: with 32-bit offsets the kernels would read wild addresses and crash
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # script decides
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    res = subprocess.run([sys.executable, "-c", _BIG_POOL_SCRIPT, dev], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="the GPU variant below covers it")
def test_pool_over_2_31_elements_cpu():
    """A real pool of > 2^31 elements on CPU: torch.empty only reserves address space, and the
    interpreter touches just the pages used, placed at the end of the pool."""
    _run_big_pool("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_over_2_31_elements_gpu():
    _run_big_pool("cuda")


# -- the production launches compile for Hopper ------------------------------------------------

@pytest.mark.sm90
def test_kernels_compile_for_sm90(tmp_path):
    """What the interpreter cannot check: every production launch (Llama-70B GQA, DeepSeek MLA,
    append, exchange, ...) compiles for sm_90 with triton's bundled ptxas, fits a block's shared
    memory, barely spills, and the MLA kernel issues wgmma. No GPU needed."""
    from profiling.kernel_resources import SM90_SMEM_LIMIT
    out = tmp_path / "resources.json"
    sm90_compile.run(tmp_path, [os.path.join(sm90_compile.ROOT, "profiling", "kernel_resources.py"),
                                "--json", str(out)], timeout=600, fp_fusion=True)
    records = json.loads(out.read_text())
    assert {r["kernel"] for r in records} >= {"_gqa_split_kernel", "_mla_split_kernel",
                                              "_reduce_splits_kernel", "_append_kernel",
                                              "_pack_kernel", "_merge_kernel"}
    for r in records:
        assert r["shared_bytes"] <= SM90_SMEM_LIMIT, r
        assert r["stack_bytes"] <= 64, r                  # no real register spills
    # the GQA launch merges its splits itself (Llama-70B rank, 4 splits) and still holds 4
    # programs an SM (<= 128 registers a thread at 4 warps): choose_num_splits' one wave
    gqa = [r for r in records
           if r["case"] == "gqa-llama70b" and r["kernel"] == "_gqa_split_kernel"]
    assert gqa and gqa[0]["constexprs"]["FUSED"] and gqa[0]["registers"] <= 128, gqa
    short = [r for r in records if r["case"] == "prefill-short-chunk"]
    assert [r["kernel"] for r in short] == ["_prefill_kernel", "_reduce_splits_kernel"]
    assert short[0]["constexprs"]["NUM_SPLITS"] > 1               # KV split, then merged
    mla = [r for r in records
           if r["case"] == "mla-deepseek-v3" and r["kernel"] == "_mla_split_kernel"]
    assert mla and mla[0]["hgmma"] > 0, mla                # tensor cores through wgmma
    # QK^T split across the two warpgroups, not computed twice: (512 + 64) / 16 = 36 QK^T
    # wgmma per tile (72 when both warpgroups compute the same S), beside the PV's m64n256
    # wgmma per tile (72 when both warpgroups compute the same S), beside the PV's m64n256;
    # the default TMA kernel has two loop bodies (full tiles, then the masked partial tile)
    bodies = 2 if triton_mla.mla_launch_config(128, 512, 64, torch.bfloat16)["USE_TMA"] else 1
    qk = sum(n for shape, n in mla[0]["hgmma_shapes"].items() if not shape.startswith("64x256"))
    assert qk == 36 * bodies and "64x256x16" in mla[0]["hgmma_shapes"], mla


@pytest.mark.parametrize("B,hq,hkv,d,ctx,want", [
    (1, 8, 2, 16, 64, 1),          # one split
    (1, 16, 1, 16, 1024, 1),       # 4 splits merged in the split launch
    (1, 32, 1, 64, 1024, 2),       # 32 x 4 x 64 partial elements: the merge's own launch
    (3, 4, 4, 16, 16, 1)])
def test_gqa_launches_counts_what_gqa_decode_launches(B, hq, hkv, d, ctx, want, monkeypatch):
    """helix.perf.cost's kernel count for GQA decode (triton_decode.gqa_launches) is the
    number of kernels gqa_decode launches at its default splits for a block table of ctx
    positions: 1 (one split, or the merge in the split launch) or 2."""
    page = 16
    launched = []
    real = triton_decode.run_kernel
    monkeypatch.setattr(triton_decode, "run_kernel",
                        lambda k, *a, **kw: launched.append(k) or real(k, *a, **kw))
    real_reduce = triton_decode.reduce_splits
    monkeypatch.setattr(triton_decode, "reduce_splits",
                        lambda *a, **kw: launched.append("reduce") or real_reduce(*a, **kw))
    g = torch.Generator().manual_seed(B * ctx)
    pages = B * ctx // page
    k = torch.randn(pages, page, hkv, d, generator=g).to(DEV)
    v = torch.randn(pages, page, hkv, d, generator=g).to(DEV)
    q = torch.randn(B, hq, d, generator=g).to(DEV)
    bt = torch.arange(pages, dtype=torch.int32).view(B, -1).to(DEV)
    lens = torch.full((B,), ctx, dtype=torch.int32).to(DEV)
    triton_decode.gqa_decode(q, k, v, bt, lens, d ** -0.5)
    sm = triton_decode.sm_count_of(q.device)
    assert len(launched) == want
    assert triton_decode.gqa_launches(B, hq, hkv, d, ctx, sm, torch.float32) == want
