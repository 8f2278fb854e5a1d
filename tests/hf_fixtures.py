"""Tiny random Hugging Face checkpoints, built with `transformers` and saved as safetensors.

Every family is small (hidden 64, 2 layers, vocab 128) so a whole parity run takes seconds on CPU.
Weights are re-initialised with a larger scale than `transformers`' default (std 0.02), otherwise
the logits are nearly flat and greedy decoding repeats one token, which would hide most bugs.
eos is disabled in every config: HF `generate` and Helix both run exactly max_new_tokens.
"""

from __future__ import annotations

import copy
import math
import os

import torch

VOCAB = 128
HIDDEN = 64
# Helix RuntimeConfig fields for these models: a small pool and context (tiny models need KB, not
# the GB an 8k-context default pool takes) and small pages, so prompts span several of them
SMALL = dict(max_context=256, max_batch=8, page_size=4)


def _common(**kw) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, tie_word_embeddings=False)
    base.update(kw)
    return base


def llama_config(**kw):
    """Llama 3.x GQA with llama3 RoPE scaling. head_dim 16 -> wavelengths 6..20k positions, so with
    original context 256 the three llama3 regions (kept, smoothed, divided by factor) all occur."""
    from transformers import LlamaConfig
    return LlamaConfig(**_common(**{
        **dict(num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
               rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=256)),
        **kw}))


def mistral_config(**kw):
    """Mistral: Llama's layers without RoPE scaling; sliding_window None (Nemo, Large 2) unless
    given."""
    from transformers import MistralConfig
    return MistralConfig(**_common(**{
        **dict(num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
               sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        **kw}))


def qwen2_config(**kw):
    """Qwen2: bias on q/k/v, none on o_proj."""
    from transformers import Qwen2Config
    return Qwen2Config(**_common(num_key_value_heads=2, max_position_embeddings=1024,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                                 **kw))


def qwen3_config(**kw):
    """Qwen3: per-head q/k RMSNorm, head_dim not hidden/heads."""
    from transformers import Qwen3Config
    return Qwen3Config(**_common(num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                                 **kw))


def qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**_common(**{
        **dict(num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
               decoder_sparse_step=1,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        **kw}))


def deepseek_v2_config(**kw):
    """DeepSeek-V2 without q_lora (direct q_proj, as V2-Lite), group-limited greedy routing: top-2
    inside the best of 2 groups (with topk_group >= k the group limit could never matter)."""
    from transformers import DeepseekV2Config
    return DeepseekV2Config(**_common(
        num_key_value_heads=4, max_position_embeddings=1024, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), **kw))


def deepseek_v3_config(**kw):
    """DeepSeek-V3: q_lora, YaRN (factor 4, mscale != mscale_all_dim, so both the cos/sin factor
    and the softmax-scale correction differ from 1), sigmoid routing with groups."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**_common(**{
        **dict(num_key_value_heads=4, max_position_embeddings=1024, q_lora_rank=48,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
               norm_topk_prob=True, routed_scaling_factor=2.5,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                    original_max_position_embeddings=256, beta_fast=32.0,
                                    beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)),
        **kw}))


FAMILIES = {
    "llama": ("LlamaForCausalLM", llama_config),
    "mistral": ("MistralForCausalLM", mistral_config),
    "qwen2": ("Qwen2ForCausalLM", qwen2_config),
    "qwen3": ("Qwen3ForCausalLM", qwen3_config),
    "qwen3_moe": ("Qwen3MoeForCausalLM", qwen3_moe_config),
    "deepseek_v2": ("DeepseekV2ForCausalLM", deepseek_v2_config),
    "deepseek_v3": ("DeepseekV3ForCausalLM", deepseek_v3_config),
}


@torch.no_grad()
def reinit(model: torch.nn.Module, seed: int, embed_std: float = 1.0) -> None:
    """Weights with std ~1.5/sqrt(fan_in) (embeddings `embed_std`, norms ~1, biases 0.1, correction
    bias non-zero), drawn from one seeded generator in parameter order."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:                                        # biases
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(embed_std * torch.randn(p.shape, generator=g))
        else:
            std = 1.5 / math.sqrt(p.shape[-1])
            p.copy_(std * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):              # V3: shifts the expert choice
            b.copy_(0.3 * torch.rand(b.shape, generator=g))


def build_hf(family: str, seed: int = 0, **config_kw) -> torch.nn.Module:
    """A tiny random `transformers` model of `family` in fp32, eval mode, eos disabled."""
    import transformers
    arch, make_config = FAMILIES[family]
    config = make_config(**config_kw)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float().eval()
    # tied: a large embedding makes the LM head copy the input token (logits ~ e_x . E), so keep
    # it small next to what the layers add to the residual
    tied = model.config.tie_word_embeddings
    reinit(model, seed, embed_std=0.1 if tied else 1.0)
    if tied:
        model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    return model


def save_hf(model: torch.nn.Module, path: str, dtype: torch.dtype = torch.float32,
            max_shard_size: str | None = None) -> str:
    """Save as safetensors (optionally in `dtype`, optionally sharded with an index json)."""
    os.makedirs(path, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if dtype != torch.float32:                  # a copy: the caller keeps the fp32 model
        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def make_checkpoint(root: str, family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, tag: str = "",
                    **config_kw) -> tuple[str, torch.nn.Module]:
    """Build, save under root/<family><tag>; returns (path, fp32 HF model)."""
    model = build_hf(family, seed, **config_kw)
    path = save_hf(model, os.path.join(root, family + tag), dtype, max_shard_size)
    return path, model


@torch.no_grad()
def hf_prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits [V] fp32 of the last prompt position, from the HF model's own forward."""
    out = model(torch.tensor([prompt]), use_cache=False)
    return out.logits[0, -1].float()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF `generate`, greedy, exactly n new tokens -> (tokens, per-step logits [V] fp32)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [x[0].float() for x in out.logits]


@torch.no_grad()
def hf_processed_argmax(hf, prompt: list[int], out: list[int], sp) -> list[int]:
    """At each step of `out`: the argmax of HF's logits after sp's logit_bias, repetition
    penalty (HF's RepetitionPenaltyLogitsProcessor), frequency and presence penalties."""
    from collections import Counter

    from transformers import RepetitionPenaltyLogitsProcessor
    logits = hf(torch.tensor([prompt + out]), use_cache=False).logits[0].float()
    rep = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)
    want = []
    for s in range(len(out)):
        x = logits[len(prompt) - 1 + s].clone()
        for t, b in sp.logit_bias:
            x[t] += b
        x = rep(torch.tensor([prompt + out[:s]]), x[None])[0]
        for t, c in Counter(out[:s]).items():
            x[t] -= sp.frequency_penalty * c + sp.presence_penalty
        want.append(int(x.argmax()))
    return want
