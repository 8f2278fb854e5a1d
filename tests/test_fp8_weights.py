"""Weights in float8 e4m3 with 128x128 block scales (helix/layers/fp8.py): DeepSeek-V3's
checkpoint format, and 16-bit checkpoints quantized at load (RuntimeConfig.quantization).

Checked at three levels:
- the format: quantize / dequantize (the scale maps a block's largest magnitude to 448, partial
  blocks, all-zero blocks), which shards keep whole blocks (keeps_blocks), checkpoint errors;
- the product: the Triton kernel (interpreter here) equals F.linear over the dequantized weight,
  decode and prefill tiles, partial blocks, bias;
- whole runs: an fp8 checkpoint's tokens are transformers' on its dequantized weights (Llama,
  Qwen3-MoE, DeepSeek-V3); on one rank the logits equal a run of the dequantized checkpoint
  bitwise (the reference path takes the same products); KVP / TP_A / EP layouts whose shards
  keep whole blocks give the one-rank run; a 16-bit checkpoint quantized at load equals the fp8
  checkpoint written from it; `none` dequantizes; the weights really are fp8 in memory.
"""

import json
import logging
import os

import torch

from triton_mode import DEV, ON_GPU  # first: chooses the interpreter before triton loads

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hf_fixtures import SMALL, hf_greedy, make_checkpoint  # noqa: E402
from parallel_helpers import assert_same_run, cached_run  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.errors import CheckpointError, ConfigError  # noqa: E402
from helix.layers import fp8  # noqa: E402
from helix.layers.weights import sliced_loader  # noqa: E402
from helix.loader import read_model_config  # noqa: E402

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
PROMPTS = [[5, 17, 42, 7, 9, 3], [7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


# -- checkpoints ----------------------------------------------------------------

def _quantized(name: str) -> bool:
    """The tensors DeepSeek-V3's checkpoint holds in fp8: every projection, experts included
    (not the router, embeddings, LM head or norms)."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight"))


def write_fp8(plain: str, out: str, dequantized: str | None = None) -> None:
    """The fp8 checkpoint of a saved fp32 one (each projection quantized by fp8.quantize, with
    its weight_scale_inv, quantization_config in config.json) and, where given, the fp32
    checkpoint of exactly its dequantized values (the oracle's weights)."""
    sd = load_file(os.path.join(plain, "model.safetensors"))
    q, deq = {}, {}
    for k, v in sd.items():
        if _quantized(k):
            b = fp8.quantize(v)
            q[k], q[f"{k}_scale_inv"] = b.weight, b.scale
            deq[k] = fp8.dequantize(b.weight, b.scale, torch.float32)
        else:
            q[k] = deq[k] = v
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    for path, tensors, extra in ((out, q, {"quantization_config": QUANT_CONFIG}),
                                 (dequantized, deq, {})):
        if path is None:
            continue
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**cfg, **extra}, f)


WIDE = {  # every projection in whole 128-blocks on one rank, and in every layout below
    "llama": dict(hidden_size=256, intermediate_size=512, head_dim=128),
    "qwen2": dict(hidden_size=512, intermediate_size=512, num_attention_heads=4),
    "qwen3_moe": dict(hidden_size=256, intermediate_size=256, head_dim=128,
                      moe_intermediate_size=128),
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512,
                        q_lora_rank=128, kv_lora_rank=96, qk_rope_head_dim=32,
                        qk_nope_head_dim=64, v_head_dim=128),
}


@pytest.fixture(scope="module")
def fp8_ckpt(ckpt_root):
    """fp8_ckpt(family, wide=False) -> (fp8 dir, dequantized fp32 dir, plain fp32 dir)."""
    made = {}

    def get(family: str, wide: bool = False):
        key = (family, wide)
        if key not in made:
            tag = "-fp8w" if wide else "-fp8"
            plain, _ = make_checkpoint(ckpt_root, family, tag=f"{tag}-plain",
                                       **(WIDE[family] if wide else {}))
            out, deq = (os.path.join(ckpt_root, family + tag + s) for s in ("", "-deq"))
            write_fp8(plain, out, deq)
            made[key] = out, deq, plain
        return made[key]

    return get


