"""The fp8 KV cache (RuntimeConfig.kv_cache_dtype = "fp8", helix/kv/quant.py).

Checked at three levels:
- the rounding: triton_util.cache_cast (inside every kernel that writes the cache) gives the
  bytes of torch's own e4m3 conversion after saturation (kv.quant.to_cache) for every e4m3
  value, every midpoint (ties to even) and its neighbours, out-of-range values and random ones;
  the append kernels and the fused rope + append writers store exactly those bytes;
- the readers: decode (GQA, MLA, MLA few heads) and prefill (GQA, absorbed and decompressed
  MLA) kernels over an fp8 pool equal the torch reference over the same pool;
- whole runs: a Llama's tokens equal transformers' with its KV cache rounded to e4m3 the same
  way (the exact oracle: only the cache's storage changes); every KVP layout gives the tokens
  and logits of one rank (each value is rounded alone, so the layout cannot matter); the torch
  and Triton backends agree; prefix caching with the host tier, and KV import, keep the
  tokens; the pool holds twice the positions of bf16 in the same bytes.

Kernels run through Triton's interpreter here (queries fp32 / fp16: its bf16 dot is wrong)."""

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hf_fixtures import SMALL, VOCAB, hf_greedy  # noqa: E402
from parallel_helpers import RUNTIME, assert_same_run, cached_run  # noqa: E402
from test_triton_kernels import _decode_meta  # noqa: E402
from test_triton_prefill import _meta, _pool  # noqa: E402

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.attention import (triton_append, triton_decode, triton_mla,  # noqa: E402
                             triton_mla_few, triton_prefill)
from helix.attention.torch_ref import TorchAttention  # noqa: E402
from helix.errors import ConfigError  # noqa: E402
from helix.kv.quant import FP8_MAX, to_cache  # noqa: E402
from helix.layers import mla_prefill  # noqa: E402
from helix.runtime.memory import page_bytes  # noqa: E402
from helix.triton_util import cache_cast  # noqa: E402

FP8 = torch.float8_e4m3fn
QTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def fp8_pool(x: torch.Tensor, spread: float = 4.0) -> torch.Tensor:
    """x (random, NaN where nothing may be read) scaled to reach well into e4m3's range, on
    both sides of its subnormals, stored as fp8."""
    return to_cache(x.float() * spread, FP8)


def _close(o, lse, ref_o, ref_lse, dtype):
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.float(), ref_o.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)


# -- the rounding ----------------------------------------------------------------------------------

@triton.jit
def _cast_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, cache_cast(tl.load(x_ptr + o), y_ptr.dtype.element_ty))


