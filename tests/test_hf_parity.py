"""Helix (world 1, fp32, torch backend) against Hugging Face `transformers` on tiny random
checkpoints that the tests build and save: prefill logits, every decode step's logits and >= 16
greedy tokens, for a batch of prompts of different lengths run together in one Helix batch.
The oracle is the HF model's own forward and `generate`, one prompt at a time (no padding)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_fixtures import SMALL, hf_greedy, hf_prefill_logits

from helix import LLM, Layout, RuntimeConfig, SamplingParams

# lengths 1..41 cross page boundaries (page_size 4) and differ per request
PROMPTS = [[5, 17, 42], list(range(3, 83, 2)), [100, 7, 7, 64, 1, 99, 12], [77]]
NEW = 16
RTOL = 1e-4


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def run_helix(path: str, prompts, new: int = NEW, dtype: str = "float32", **runtime):
    """-> (tokens per prompt, logits [S, V] of every step, stacked per step)."""
    with LLM(path, Layout(), RuntimeConfig(dtype=dtype, **{**SMALL, **runtime})) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
               for p in prompts]
        steps = []
        while llm.has_unfinished():
            llm.step()
            steps.append(llm.engine.last_logits.clone())
        assert all(llm.finish_reasons[i] == "length" for i in ids)
        return [llm.outputs[i] for i in ids], steps


def check_parity(path: str, hf, prompts=PROMPTS, rtol: float = RTOL, **runtime) -> None:
    tokens, steps = run_helix(path, prompts, **runtime)
    assert len(steps) == NEW
    seen = set()
    for i, prompt in enumerate(prompts):
        pre = hf_prefill_logits(hf, prompt)
        assert steps[0].shape == (len(prompts), hf.config.vocab_size)
        assert rel_err(steps[0][i], pre) <= rtol, f"prefill logits of prompt {i}"
        want, want_logits = hf_greedy(hf, prompt, NEW)
        assert tokens[i] == want, f"greedy tokens of prompt {i} (len {len(prompt)})"
        for s in range(NEW):
            assert rel_err(steps[s][i], want_logits[s]) <= rtol, f"prompt {i}, step {s}"
        seen |= set(want)
    # the fixture's scale must make greedy decoding non-trivial, or the test proves little
    assert len(seen) >= 4 * len(prompts), f"only {len(seen)} distinct greedy tokens"


CASES = {  # test id -> (family, config overrides)
    "llama": ("llama", {}),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),   # o_proj + MLP biases
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-dense-layer0": ("qwen3_moe", dict(mlp_only_layers=[0])),
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    # kv_a has a bias, q_proj none: one merged GEMM with a bias on part of its rows
    "deepseek_v2-biases": ("deepseek_v2", dict(attention_bias=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(hf_checkpoint, case):
    family, overrides = CASES[case]
    path, hf = hf_checkpoint(family, **overrides)
    check_parity(path, hf)


def test_a_sliding_window_caps_the_context_and_is_exact_within_it(hf_checkpoint):
    """Mistral with sliding_window 64: every request (prompt + output) fits the window, where
    sliding-window attention is full attention: transformers' tokens; max positions = 64, so a
    longer prompt is refused as too long, and generation stops at the window."""
    from helix.errors import RequestError
    from helix.loader import read_model_config
    path, hf = hf_checkpoint("mistral", sliding_window=64)
    assert read_model_config(path)[0].max_position == 64
    check_parity(path, hf, max_context=64)
    with LLM(path, Layout(), RuntimeConfig(**{**SMALL, "max_context": 64})) as llm:
        with pytest.raises(RequestError, match="context of 64"):
            llm.add_request(list(range(3, 67)), SamplingParams(max_new_tokens=8))
        rid = llm.add_request(list(range(3, 63)), SamplingParams(max_new_tokens=8))
        while llm.has_unfinished():
            llm.step()
        assert len(llm.outputs[rid]) == 4 and llm.finish_reasons[rid] == "length"


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_eager_decode_matches_transformers(hf_checkpoint, family):
    """Decode steps without the graph runner (--no-cuda-graphs), 3 requests (a padded bucket of 4
    when graphs are on)."""
    path, hf = hf_checkpoint(family)
    check_parity(path, hf, prompts=PROMPTS[:3], cuda_graphs=False)
    check_parity(path, hf, prompts=PROMPTS[:3], cuda_graphs=True)


def test_deepseek_v3_correction_bias_is_used(hf_checkpoint):
    """The fixture's non-zero e_score_correction_bias changes HF's routing; Helix must load it."""
    path, hf = hf_checkpoint("deepseek_v3")
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0
    with LLM(path, Layout(), RuntimeConfig(**SMALL)) as llm:
        got = llm.engine.model.model.layers[1].mlp.gate.e_score_correction_bias
        torch.testing.assert_close(got, bias, rtol=0, atol=0)


def test_tied_embeddings(hf_checkpoint):
    path, hf = hf_checkpoint("qwen3", tie_word_embeddings=True)
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()          # Helix must reuse the embedding
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    check_parity(path, hf)


def test_sharded_checkpoint(hf_checkpoint):
    path, hf = hf_checkpoint("llama", max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 3 and not os.path.exists(os.path.join(path, "model.safetensors"))
    check_parity(path, hf)


def test_sharded_moe_checkpoint(hf_checkpoint):
    path, hf = hf_checkpoint("deepseek_v3", max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    check_parity(path, hf, prompts=PROMPTS[:2])


def test_bf16_checkpoint_loads_exactly_into_fp32(hf_checkpoint):
    """A bf16 checkpoint run in fp32 equals HF running the same (rounded) weights in fp32."""
    path, hf = hf_checkpoint("qwen3_moe", dtype=torch.bfloat16)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    check_parity(path, _rounded_copy(hf))


def _rounded_copy(hf):
    """The fp32 HF model with every weight rounded through bf16, as the saved checkpoint holds
    it."""
    import copy
    m = copy.deepcopy(hf)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(b.to(torch.bfloat16).float())
    return m


def test_bf16_runtime_close_to_fp32(hf_checkpoint):
    """Helix in bf16 (weights, activations, KV) stays within bf16 error of the fp32 oracle."""
    path, hf = hf_checkpoint("llama")
    tokens, steps = run_helix(path, PROMPTS, new=4, dtype="bfloat16")
    for i, prompt in enumerate(PROMPTS):
        pre = hf_prefill_logits(hf, prompt)
        assert steps[0][i].dtype == torch.float32
        assert rel_err(steps[0][i], pre) <= 5e-2
        assert tokens[i][0] == int(pre.argmax())


def test_greedy_tokens_independent_of_page_size(hf_checkpoint):
    path, hf = hf_checkpoint("deepseek_v2")
    a, _ = run_helix(path, PROMPTS, page_size=1)
    b, _ = run_helix(path, PROMPTS, page_size=16)
    assert a == b