def _greedy(path: str, rt: RuntimeConfig, n: int = 8):
    with LLM(path, Layout(), rt) as llm:
        out = llm.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))
        params = list(llm.engine.model.named_parameters())
    return out, params


# -- the format ----------------------------------------------------------------

def test_quantize_maps_each_blocks_largest_magnitude_to_448():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 2, 300)   # blocks of all scales
    w[:128, 128:256] = 0.0                                                 # an all-zero block
    b = fp8.quantize(w)
    assert b.weight.dtype == torch.float8_e4m3fn and b.weight.shape == w.shape
    assert b.scale.shape == (2, 3) and b.scale.dtype == torch.float32
    assert b.scale[0, 1] == 1.0 and not b.weight[:128, 128:256].float().any()
    for i in range(2):
        for j in range(3):
            blk = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            if blk.abs().max() > 0:
                assert b.scale[i, j] == pytest.approx(float(blk.abs().max()) / 448, rel=1e-6)
                assert float(b.weight[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
                             .float().abs().max()) == 448.0
    back = fp8.dequantize(b.weight, b.scale, torch.float32)
    grid = b.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal step 2^-9 of the scale
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, grid * 2 ** -10) * 1.0001).all()
    # the stored bytes are the nearest e4m3 values: re-rounding the scaled weight keeps them
    assert torch.equal(b.weight, (w / grid).to(torch.float8_e4m3fn))


def test_keeps_blocks_needs_whole_blocks_from_a_block_edge():
    keeps = fp8.keeps_blocks
    assert keeps(sliced_loader((512, 64), 0, 128, 384), 256)           # whole blocks
    assert keeps(sliced_loader((576, 64), 0, 0, 576), 576)             # ends with the tensor
    assert not keeps(sliced_loader((512, 64), 0, 64, 192), 128)        # starts inside a block
    assert not keeps(sliced_loader((512, 64), 0, 0, 64), 64)           # ends inside one
    assert keeps(sliced_loader((64, 512), 1, 256, 512), 256)           # along K (a row shard)
    # merged parts: at block offsets; a part ending inside a block only as the last
    assert keeps(sliced_loader((576, 64), 0, 0, 576, 1536), 2112)
    assert not keeps(sliced_loader((576, 64), 0, 0, 576, 0), 2112)
    assert not keeps(sliced_loader((256, 64), 0, 0, 256, 64), 320)


def test_checkpoint_tensors_need_their_block_scales():
    w8 = torch.zeros(200, 300).to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match="without .*_scale_inv"):
        fp8.checkpoint_tensor(w8, None, "a.weight")
    with pytest.raises(CheckpointError, match=r"expected \(2, 3\)"):
        fp8.checkpoint_tensor(w8, torch.ones(2, 2), "a.weight")
    with pytest.raises(CheckpointError, match="not float8"):
        fp8.checkpoint_tensor(torch.zeros(200, 300), torch.ones(2, 3), "a.weight")
    b = fp8.checkpoint_tensor(w8, torch.ones(2, 3, dtype=torch.bfloat16), "a.weight")
    assert isinstance(b, fp8.Blocked) and b.scale.dtype == torch.float32


# -- the product ----------------------------------------------------------------

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,N,K,bias", [(1, 200, 136, False), (2, 256, 384, True),
                                        (16, 130, 260, False), (40, 300, 256, True)])
