"""The flash prefill kernel (helix/attention/triton_prefill.py) against the torch reference, the
torch flash-attention path's glue (helix/attention/torch_prefill.py), the backend's choice
between them, the MLA prefill forms (helix/layers/mla_prefill.py), and the Triton backend end to
end on prompts several chunks long.

Metadata comes from KVManager itself (prefixes cached by an earlier prepare, ragged chunks,
partial pages, KVP ranks with interleave 1 / 4 / page, shards holding none of a sequence). The
pool is NaN outside the slots the chunks may read and the outputs are poisoned first, so a read
past a length or a row left unwritten shows. Without CUDA the kernels run in Triton's
interpreter, whose bf16 dot products are wrong (triton 3.9): fp32 and fp16 here."""

import os

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.attention import torch_prefill, triton_backend, triton_prefill  # noqa: E402
from helix.attention.torch_ref import TorchAttention  # noqa: E402
from helix.kv.manager import KVManager, LocalKVMeta  # noqa: E402
from helix.layers import mla_prefill  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
POOL = 48


def _meta(chunks, page, kvp=1, rank=0, interleave=1) -> LocalKVMeta:
    """chunks: (cached prefix, new tokens) per sequence -> this rank's metadata of the step that
    prefills the new tokens (the prefixes written by an earlier step)."""
    kv = KVManager(POOL, page, rank, kvp, interleave)
    cached = [(i, 0, p) for i, (p, _) in enumerate(chunks) if p]
    if cached:
        kv.prepare(cached, "cpu")
    meta = kv.prepare([(i, p, n) for i, (p, n) in enumerate(chunks)], "cpu")
    return LocalKVMeta(**{k: (v.to(DEV) if torch.is_tensor(v) else v)
                          for k, v in vars(meta).items()})