def _probe_values() -> torch.Tensor:
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    every = every[torch.isfinite(every)].sort().values
    mid = (every[1:] + every[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    g = torch.Generator().manual_seed(0)
    return torch.cat([every, mid, mid.nextafter(up), mid.nextafter(down),
                      torch.randn(2048, generator=g) * 60, torch.randn(512, generator=g) * 0.01,
                      torch.tensor([1e6, -1e6, 449.0, -463.9, 464.0, 470.0, 2.0 ** -10,
                                    -(2.0 ** -10) * 1.01, 0.0])])


@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernels_round_as_torch_does_after_saturation(src):
    """Every e4m3 value, every midpoint between neighbours (ties to even) and the floats next to
    it, values past +-448 (saturated, never NaN) and below the subnormals."""
    x = _probe_values().to(src)
    n = triton.cdiv(x.numel(), 128) * 128
    x = torch.cat([x, torch.zeros(n - x.numel(), dtype=src)]).to(DEV)
    y = torch.empty(n, dtype=FP8, device=DEV)
    _cast_kernel[(n // 128,)](x, y, BLOCK=128)
    want = to_cache(x, FP8)
    zeros = (y.float() == 0) & (want.float() == 0)                         # +0 or -0
    same = (y.view(torch.uint8) == want.view(torch.uint8)) | zeros
    assert bool(same.all()), (x[~same][:8], y[~same][:8].float(), want[~same][:8].float())
    assert y.float().abs().max() == FP8_MAX and not torch.isnan(y.float()).any()


@pytest.mark.parametrize("inner", [(2, 8), (20,)], ids=str)       # GQA [Hkv, d], MLA [Dl + Dr]
def test_append_writes_the_rounded_bytes(inner):
    g = torch.Generator().manual_seed(1)
    cache = fp8_pool(torch.randn(6, 4, *inner, generator=g)).to(DEV)
    rows = (torch.randn(7, *inner, generator=g) * 50).to(DEV)         # past +-448 too
    slots = torch.tensor([5, -1, 0, 23, -1, 12, 4], dtype=torch.int64, device=DEV)
    ref = cache.clone()
    TorchAttention().append_kv(ref, rows, slots)
    triton_append.append_kv(cache, rows, slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    written = ref.view(-1, *inner)[slots[slots >= 0]]
    assert torch.equal(written.view(torch.uint8), to_cache(rows[slots >= 0], FP8).view(torch.uint8))

    k_cache, v_cache = cache.clone(), cache.clone()
    k, v = rows, -rows
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    TorchAttention().append_kv_pair(ref_k, ref_v, k, v, slots)
    triton_append.append_kv_pair(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


def test_fused_writers_store_what_they_would_store_rounded():
    """The rope + append kernel of GQA layers (fused_qk_norm.rope_append) and the MLA kv-row
    kernel (fused_mla.mla_kv_row) into an fp8 pool: the bytes of their fp32 pool's values,
    rounded."""
    from helix.layers import fused_mla, fused_qk_norm
    g = torch.Generator().manual_seed(2)
    T, hq, hk, d, P, page = 5, 4, 2, 16, 6, 4
    cos = torch.randn(64, d // 2, generator=g).to(DEV)
    sin = torch.randn(64, d // 2, generator=g).to(DEV)
    pos = torch.tensor([3, 9, 0, 17, 40], device=DEV)
    slots = torch.tensor([2, -1, 7, 20, 11], dtype=torch.int64, device=DEV)
    q = (torch.randn(T, hq, d, generator=g) * 30).to(DEV)
    k = (torch.randn(T, hk, d, generator=g) * 30).to(DEV)
    v = (torch.randn(T, hk, d, generator=g) * 30).to(DEV)
    pools = {}
    for dt in (torch.float32, FP8):
        kc = torch.zeros(P, page, hk, d, dtype=dt, device=DEV)
        vc = torch.zeros(P, page, hk, d, dtype=dt, device=DEV)
        fused_qk_norm.rope_append(q.clone(), k.clone(), v, None, None, 1e-6, cos, sin, pos, False,
                                  kc, vc, slots)
        pools[dt] = (kc, vc)
    for wide, narrow in zip(pools[torch.float32], pools[FP8]):
        assert wide.abs().sum() > 0
        assert torch.equal(narrow.view(torch.uint8), to_cache(wide, FP8).view(torch.uint8))

    dl, dr = 32, 8
    ckv = (torch.randn(T, dl + dr, generator=g) * 3).to(DEV)
    w = (torch.rand(dl, generator=g) * 40).to(DEV)
    cs = torch.randn(64, dr // 2, generator=g).to(DEV)
    sn = torch.randn(64, dr // 2, generator=g).to(DEV)
    caches = {}
    for dt in (torch.float32, FP8):
        cache = torch.zeros(P, page, dl + dr, dtype=dt, device=DEV)
        fused_mla.mla_kv_row_triton(ckv, w, 1e-6, cs, sn, pos, True, cache=cache, slots=slots)
        caches[dt] = cache
    assert caches[torch.float32].abs().sum() > 0
    assert torch.equal(caches[FP8].view(torch.uint8),
                       to_cache(caches[torch.float32], FP8).view(torch.uint8))


# -- the readers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", QTYPES, ids=str)
@pytest.mark.parametrize("case", [(3, 8, 2, 32, 16, [1, 17, 40], None),
                                  (2, 16, 2, 24, 8, [95, 0], 3)], ids=["g4", "g8-splits"])
def test_gqa_decode_over_an_fp8_pool(case, dtype):
    B, hq, hkv, d, page, lens, splits = case
    g = torch.Generator().manual_seed(3 + B)
    meta = _decode_meta(lens, page, 40, g)
    k = fp8_pool(torch.randn(40, page, hkv, d, generator=g)).to(DEV)
    v = fp8_pool(torch.randn(40, page, hkv, d, generator=g)).to(DEV)
    q = torch.randn(B, hq, d, generator=g).to(DEV, dtype)
    o, lse = triton_decode.gqa_decode(q, k, v, meta.block_tables, meta.kv_lens, d ** -0.5,
                                      num_splits=splits)
    assert o.dtype == dtype
    _close(o, lse, *TorchAttention().attend_gqa(q, k, v, meta, d ** -0.5), dtype)
    # the reference reads the stored values: the same as a wide pool holding them
    ro, _ = TorchAttention().attend_gqa(q, k.float(), v.float(), meta, d ** -0.5)
    _close(o, lse, ro, lse, dtype)


@pytest.mark.parametrize("dtype", QTYPES, ids=str)
@pytest.mark.parametrize("few", [False, True], ids=["mla", "few-heads"])
def test_mla_decode_over_an_fp8_pool(few, dtype):
    B, H, Dl, Dr, page, lens = 3, 8, 64, 16, 16, [1, 40, 77]
    g = torch.Generator().manual_seed(4)
    meta = _decode_meta(lens, page, 40, g)
    kv = fp8_pool(torch.randn(40, page, Dl + Dr, generator=g)).to(DEV)
    q = torch.randn(B, H, Dl + Dr, generator=g).to(DEV, dtype)
    ql, qr = q.split([Dl, Dr], dim=-1)
    decode = triton_mla_few.mla_decode_few if few else triton_mla.mla_decode
    o, lse = decode(ql, qr, kv, meta.block_tables, meta.kv_lens, 0.3)
    _close(o, lse, *TorchAttention().attend_mla(ql, qr, kv, Dl, meta, 0.3), dtype)


@pytest.mark.parametrize("layout", ["ragged-prefix", "kvp3-i4-r2"])
def test_prefill_over_an_fp8_pool(layout):
    """GQA and absorbed-MLA prefill (cached prefixes, KVP shards; the pool NaN where nothing
    may be read), and the decompressed MLA form (pages dequantized, then expanded)."""
    from test_triton_prefill import LAYOUTS
    chunks, page, kvp, rank, inter = LAYOUTS[layout]
    g = torch.Generator().manual_seed(5)
    meta = _meta(chunks, page, kvp, rank, inter)
    T = meta.q_pos.shape[0]
    for dtype in QTYPES:
        k = fp8_pool(_pool(meta, (2, 16), torch.float32, g))
        v = fp8_pool(_pool(meta, (2, 16), torch.float32, g))
        q = torch.randn(T, 8, 16, generator=g).to(DEV, dtype)
        o, lse = triton_prefill.gqa_prefill(q, k, v, meta, 0.25)
        _close(o, lse, *TorchAttention().prefill_gqa(q, k, v, meta, 0.25), dtype)

        kv = fp8_pool(_pool(meta, (32 + 8,), torch.float32, g))
        q = torch.randn(T, 4, 40, generator=g).to(DEV, dtype)
        ql, qr = q.split([32, 8], dim=-1)
        o, lse = triton_prefill.mla_prefill(ql, qr, kv, 32, meta, 0.3)
        _close(o, lse, *TorchAttention().prefill_mla(ql, qr, kv, 32, meta, 0.3), dtype)

    # decompressed: W_UK / W_UV expand the latent rows (fp32 here), rope keys appended
    w_kv = torch.randn(4, 16 + 8, 32, generator=g).to(DEV) * 0.2
    q_nope = torch.randn(T, 4, 16, generator=g).to(DEV)
    q_rope = torch.randn(T, 4, 8, generator=g).to(DEV)
    lens = meta.kv_lens.tolist()
    o, lse = mla_prefill.decompressed_attention(q_nope, q_rope, kv, w_kv, meta, lens,
                                                TorchAttention(), 0.3)
    ro, rl = mla_prefill.decompressed_attention(q_nope, q_rope, kv.float(), w_kv, meta, lens,
                                                TorchAttention(), 0.3)
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(lse, rl)


# -- whole runs ------------------------------------------------------------------------------------

def hf_greedy_fp8(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with every K and V its cache stores rounded to e4m3 as
    Helix's fp8 pool stores them (prefill attends over the stored values too)."""
    from transformers import DynamicCache

    class Fp8Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kw):
            def rounded(x):
                return to_cache(x, FP8).to(x.dtype)
            return super().update(rounded(key_states), rounded(value_states), layer_idx,
                                  *args, **kw)

    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                      past_key_values=Fp8Cache(config=hf.config))
    return out[0, len(prompt):].tolist()


PROMPTS = [[(7 * i + 3) % VOCAB for i in range(37)], [5, 9, 11, 2], [(3 * i) % VOCAB + 1
                                                                   for i in range(21)]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tokens_are_transformers_with_its_cache_rounded_to_fp8(hf_checkpoint, family):
    """The exact oracle; and the rounding is visible: transformers' own tokens differ somewhere,
    and the fp8 run's first-step logits stay close to the unrounded ones."""
    path, hf = hf_checkpoint(family)
    n = 10
    rt = RuntimeConfig(**{**SMALL, "max_prefill_tokens": 16}, kv_cache_dtype="fp8")
    with LLM(path, Layout(), rt) as llm:
        got = llm.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))
        assert all(c.dtype == FP8 for cache in llm.engine.caches for c in cache)
    want = [hf_greedy_fp8(hf, p, n) for p in PROMPTS]
    assert got == want
    plain = [hf_greedy(hf, p, n) for p in PROMPTS]
    assert any(w != p[0] for w, p in zip(want, plain))      # the oracle itself rounds
    with LLM(path, Layout(), rt) as llm:
        llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, ignore_eos=True))
        logits = llm.engine.last_logits.float()[0]
    ref = plain[0][1][0]
    assert float((logits - ref).abs().max() / ref.abs().max()) < 0.1


CASES = [("llama", Layout(kvp=2)), ("llama", Layout(kvp=2, tpa=2, kv_interleave=8)),
         ("deepseek_v3", Layout(kvp=2))]


@pytest.mark.parametrize("family,layout", CASES,
                         ids=[f"{f}-kvp{x.kvp}-tpa{x.tpa}-I{x.kv_interleave}" for f, x in CASES])
def test_kvp_layouts_give_the_one_rank_run(hf_checkpoint, family, layout):
    """Each value is rounded alone, so KVP shards (pass-KV gathers and rings of fp8 pages,
    prompts in chunks next to decode rows) change nothing: tokens and logits of one rank."""
    import dataclasses
    path, _ = hf_checkpoint(family)
    rt = dataclasses.replace(RUNTIME, kv_cache_dtype="fp8")
    assert_same_run(cached_run(path, layout, rt), cached_run(path, Layout(), rt))


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_the_triton_backend_gives_the_torch_backends_tokens(hf_checkpoint, family):
    path, _ = hf_checkpoint(family)
    outs = []
    for backend in ("torch", "triton"):
        rt = RuntimeConfig(**{**SMALL, "max_prefill_tokens": 16}, kv_cache_dtype="fp8",
                           attention_backend=backend, device=DEV)       # (cuda on a GPU)
        with LLM(path, Layout(), rt) as llm:
            outs.append(llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True)))
    assert outs[0] == outs[1]


def test_cached_and_host_tier_blocks_keep_the_tokens(hf_checkpoint):
    """fp8 pages in the prefix cache, pushed out to host memory and loaded back."""
    path, _ = hf_checkpoint("llama")
    p1 = PROMPTS[0] + [5, 9, 11]
    other = [(5 * i + 1) % VOCAB for i in range(40)]
    runs = []
    for cache, gb in ((False, 0.0), (True, 0.01)):
        rt = RuntimeConfig(**SMALL, num_pages=16, kv_cache_dtype="fp8", prefix_caching=cache,
                           host_cache_gb=gb)
        with LLM(path, Layout(), rt) as llm:
            sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
            a = llm.generate([p1], sp)[0]
            llm.generate([other], sp)
            c = llm.generate([p1 + a + [33, 34]], sp)[0]
            runs.append((a, c, llm.stats()["prefix_cache_host_hits"]))
    assert runs[0][:2] == runs[1][:2] and runs[0][2] == 0 < runs[1][2]


def test_imported_kv_is_rounded_into_the_pool(hf_checkpoint, tmp_path):
    """A prefill server's KV (fp32 here) imported into an fp8 pool decodes the tokens of the
    same prompt prefilled into it locally; so does an fp8 engine's own export, as a dict and
    as a file."""
    from helix.kv.transfer import save_kv
    path, _ = hf_checkpoint("llama")
    prompt = PROMPTS[0]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def exported(llm):
        rid = llm.add_request(prompt, sp)
        while not llm.outputs[rid]:
            llm.step()
        kv = llm.export_kv(rid, len(prompt))
        while llm.has_unfinished():
            llm.step()
        return llm.outputs[rid], kv

    with LLM(path, Layout(), RuntimeConfig(**SMALL)) as wide:
        _, kv32 = exported(wide)
    with LLM(path, Layout(), RuntimeConfig(**SMALL, kv_cache_dtype="fp8")) as llm:
        local, kv8 = exported(llm)
        assert kv8[0][0].dtype == FP8 and kv32[0][0].dtype == torch.float32
        imports = [kv32, kv8, save_kv(kv8, str(tmp_path / "kv8.safetensors"))]
        ids = [llm.add_request(prompt, sp, kv=k) for k in imports]
        while llm.has_unfinished():
            llm.step()
        assert [llm.outputs[i] for i in ids] == [local] * 3
        assert llm.prefill_tokens_per_rank() == [len(prompt) + 3]


def test_the_pool_holds_twice_the_positions_in_the_same_bytes(caplog):
    import logging
    rt = RuntimeConfig(page_size=16, num_pages=8, kv_cache_dtype="fp8", dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="helix"), LLM("tiny-llama", Layout(), rt) as llm:
        assert any("KV pool: 8 pages" in m and "float8_e4m3fn" in m for m in caplog.messages)
        model = llm.engine.model
        assert page_bytes(model, 16, FP8) * 2 == page_bytes(model, 16, torch.bfloat16)
        assert llm.engine.pool.page_bytes == page_bytes(model, 16, FP8)


def test_an_unknown_kv_cache_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8"):
        RuntimeConfig(kv_cache_dtype="int4")


# -- the planner, sweeps and the command line ------------------------------------------------

def test_the_planner_counts_one_byte_an_element():
    """Half the KV bytes: half the KV GiB of a batch, twice the context that fits, and a shorter
    predicted step at long context (attention reads the KV)."""
    from helix.loader import read_model_config
    from helix.perf.hardware import load_hardware
    from helix.perf.planner import predict
    cfg = read_model_config("llama-3.1-8b")[0]
    hw = load_hardware("h200")
    wide, narrow = (predict(cfg, Layout(), 8, 131072, hw, kv_bytes=b) for b in (None, 1))
    assert narrow.kv_gib == pytest.approx(wide.kv_gib / 2)
    assert narrow.max_context >= 1.9 * wide.max_context
    assert narrow.phases_ms["attention"] < 0.6 * wide.phases_ms["attention"]
    assert narrow.step_ms < wide.step_ms


def test_plan_sweep_and_generate_take_the_flag(tmp_path, capsys):
    import json

    from helix.cli import main
    from helix.sweep import load_sweep
    assert main(["plan", "--model", "tiny-llama", "--gpus", "2", "--batch", "2", "--context",
                 "4096", "--kv-cache-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache_dtype"] == "fp8"
    path = tmp_path / "s.yaml"
    path.write_text("model: tiny-llama\ndevice: cpu\nkv_cache_dtype: fp8\n")
    assert load_sweep(str(path)).runtime["kv_cache_dtype"] == "fp8"
    path.write_text("model: tiny-llama\ndevice: cpu\nkv_cache_dtype: fp4\n")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8"):
        load_sweep(str(path))
    assert main(["generate", "--model", "tiny-llama", "--prompt-ids", "5,17,42",
                 "--max-new-tokens", "4", "--ignore-eos", "--kv-cache-dtype", "fp8",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["kv_cache_dtype"] == "fp8" and len(result["tokens"][0]) == 4
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "tiny-llama", "--prompt-ids", "5", "--kv-cache-dtype", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_captured_steps_over_an_fp8_pool_give_the_reference_tokens(model):
    """On CUDA (fp32 weights, so the backends may agree exactly): decode and prefill graphs
    over an fp8 pool give the tokens of the same run uncaptured and of the torch reference
    backend; and a bf16 run's pool is fp8 with the default kernels (Gluon MLA steps aside)."""
    prompts = [[(7 * i + 3) % 200 for i in range(300)], [5, 9, 11, 2], list(range(40, 140))]
    runs = []
    for backend, graphs in (("triton", True), ("triton", False), ("torch", False)):
        rt = RuntimeConfig(device="cuda", dtype="float32", kv_cache_dtype="fp8", page_size=16,
                           max_batch=4, max_context=512, num_pages=128, graph_buckets=(1, 2, 4),
                           max_prefill_tokens=128, attention_backend=backend,
                           cuda_graphs=graphs)
        with LLM(model, Layout(), rt) as llm:
            runs.append(llm.generate(prompts, SamplingParams(max_new_tokens=12,
                                                             ignore_eos=True)))
    assert runs[0] == runs[1] == runs[2]
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", max_batch=4,
                       max_context=512, num_pages=128)
    with LLM(model, Layout(), rt) as llm:
        out = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert all(len(o) == 12 for o in out)
        assert all(c.dtype == FP8 for cache in llm.engine.caches for c in cache)


def test_bench_attention_times_fp8_pools_beside_bf16(monkeypatch, tmp_path):
    """profiling/bench_attention.py --kv-dtypes bf16,fp8 (CPU smoke: tiny heads, fp32 queries
    for the interpreter, timing stubbed): both pools checked against the reference over their
    stored values, fp8's floor counting one byte a cached element."""
    import json
    import os
    import sys

    from test_triton_kernels import _stub_bench_timing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from profiling import bench_attention as bench
    real = triton_decode.gqa_decode
    monkeypatch.setattr(bench, "GQA", dict(hq=8, hkv=2, d=16))
    monkeypatch.setattr(bench, "gqa_decode", lambda q, *a, **k: tuple(
        x.to(q.dtype) if i == 0 else x for i, x in enumerate(real(q.float(), *a, **k))))
    _stub_bench_timing(monkeypatch, bench)
    monkeypatch.setattr(bench, "sdpa_time", lambda *a, **k: 9.0)
    out = tmp_path / "kv.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_attention.py", "--kernels", "gqa", "--batches", "2", "--contexts", "128",
        "--page-size", "16", "--mem-cap-gb", "1", "--kv-dtypes", "bf16,fp8", "--out", str(out)])
    bench.main()
    bf, f8 = json.loads(out.read_text())
    assert (bf["kv_dtype"], f8["kv_dtype"]) == ("bf16", "fp8")
    q_and_o = 2 * 2 * 8 * 16 * 2
    assert f8["bytes"] - q_and_o == (bf["bytes"] - q_and_o) // 2
    assert f8["max_err"] < 0.05 and f8["sdpa_us"] is None and bf["sdpa_us"] == 9.0


@pytest.mark.sm90
def test_fp8_launches_compile_for_sm90(tmp_path):
    """What the interpreter cannot check: bf16 queries over fp8 caches and the writers that
    round into them compile for sm_90 (triton's bundled ptxas), with no real spills (the MLA
    launch configs take cp.async and 32-token tiles for fp8 for that), and the MLA kernels
    still run their products on wgmma."""
    import json
    import os

    import sm90_compile
    out = tmp_path / "resources.json"
    sm90_compile.run(tmp_path, [os.path.join(sm90_compile.ROOT, "profiling", "kernel_resources.py"),
                                "--cases", "fp8-kv", "--json", str(out)], timeout=600,
                     fp_fusion=True)
    records = json.loads(out.read_text())
    assert {r["kernel"] for r in records} == {
        "_gqa_split_kernel", "_mla_split_kernel", "_mla_few_kernel", "_reduce_splits_kernel",
        "_append_kernel", "_append_pair_kernel", "_qk_norm_rope_kernel", "_kv_row_kernel",
        "_prefill_kernel"}
    for r in records:
        assert r["stack_bytes"] <= 64, r
    assert all(r["hgmma"] > 0 for r in records if r["kernel"].startswith("_mla")), records
    assert len([r for r in records if r["kernel"] == "_prefill_kernel"]) == 2   # GQA, MLA