def test_kernel_is_the_dequantized_product(T, N, K, bias, dtype):
    g = torch.Generator().manual_seed(T + N)
    b = fp8.quantize(torch.randn(N, K, generator=g) * torch.logspace(-1, 1, K))
    x = torch.randn(T, K, generator=g)
    bias_t = torch.randn(N, generator=g) if bias else None
    want = F.linear(x, fp8.dequantize(b.weight, b.scale, torch.float32), bias_t)
    got = fp8.linear_triton(x.to(DEV, dtype), b.weight.to(DEV), b.scale.to(DEV),
                            None if bias_t is None else bias_t.to(DEV, dtype))
    assert got.dtype == dtype and got.shape == (T, N)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = float((got.float().cpu() - want).abs().max() / want.abs().max())
    assert err < tol, err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,N,K,bias", [(1, 200, 136, False), (2, 130, 64, True),
                                        (1, 96, 7168, False), (2, 64, 8192, True),
                                        (1, 40, 10944, True), (2, 24, 4160, False)])
def test_the_one_tile_gemv_is_the_dequantized_product(T, N, K, bias, dtype):
    """One or two rows: skinny_gemm's GEMV dequantizes its tile in registers (K split in
    ranges on block edges past 4096: 7168 -> 2 x 3584, 8192 -> 2 x 4096, DeepSeek-V2-Lite's
    dense down 10944 -> 3712 + 3712 + 3520, 4160 -> 2176 + 1984)."""
    from helix.layers import skinny_gemm
    g = torch.Generator().manual_seed(T * N + K)
    b = fp8.quantize(torch.randn(N, K, generator=g) * torch.logspace(-1, 1, K))
    x = torch.randn(T, K, generator=g)
    bias_t = torch.randn(N, generator=g) if bias else None
    assert skinny_gemm.gemv_scaled_fits(x, b.weight)
    want = F.linear(x, fp8.dequantize(b.weight, b.scale, torch.float32), bias_t)
    got = skinny_gemm.gemv_scaled(x.to(DEV, dtype), b.weight.to(DEV), b.scale.to(DEV),
                                  None if bias_t is None else bias_t.to(DEV, dtype))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = float((got.float().cpu() - want).abs().max() / want.abs().max())
    assert err < tol, err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_gemv_with_the_input_norm_is_the_dequantized_product(dtype):
    """The decoder's residual add + RMS norm in the fp8 GEMV's launch (the x projection)."""
    from helix.layers import skinny_gemm
    from helix.layers.fused_ops import add_rms_norm_torch
    g = torch.Generator().manual_seed(3)
    T, N, K = 2, 576, 384
    b = fp8.quantize(torch.randn(N, K, generator=g))
    a, res = torch.randn(T, K, generator=g), torch.randn(T, K, generator=g)
    nw = 1 + 0.1 * torch.randn(K, generator=g)
    x, h_want = add_rms_norm_torch(a, res, nw, 1e-6)
    want = F.linear(x, fp8.dequantize(b.weight, b.scale, torch.float32))
    d = dict(device=DEV, dtype=dtype)
    y, h = skinny_gemm.add_norm_linear_triton(a.to(**d), res.to(**d), nw.to(**d), 1e-6,
                                              b.weight.to(DEV), scale=b.scale.to(DEV))
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert float((y.float().cpu() - want).abs().max() / want.abs().max()) < tol
    torch.testing.assert_close(h.float().cpu(), h_want, atol=tol, rtol=tol)