def _pool(meta, inner, dtype, gen):
    """A pool [POOL, page, *inner]: random in every sequence's first kv_len local slots, NaN
    elsewhere (other pages, the tail of partial pages)."""
    page = meta.page_size
    pool = torch.full((POOL * page, *inner), float("nan"))
    for s, n in enumerate(meta.kv_lens.tolist()):
        j = torch.arange(n)
        slots = meta.block_tables[s].long().cpu()[j // page] * page + j % page
        pool[slots] = torch.randn(n, *inner, generator=gen)
    return pool.view(POOL, page, *inner).to(DEV, dtype)


def _poisoned(T, H, dv, dtype):
    return (torch.full((T, H, dv), float("nan"), dtype=dtype, device=DEV),
            torch.full((T, H), float("nan"), device=DEV))


def _check(o, lse, ref_o, ref_lse, dtype):
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    tol = TOL[dtype]
    torch.testing.assert_close(o.float(), ref_o.float(), atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
    assert torch.all(o[~fin] == 0)


# (chunks, page, kvp, rank, interleave): ragged batches, cached prefixes, partial pages, shards
LAYOUTS = {
    "ragged-prefix": ([(0, 13), (5, 20), (30, 3)], 8, 1, 0, 1),
    "kvp2-i1-r1": ([(0, 13), (6, 19)], 8, 2, 1, 1),
    "kvp3-i4-r2": ([(9, 22), (0, 5)], 4, 3, 2, 4),           # seq 1: rank 2 holds none of it
    "kvp2-ipage-r0": ([(17, 30), (0, 2)], 8, 2, 0, 8),
    "kvp4-ipage-r3-empty": ([(0, 7), (3, 9)], 4, 4, 3, 4),   # rank 3 holds nothing at all
}
GQA_SHAPES = {  # (Hq, Hkv, d, dv, config)
    "g4-d16": (8, 2, 16, 16, None),
    "g3-d24-dv8": (6, 2, 24, 8, None),                       # group 3, d = 16 + 8, dv != d
    # tiles smaller than a page (a GPU's tl.dot needs 16 keys: there, tiles spanning pages)
    "mha-d32-bn8": (4, 4, 32, 32, dict(BLOCK_N=16 if ON_GPU else 8)),
    "g8-hblocks": (16, 2, 16, 16, dict(BLOCK_H=4, BLOCK_Q=8, BLOCK_N=32)),  # 2 head blocks
}


@pytest.mark.parametrize("shape", list(GQA_SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gqa_prefill(layout, shape):
    chunks, page, kvp, rank, inter = LAYOUTS[layout]
    hq, hkv, d, dv, config = GQA_SHAPES[shape]
    dtype = DTYPES[(len(layout) + len(shape)) % len(DTYPES)]
    gen = torch.Generator().manual_seed(len(layout) * 31 + hq)
    meta = _meta(chunks, page, kvp, rank, inter)
    T = meta.q_pos.shape[0]
    k, v = _pool(meta, (hkv, d), dtype, gen), _pool(meta, (hkv, dv), dtype, gen)
    q = torch.randn(T, hq, 2 * d, generator=gen).to(DEV, dtype)[..., ::2]      # strided view
    out = _poisoned(T, hq, dv, dtype)
    o, lse = triton_prefill.gqa_prefill(q, k, v, meta, d ** -0.5, config=config, out=out)
    assert o is out[0] and lse is out[1]
    _check(o, lse, *TorchAttention().prefill_gqa(q, k, v, meta, d ** -0.5), dtype)


MLA_SHAPES = {  # (H, Dl, Dr, config)
    "h4-dl32-dr8": (4, 32, 8, None),
    "h6-dl64-dr16-bn32": (6, 64, 16, dict(BLOCK_N=32)),
}


@pytest.mark.parametrize("shape", list(MLA_SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_prefill(layout, shape):
    chunks, page, kvp, rank, inter = LAYOUTS[layout]
    H, dl, dr, config = MLA_SHAPES[shape]
    dtype = DTYPES[len(layout) % len(DTYPES)]
    gen = torch.Generator().manual_seed(len(layout) * 7 + H)
    meta = _meta(chunks, page, kvp, rank, inter)
    T = meta.q_pos.shape[0]
    kv = _pool(meta, (dl + dr,), dtype, gen)
    q = torch.randn(T, H, dl + dr, generator=gen).to(DEV, dtype)
    ql, qr = q.split([dl, dr], dim=-1)                                        # strided views
    out = _poisoned(T, H, dl, dtype)
    o, lse = triton_prefill.mla_prefill(ql, qr, kv, dl, meta, 0.3, config=config, out=out)
    _check(o, lse, *TorchAttention().prefill_mla(ql, qr, kv, dl, meta, 0.3), dtype)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_splits_merge_to_the_same_attention(layout, splits):
    """Keys split across programs (num_splits: a short chunk over a long context), partials
    merged by LSE: GQA and absorbed MLA equal the reference, with splits that hold no key (a
    sequence shorter than the splits' tiles) and rows that see none."""
    chunks, page, kvp, rank, inter = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(splits * 17 + len(layout))
    meta = _meta(chunks, page, kvp, rank, inter)
    T = meta.q_pos.shape[0]
    dtype = DTYPES[splits % len(DTYPES)]
    k, v = _pool(meta, (2, 16), dtype, gen), _pool(meta, (2, 16), dtype, gen)
    q = torch.randn(T, 8, 16, generator=gen).to(DEV, dtype)
    cfg = dict(num_splits=splits, BLOCK_N=16, BLOCK_Q=4, BLOCK_H=4)
    _check(*triton_prefill.gqa_prefill(q, k, v, meta, 0.25, config=cfg),
           *TorchAttention().prefill_gqa(q, k, v, meta, 0.25), dtype)
    kv = _pool(meta, (32 + 8,), dtype, gen)
    q = torch.randn(T, 4, 40, generator=gen).to(DEV, dtype)
    ql, qr = q.split([32, 8], dim=-1)
    _check(*triton_prefill.mla_prefill(ql, qr, kv, 32, meta, 0.3, config=cfg),
           *TorchAttention().prefill_mla(ql, qr, kv, 32, meta, 0.3), dtype)


def test_a_short_chunk_over_many_keys_splits_them():
    """The split choice from static sizes: one query block over 128K keys on a 132-SM GPU splits
    (a handful of programs otherwise); a long prompt, or few keys, does not."""
    gpu = torch.device("meta")
    real = triton_prefill.sm_count_of
    try:
        triton_prefill.sm_count_of = lambda device: 132
        assert triton_prefill.num_splits(1, 8, 131072, gpu) >= 16
        assert triton_prefill.num_splits(64 * 4, 8, 131072, gpu) == 1
        assert triton_prefill.num_splits(1, 8, 1024, gpu) == 1
        assert triton_prefill.num_splits(1, 8, 131072, gpu, {"num_splits": 3}) == 3
    finally:
        triton_prefill.sm_count_of = real


def test_prefill_config_validated():
    cfg = triton_prefill.prefill_config(4, 128, 0, 128, torch.bfloat16)
    assert cfg["BLOCK_Q"] * cfg["BLOCK_H"] == 128 and cfg["BLOCK_H"] == 4
    wide = triton_prefill.prefill_config(128, 512, 64, 512, torch.bfloat16)
    assert wide["BLOCK_H"] == 64 and wide["BLOCK_Q"] == 1
    with pytest.raises(ValueError, match="unknown prefill tunables"):
        triton_prefill.prefill_config(4, 128, 0, 128, torch.bfloat16, dict(BLOCKN=32))


_BIG_POOL = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from helix.attention import triton_prefill
    from helix.kv.manager import LocalKVMeta
    # a [P, 16, 32] fp16 pool of > 2^31 elements; only the last pages are touched
    page, d, n = 16, 32, 40
    P = 2**31 // (page * d) + 8
    kv = torch.empty((P, page, 1, d), dtype=torch.float16)
    pages = (P - 1 - torch.arange(3)).int()
    rows = torch.randn(n, d).half()
    for j in range(n):
        kv[pages[j // page], j % page, 0] = rows[j]
    T = 4
    meta = LocalKVMeta(slots=torch.full((T,), -1), block_tables=pages.view(1, 3),
                       kv_lens=torch.tensor([n], dtype=torch.int32),
                       cu_q=torch.tensor([0, T], dtype=torch.int32),
                       q_pos=torch.arange(n - T, n), kvp_rank=0, kvp=1, interleave=1,
                       page_size=page, num_decode=0, max_q=T)
    q = torch.randn(T, 2, d).half()
    o, lse = triton_prefill.gqa_prefill(q, kv, kv, meta, 0.25)
    r = rows.float()
    for t in range(T):
        s = q[t].float() @ r[:n - T + t + 1].T * 0.25
        assert (o[t].float() - torch.softmax(s, -1) @ r[:n - T + t + 1]).abs().max() < 2e-3
        assert (lse[t] - torch.logsumexp(s, -1)).abs().max() < 1e-3
    print("ok")
""")


@pytest.mark.skipif(ON_GPU, reason="CPU: the pool only reserves address space")
def test_pool_over_2_31_elements():
    """Page ids are widened before they multiply a stride (a subprocess: 32-bit offsets would
    read wild addresses)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", _BIG_POOL], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# -- torch's attention kernels over gathered pages --------------------------------------------

def _dense(q, k, v, scale, causal_offset):
    """q [t, Hq, d], k, v [n, Hkv, d] fp32 -> (o [t, Hq, d], lse [Hq, t]); query i sees keys
    j <= causal_offset + i (None: all)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    sc = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if causal_offset is not None:
        i = torch.arange(q.shape[0], device=q.device)[:, None]
        j = torch.arange(k.shape[0], device=q.device)[None, :]
        sc = sc.masked_fill(j > causal_offset + i, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(sc, -1), vv), torch.logsumexp(sc, -1)


def _fake_flash(padded_lse: bool):
    """torch_prefill.flash_varlen's contract in plain torch: varlen, causal aligned to the
    bottom right, GQA, LSE [Hq, T] (or [S, Hq, max_q], older torch)."""
    def flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        T, hq, _ = q.shape
        o = torch.zeros_like(q)
        lse = torch.full((len(cu_q) - 1, hq, max_q) if padded_lse else (hq, T), float("inf"))
        for s in range(len(cu_q) - 1):
            a, b, c0, c1 = cu_q[s].item(), cu_q[s + 1].item(), cu_k[s].item(), cu_k[s + 1].item()
            o_s, l_s = _dense(q[a:b], k[c0:c1], v[c0:c1], scale, (c1 - c0) - (b - a))
            o[a:b] = o_s.to(q.dtype)
            if padded_lse:
                lse[s, :, :b - a] = l_s
            else:
                lse[:, a:b] = l_s
        return o, lse
    return flash


def _fake_cudnn(q, k, v, causal, scale):
    """torch_prefill.cudnn_attention's contract: q [1, H, t, d], k / v [1, Hkv, n, d] in (GQA
    groups read natively), top-left causal."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    o, lse = _dense(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), scale,
                    0 if causal else None)
    return o.transpose(0, 1).unsqueeze(0).to(q.dtype), lse.unsqueeze(0)


@pytest.mark.skipif(ON_GPU, reason="fake kernels on the CPU; test_torch_path_on_gpu runs torch's")
def test_cudnn_without_lse_falls_back_to_triton(monkeypatch):
    """A cuDNN call that returns no LSE (seen on the H200) runs the Triton kernel instead."""
    monkeypatch.setattr(torch_prefill, "_cudnn_op", lambda q, *a: (torch.zeros_like(q), None))
    monkeypatch.setattr(torch_prefill, "usable", lambda kernel, q, k, v, m: True)
    gen = torch.Generator().manual_seed(4)
    meta = _meta(LAYOUTS["ragged-prefix"][0], 8)
    k, v = _pool(meta, (2, 16), torch.float32, gen), _pool(meta, (2, 16), torch.float32, gen)
    q = torch.randn(meta.q_pos.shape[0], 8, 16, generator=gen).to(DEV)
    o, lse = triton_backend.TritonAttention("cudnn").prefill_gqa(q, k, v, meta, 0.25)
    _check(o, lse, *TorchAttention().prefill_gqa(q, k, v, meta, 0.25), torch.float32)


@pytest.mark.skipif(ON_GPU, reason="fake kernels on the CPU; test_torch_path_on_gpu runs torch's")
@pytest.mark.parametrize("kernel", ["flash", "flash-padded-lse", "cudnn"])
def test_torch_path_glue(monkeypatch, kernel):
    """Gather of the pages, cu_seqlens, the cuDNN prefix / chunk split and its LSE merge, LSE
    layouts: equal to the reference at kvp 1."""
    monkeypatch.setattr(torch_prefill, "flash_varlen", _fake_flash("padded" in kernel))
    monkeypatch.setattr(torch_prefill, "cudnn_attention", _fake_cudnn)
    gen = torch.Generator().manual_seed(3)
    meta = _meta(LAYOUTS["ragged-prefix"][0], 8)
    T = meta.q_pos.shape[0]
    k, v = _pool(meta, (2, 16), torch.float32, gen), _pool(meta, (2, 16), torch.float32, gen)
    q = torch.randn(T, 8, 16, generator=gen).to(DEV)
    o, lse = torch_prefill.prefill_gqa(kernel.split("-")[0], q, k, v, meta, 0.25)
    _check(o, lse, *TorchAttention().prefill_gqa(q, k, v, meta, 0.25), torch.float32)


@pytest.mark.skipif(ON_GPU, reason="fake kernels on the CPU; test_torch_path_on_gpu runs torch's")
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("host", [True, False], ids=["host-lens", "device-lens"])
def test_torch_path_padding_rows(monkeypatch, kernel, host):
    """A prefill graph's attention break: the step's sequences, then its padding rows as one
    sequence of KV length 0 (helix/runtime/prefill_graphs.py). Real rows equal the reference,
    padding rows get O = 0, LSE = -inf; with the lengths from the host (the engine's steps) or
    read from the device."""
    monkeypatch.setattr(torch_prefill, "flash_varlen", _fake_flash(False))
    monkeypatch.setattr(torch_prefill, "cudnn_attention", _fake_cudnn)
    gen = torch.Generator().manual_seed(5)
    meta = _meta(LAYOUTS["ragged-prefix"][0], 8)
    T, pad = meta.q_pos.shape[0], 3
    k, v = _pool(meta, (2, 16), torch.float32, gen), _pool(meta, (2, 16), torch.float32, gen)
    q = torch.randn(T + pad, 8, 16, generator=gen).to(DEV)
    lens = meta.host_lens
    padded = dataclasses.replace(
        meta, cu_q=torch.cat((meta.cu_q, meta.cu_q.new_tensor([T + pad]))),
        kv_lens=torch.cat((meta.kv_lens, meta.kv_lens.new_zeros(1))),
        block_tables=torch.cat((meta.block_tables, meta.block_tables[:1] * 0)),
        max_q=max(meta.max_q, pad),
        host_lens=(lens[0] + [0], lens[1] + [pad]) if host else None)
    o, lse = torch_prefill.prefill_gqa(kernel, q, k, v, padded, 0.25)
    _check(o[:T], lse[:T], *TorchAttention().prefill_gqa(q[:T], k, v, meta, 0.25), torch.float32)
    assert (o[T:] == 0).all() and (lse[T:] == float("-inf")).all()


@pytest.mark.parametrize("lens", [[70], [5, 0, 64, 129], [0, 0]], ids=["one", "ragged", "empty"])
def test_gather_slots_from_host_lengths(lens):
    """The slots built per sequence from host key counts equal the device-count path's: partial
    pages, a page-exact sequence, empty sequences, shuffled pages."""
    page, width = 16, 10
    gen = torch.Generator().manual_seed(7)
    tables = torch.randperm(len(lens) * width, generator=gen).int().view(len(lens), width)
    meta = LocalKVMeta(
        slots=torch.zeros(0, dtype=torch.long), block_tables=tables.to(DEV),
        kv_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        cu_q=torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV),
        q_pos=torch.zeros(0, dtype=torch.long, device=DEV), kvp_rank=0, kvp=1, interleave=1,
        page_size=page, num_decode=0, max_q=1, max_kv=max(lens))
    want = [int(tables[s, j // page]) * page + j % page for s, n in enumerate(lens)
            for j in range(n)]
    for host in (None, lens):
        got = torch_prefill.gather_slots(meta, sum(lens), DEV, host)
        assert got.dtype == torch.long and got.tolist() == want


def test_backend_prefill_choice(monkeypatch):
    """auto: the device's measured torch kernel from its key count on (a short chunk after a
    long prefix too), else Triton; a named kernel wherever it applies (never at kvp > 1, never
    on CPU); triton: never."""
    q = torch.zeros(1, 4, 16)
    kv = torch.zeros(2, 4, 1, 16)
    meta, short, sharded = _meta([(0, 64)], 4), _meta([(0, 63)], 4), _meta([(0, 9)], 4, 2)
    attn = triton_backend.TritonAttention
    assert attn("flash").torch_prefill(q, kv, kv, meta) is None                 # CPU
    monkeypatch.setattr(torch_prefill, "usable", lambda kernel, q, k, v, m: m.kvp == 1)
    monkeypatch.setattr(triton_backend, "device_name", lambda device: "H")
    monkeypatch.setattr(triton_backend, "TORCH_PREFILL", {"H": ("cudnn", 64)})
    assert attn("auto").torch_prefill(q, kv, kv, meta) == "cudnn"
    assert attn("auto").torch_prefill(q, kv, kv, short) is None
    late = _meta([(60, 4)], 4)                   # 4 queries after 60 cached keys: 64 keys
    assert late.max_kv == 64 and attn("auto").torch_prefill(q, kv, kv, late) == "cudnn"
    assert attn("flash").torch_prefill(q, kv, kv, short) == "flash"
    assert attn("cudnn").torch_prefill(q, kv, kv, sharded) is None
    assert attn("triton").torch_prefill(q, kv, kv, meta) is None
    monkeypatch.setattr(triton_backend, "TORCH_PREFILL", {})
    assert attn("auto").torch_prefill(q, kv, kv, meta) is None
    with pytest.raises(Exception, match="HELIX_PREFILL"):
        attn("torch")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("kernel", torch_prefill.KERNELS)
def test_torch_path_on_gpu(kernel):
    """The real torch kernels: bottom-right causal alignment / the prefix split, LSE base and
    layout, against the reference."""
    gen = torch.Generator().manual_seed(4)
    meta = _meta(LAYOUTS["ragged-prefix"][0], 8)
    T = meta.q_pos.shape[0]
    k = _pool(meta, (2, 64), torch.bfloat16, gen)
    v = _pool(meta, (2, 64), torch.bfloat16, gen)
    q = torch.randn(T, 8, 64, generator=gen).to(DEV, torch.bfloat16)
    if not torch_prefill.usable(kernel, q, k, v, meta):
        pytest.skip(f"torch's {kernel} attention is not available here")
    o, lse = torch_prefill.prefill_gqa(kernel, q, k, v, meta, 0.125)
    _check(o, lse, *TorchAttention().prefill_gqa(q, k, v, meta, 0.125), torch.bfloat16)


# -- MLA prefill forms ------------------------------------------------------------------------

def test_mla_form_rule():
    """The FLOP rule of helix/layers/mla_prefill.py with DeepSeek's dims: decompressed for big
    chunks over any prefix and for short prefixes, absorbed for short chunks over long ones."""
    dims = mla_prefill.MLADims(512, 64, 128, 128)
    f = mla_prefill.prefill_flops

    def cheaper(T, P):
        pairs = mla_prefill.causal_pairs([T], [P + T], 1)
        assert pairs == T * P + T * (T + 1) // 2
        return f("decompressed", pairs, P + T, T, 16, dims) < f("absorbed", pairs, P + T, T, 16,
                                                               dims)
    assert cheaper(8192, 0) and cheaper(8192, 120 * 1024) and cheaper(172, 10 ** 7)
    assert cheaper(16, 0) and not cheaper(16, 100_000) and not cheaper(170, 10 ** 7)
    big = mla_prefill.causal_pairs([8192], [128 * 1024], 1)
    ratio = f("absorbed", big, 128 * 1024, 8192, 16, dims) / f("decompressed", big, 128 * 1024,
                                                               8192, 16, dims)
    assert 3.0 < ratio < 3.5


@pytest.mark.parametrize("layout", ["ragged-prefix", "kvp2-i1-r1", "kvp3-i4-r2",
                                    "kvp4-ipage-r3-empty"])
def test_mla_decompressed_equals_absorbed(monkeypatch, layout):
    """Per rank: the decompressed form's partial is W_UV (absorbed partial), same LSE; head
    blocks (a small DECOMPRESS_BYTES) change nothing."""
    monkeypatch.setattr(mla_prefill, "DECOMPRESS_BYTES", 1)                 # one head a block
    chunks, page, kvp, rank, inter = LAYOUTS[layout]
    H, dl, dr, dn, dv = 3, 32, 8, 16, 12
    gen = torch.Generator().manual_seed(11)
    meta = _meta(chunks, page, kvp, rank, inter)
    T = meta.q_pos.shape[0]
    kv = _pool(meta, (dl + dr,), torch.float32, gen)
    w_kv = torch.randn(H, dn + dv, dl, generator=gen).to(DEV) * 0.2
    q_nope = torch.randn(T, H, dn, generator=gen).to(DEV)
    q_rope = torch.randn(T, H, dr, generator=gen).to(DEV)
    ref = TorchAttention()
    o, lse = mla_prefill.decompressed_attention(q_nope, q_rope, kv, w_kv, meta,
                                                meta.kv_lens.tolist(), ref, 0.3)
    q_latent = torch.einsum("thn,hnc->thc", q_nope, w_kv[:, :dn])
    lat, lse_abs = ref.prefill_mla(q_latent, q_rope, kv, dl, meta, 0.3)
    want = torch.einsum("thc,hvc->thv", lat, w_kv[:, dn:])
    _check(o, lse, want, lse_abs, torch.float32)


# -- the Triton backend end to end --------------------------------------------------------------

def _generate(model, backend):
    rt = RuntimeConfig(device=DEV, max_context=64, max_batch=2, page_size=4, layers=1,
                       max_prefill_tokens=16, attention_backend=backend)
    with LLM(model, Layout(), rt) as llm:
        a = llm.add_request(list(range(3, 43)), SamplingParams(max_new_tokens=2, ignore_eos=True))
        llm.step()
        b = llm.add_request([9, 8, 7, 6, 5], SamplingParams(max_new_tokens=4, ignore_eos=True))
        while llm.has_unfinished():
            llm.step()
        return llm.outputs[a], llm.outputs[b]


@pytest.mark.parametrize("model,forms", [("tiny-llama", ["auto"]),
                                         ("tiny-deepseek-v3", ["absorbed", "decompressed"])])
def test_triton_backend_tokens_equal_torch(monkeypatch, model, forms):
    """A 40-token prompt in 16-token chunks, a second request prefilling and decoding beside
    its later chunks: the Triton backend (prefill kernel, decode kernels) gives the torch
    backend's tokens, in both MLA prefill forms (exact alike: the torch run's form is moot)."""
    want = _generate(model, "torch")
    for form in forms:
        monkeypatch.setattr(mla_prefill, "FORM", form)
        assert _generate(model, "triton") == want, form


def test_mla_decompressed_matches_transformers(monkeypatch, hf_checkpoint):
    """The decompressed form, prompt in 16-token chunks, against Hugging Face: prefill logits
    and greedy tokens (torch backend: the form's own code, not the kernels)."""
    from hf_fixtures import SMALL, hf_greedy, hf_prefill_logits
    monkeypatch.setattr(mla_prefill, "FORM", "decompressed")
    path, hf = hf_checkpoint("deepseek_v2")
    prompt = list(range(3, 43))
    rt = RuntimeConfig(**{**SMALL, "max_prefill_tokens": 16})
    with LLM(path, Layout(), rt) as llm:
        r = llm.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
        first = None
        while llm.has_unfinished():
            llm.step()
            if first is None and llm.outputs[r]:
                first = llm.engine.last_logits[0].clone()
        tokens = llm.outputs[r]
    want = hf_prefill_logits(hf, prompt)
    assert ((first - want).abs().max() / want.abs().max()).item() < 1e-4
    assert tokens == hf_greedy(hf, prompt, 4)[0]