def test_the_gemv_splits_fp8_k_on_block_edges():
    """K past one tile splits in ranges of whole 128-blocks (the last one shorter), so every
    range's scales start on a block: 4160 -> 2176 + 1984, not 2 x 2080; 16-bit weights keep
    equal ranges; three rows take the tiled kernel."""
    from helix.layers import skinny_gemm
    assert skinny_gemm.split_chunk(4160, 2, scaled=True) == 2176
    assert skinny_gemm.split_chunk(4160, 2) == 2080
    assert skinny_gemm.split_chunk(10944, 3, scaled=True) == 3712
    assert skinny_gemm.split_chunk(2048, 1, scaled=True) == 2048
    w = torch.zeros(64, 4160, dtype=torch.float8_e4m3fn)
    assert skinny_gemm.gemv_scaled_fits(torch.zeros(1, 4160), w)
    assert not skinny_gemm.gemv_scaled_fits(torch.zeros(3, 1024), w[:, :1024])   # 3 rows
    assert skinny_gemm.gemv_scaled_fits(torch.zeros(2, 1024), w[:, :1024].contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_dequantize_kernel_is_dequantize(dtype):
    """Prefill-sized products dequantize first (one fp32 product an element, one rounding):
    bitwise torch's formula, partial blocks included."""
    g = torch.Generator().manual_seed(5)
    b = fp8.quantize(torch.randn(200, 300, generator=g))
    got = fp8.dequantize_triton(b.weight.to(DEV), b.scale.to(DEV), dtype).cpu()
    assert torch.equal(got, fp8.dequantize(b.weight, b.scale, dtype))


def test_a_stack_quantizes_as_its_matrices():
    """fp8.quantize of an [E, N, K] stack is each expert's [N, K] quantization, stacked (and
    dequantizes back through the same grid)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(3, 200, 136, generator=g) * torch.tensor([0.1, 1.0, 10.0])[:, None, None]
    b = fp8.quantize(w)
    assert b.weight.shape == w.shape and b.scale.shape == (3, 2, 2)
    whole = fp8.dequantize(b.weight, b.scale, torch.float32)
    for e in range(3):
        one = fp8.quantize(w[e])
        assert torch.equal(b.scale[e], one.scale)
        assert torch.equal(b.weight[e].view(torch.uint8), one.weight.view(torch.uint8))
        assert torch.equal(whole[e], fp8.dequantize(one.weight, one.scale, torch.float32))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        fp8.quantize(torch.zeros(5))


def test_the_torch_path_is_the_dequantized_product():
    b = fp8.quantize(torch.randn(64, 96))
    x = torch.randn(3, 96)
    assert torch.equal(fp8.linear(x, b.weight, b.scale),
                       x @ fp8.dequantize(b.weight, b.scale, torch.float32).t())


# -- whole runs ----------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_fp8_checkpoint_gives_transformers_tokens_on_its_dequantized_weights(fp8_ckpt, family):
    from transformers import AutoModelForCausalLM
    path, deq, _ = fp8_ckpt(family, wide=True)
    assert read_model_config(path)[0].quantization == "fp8"
    hf = AutoModelForCausalLM.from_pretrained(deq).float().eval()
    want = [hf_greedy(hf, p, 8)[0] for p in PROMPTS]
    got, params = _greedy(path, RuntimeConfig(**SMALL))
    assert got == want
    fp8_held = {n for n, p in params if p.dtype == torch.float8_e4m3fn}
    projections = {n for n, p in params if p.dim() >= 2 and ("proj" in n or "experts" in n)
                   and "kv_b_proj" not in n and not n.endswith("_scale")}
    assert fp8_held == projections                   # and nothing else: embeddings, LM head,
    assert any(n.endswith("attn.in_proj.weight") or "qkv" in n or "x_proj" in n
               for n in fp8_held)                    # router, kv_b_proj stay fp32
    if family != "llama":
        assert any(n.endswith("experts.gate_proj") for n in fp8_held)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_on_one_rank_the_logits_are_the_dequantized_checkpoints(fp8_ckpt, family):
    path, deq, _ = fp8_ckpt(family)
    assert_same_run(cached_run(path, Layout()), cached_run(deq, Layout()), rtol=0.0)


LAYOUTS = [("qwen2", Layout(kvp=2)), ("qwen2", Layout(kvp=1, tpa=2)),
           ("deepseek_v3", Layout(kvp=2, ep=2)), ("deepseek_v3", Layout(kvp=2))]


@pytest.mark.parametrize("family,layout", LAYOUTS,
                         ids=[f"{f}-kvp{x.kvp}-tpa{x.tpa}-ep{x.ep}" for f, x in LAYOUTS])
def test_layouts_give_the_one_rank_run(fp8_ckpt, family, layout):
    """Shards of whole blocks (the wide checkpoints) keep the checkpoint's bytes and scales:
    every layout is the one-rank run (to the reductions' order)."""
    path, _, _ = fp8_ckpt(family, wide=True)
    assert_same_run(cached_run(path, layout), cached_run(path, Layout()))


def test_shards_that_cut_a_block_stay_16_bit_and_exact(fp8_ckpt, caplog):
    """Tiny Llama's FFN over 2 ranks is 64 rows a rank: half a block, dequantized on load."""
    path, deq, _ = fp8_ckpt("llama")
    assert_same_run(cached_run(path, Layout(kvp=2)), cached_run(deq, Layout()))
    with caplog.at_level(logging.INFO, logger="helix"):
        _greedy(path, RuntimeConfig(**SMALL), n=1)
    assert "fp8 weights (128x128 block scales): " in caplog.text


def test_quantizing_at_load_is_the_fp8_checkpoint(fp8_ckpt):
    """quantization="fp8" over a 16-bit checkpoint quantizes each tensor as a checkpoint's
    writer does: the same run, bitwise (a model without MLA: the fp8 checkpoint also rounds
    kv_b_proj, which Helix keeps in 16 bits); "none" over the fp8 checkpoint dequantizes it."""
    path, _, plain = fp8_ckpt("qwen3_moe", wide=True)
    ref, _ = _greedy(path, RuntimeConfig(**SMALL))
    online, params = _greedy(plain, RuntimeConfig(**SMALL, quantization="fp8"))
    assert online == ref and any(p.dtype == torch.float8_e4m3fn for _, p in params)
    path, deq, _ = fp8_ckpt("deepseek_v3", wide=True)
    rt = RuntimeConfig(**SMALL)
    dense, params = _greedy(path, RuntimeConfig(**SMALL, quantization="none"))
    assert dense == _greedy(deq, rt)[0]
    assert all(p.dtype == torch.float32 for _, p in params)


def test_a_preset_runs_with_fp8_weights():
    rt = RuntimeConfig(**SMALL, quantization="fp8")
    out, params = _greedy("tiny-deepseek-v3", rt, n=4)
    assert all(len(o) == 4 for o in out)
    assert sum(p.dtype == torch.float8_e4m3fn for _, p in params) > 3


def test_unsupported_quantizations_are_refused_naming_the_fix(fp8_ckpt, tmp_path):
    path, _, _ = fp8_ckpt("llama")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for i, (qc, match) in enumerate((
            ({"quant_method": "awq", "bits": 4}, "'awq' is not supported"),
            ({**QUANT_CONFIG, "weight_block_size": None}, "weight_block_size None"),
            ("fp8", "must be an object"))):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(CheckpointError, match=match) as e:
            read_model_config(str(bad))
        assert "dequantize this one first" in str(e.value)
    with pytest.raises(ConfigError, match="quantization must be one of auto, fp8, none"):
        RuntimeConfig(quantization="int4")


def test_the_planner_counts_one_byte_a_weight_element():
    """DeepSeek-V3 on 8 H200s: bf16 weights exceed the HBM; fp8 ones are ~half and leave room
    for a 1M-token context (`helix plan --quantization fp8`)."""
    from helix.perf.cost import step_cost, weight_bytes
    from helix.perf.hardware import load_hardware
    from helix.perf.planner import predict
    cfg, _ = read_model_config("deepseek-v3")
    lay = Layout(kvp=8, tpa=1, ep=8, kv_interleave=64)
    bf, f8 = weight_bytes(cfg, lay, 2), weight_bytes(cfg, lay, 2, fp8.element_bytes("fp8", 2))
    assert 0.5 < f8 / bf < 0.52                # embeddings, LM head, kv_b_proj stay 16-bit
    assert fp8.element_bytes(None, 2) == 2
    one = step_cost(cfg, lay, 1, 1024, weight_es=1.0)
    two = step_cost(cfg, lay, 1, 1024)
    assert one.by_phase()["moe"]["bytes"] < 0.55 * two.by_phase()["moe"]["bytes"]  # fp32 router
    hw = load_hardware("h200")
    assert not predict(cfg, lay, 1, 1 << 20, hw, page_size=64).weights_fit
    p = predict(cfg, lay, 1, 1 << 20, hw, page_size=64, weight_es=fp8.element_bytes("fp8", 2))
    assert p.fits and p.weight_gib < 90


@pytest.mark.sm90
def test_fp8_products_compile_for_sm90_without_spills(tmp_path):
    """The projections' kernel at decode and prefill tiles, the one-tile GEMV over fp8 (K split,
    and with the input add + norm) and the experts' kernels with scales, bf16 activations
    (DeepSeek shapes): compiled for sm_90, no spills, tensor cores but in the GEMV."""
    import sm90_compile
    out = tmp_path / "resources.json"
    sm90_compile.run(tmp_path, [os.path.join(sm90_compile.ROOT, "profiling", "kernel_resources.py"),
                                "--cases", "fp8-weights", "--json", str(out)], timeout=600,
                     fp_fusion=True)
    records = json.loads(out.read_text())
    assert [r["kernel"] for r in records].count("_fp8_linear_kernel") == 3
    assert [r["kernel"] for r in records].count("_gemv_kernel") == 3
    assert all(r["constexprs"]["SCALED"] for r in records if r["kernel"] == "_gemv_kernel")
    assert {r["kernel"] for r in records} == {"_fp8_linear_kernel", "_gemv_kernel",
                                              "_dequant_kernel", "_gate_up_kernel",
                                              "_down_kernel"}
    for r in records:                       # the GEMV: fp32 FMA products, by design
        assert r["stack_bytes"] == 0, r
        assert r["kernel"] in ("_gemv_kernel", "_dequant_kernel") or r["hgmma"] + r["hmma"], r


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_on_a_gpu_fp8_runs_give_the_dequantized_checkpoints_tokens(fp8_ckpt, family):
    """CUDA graphs over the fp8 kernels (projections, experts with scales) in fp32: the tokens of
    the dequantized checkpoint's run (cuBLAS over the same values), logits to fp32 rounding."""
    path, deq, _ = fp8_ckpt(family, wide=True)
    runs = []
    for p in (path, deq):
        rt = RuntimeConfig(**SMALL, device="cuda", dtype="float32")
        with LLM(p, Layout(), rt) as llm:
            out = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
            runs.append((out, llm.engine.last_logits.float().cpu().clone()))
            if p == path:
                assert any(q.dtype == torch.float8_e4m3fn
                           for _, q in llm.engine.model.named_parameters())
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)


def test_a_sweep_runs_and_records_fp8_weights(tmp_path):
    from helix.sweep import load_sweep, run_sweep
    path = tmp_path / "sweep.yaml"
    path.write_text("model: tiny-llama\ndevice: cpu\nquantization: fp8\nbatches: [1]\n"
                    "contexts: [9]\ndecode_steps: 2\nwarmup_steps: 1\n")
    (rec,) = run_sweep(load_sweep(str(path)), measure_rates=False)
    assert rec["quantization"] == "fp8" and rec["step_ms_median"] > 0
    path.write_text("model: tiny-llama\ndevice: cpu\nquantization: int4\n")
    with pytest.raises(ConfigError, match="quantization must be one of auto, fp8, none"):
        load_sweep(str(path))


def test_fp8_products_dispatch_by_rows():
    """On CUDA: one or two rows take the GEMV (its add + norm too), up to DEQUANT_ROWS the tiled
    kernel, more the dequantized weight in a GEMM; elsewhere the dequantized product."""
    from unittest import mock

    from helix.layers import skinny_gemm as sg
    b = fp8.quantize(torch.randn(256, 512))
    norm_w = torch.ones(512)
    with mock.patch.object(fp8, "use_triton", lambda t: True), \
            mock.patch.object(sg, "use_triton", lambda t: True), \
            mock.patch.object(sg, "gemv_scaled", lambda x, w, s, bias=None: "gemv"), \
            mock.patch.object(fp8, "linear_triton", lambda x, w, s, bias=None: "tiled"), \
            mock.patch.object(sg, "add_norm_linear_triton", lambda *a, **kw: ("fused", None)):
        assert fp8.linear(torch.zeros(2, 512), b.weight, b.scale) == "gemv"
        assert fp8.linear(torch.zeros(3, 512), b.weight, b.scale) == "tiled"
        assert fp8.linear(torch.zeros(fp8.DEQUANT_ROWS, 512), b.weight, b.scale) == "tiled"
        with mock.patch.object(fp8, "dequantize_triton",
                               lambda w, s, dt: fp8.dequantize(w, s, dt)):
            x = torch.randn(fp8.DEQUANT_ROWS + 1, 512)        # prefill rows: dequantize, GEMM
            assert torch.equal(fp8.linear(x, b.weight, b.scale),
                               x @ fp8.dequantize(b.weight, b.scale, torch.float32).t())
        x16 = torch.zeros(1, 512, dtype=torch.bfloat16)
        assert sg.add_norm_linear(x16, x16, norm_w.bfloat16(), 1e-6, b.weight,
                                  scale=b.scale)[0] == "fused"
        x16 = torch.zeros(4, 512, dtype=torch.bfloat16)
        with mock.patch.object(sg, "add_rms_norm", lambda a, r, w, e: (a, r)):
            assert sg.add_norm_linear(x16, x16, norm_w.bfloat16(), 1e-6, b.weight,
                                      scale=b.scale)[0] == "tiled"
    x = torch.randn(1, 512)
    assert torch.equal(fp8.linear(x, b.weight, b.scale),
                       x @ fp8.dequantize(b.weight, b.scale, torch.float32).t())


def test_fp8_shared_experts_ride_in_the_experts_launches(fp8_ckpt):
    """Where the experts take the fused kernels (here forced on CPU: the kernels run in the
    interpreter), an fp8 model's shared experts are folded into moe_decode's launches with
    their block scales, and the run equals the one with the shared experts as their own MLP."""
    import inspect
    from unittest import mock

    from helix.layers import moe_decode
    from helix.layers.moe import LocalExperts
    path, _, _ = fp8_ckpt("deepseek_v3", wide=True)
    rt = RuntimeConfig(**SMALL)

    def run():
        with LLM(path, Layout(), rt) as llm:
            out = llm.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
            return out, llm.engine.last_logits.float().clone()

    plain, plain_logits = run()
    calls = []
    real = moe_decode.moe_decode

    def spy(*args, **kw):
        bound = inspect.signature(real).bind(*args, **kw).arguments
        calls.append(bound.get("shared") is not None and bound.get("shared_scales") is not None)
        return real(*args, **kw)

    with mock.patch.object(LocalExperts, "graph_safe", property(lambda self: True)), \
            mock.patch.object(moe_decode, "moe_decode", spy):
        folded, folded_logits = run()
    assert calls and all(calls)
    assert folded == plain
    torch.testing.assert_close(folded_logits, plain_logits, rtol=1e-5, atol=1e-5)


def test_the_memory_plan_keeps_room_for_a_dequantized_projection():
    """Prefill chunks multiply a dequantized copy of each fp8 projection: the activation
    reserve holds the largest (Llama-3.1-70B on one rank: gate_up, 2 x 28672 x 8192 bf16)."""
    from helix.runtime.memory import activation_reserve
    cfg, _ = read_model_config("llama-3.1-70b")
    rt = dict(device="cuda", dtype="bfloat16")
    plain = activation_reserve(cfg, Layout(), RuntimeConfig(**rt))
    assert activation_reserve(cfg, Layout(), RuntimeConfig(**rt, quantization="none")) == plain
    extra = activation_reserve(cfg, Layout(), RuntimeConfig(**rt, quantization="fp8")) - plain
    assert extra == 2 * 28672 * 8192 * 2
    halves = activation_reserve(cfg, Layout(tpa=2), RuntimeConfig(**rt, quantization="fp8"))
    assert halves - activation_reserve(cfg, Layout(tpa=2), RuntimeConfig(**rt)) == extra // 2
