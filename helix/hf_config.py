"""Parse a Hugging Face config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)
into a ModelConfig."""

from __future__ import annotations

from helix.config import SUPPORTED_ARCHS, ModelConfig, RopeConfig
from helix.errors import CheckpointError


def _rope(cfg: dict, arch: str) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "yarn", "linear"):
        raise CheckpointError(f"unsupported rope type {rope_type!r}: Helix supports default, llama3, "
                              f"yarn and linear")
    interleave = arch == "deepseek_v2" or (arch == "deepseek_v3" and cfg.get("rope_interleave", True))
    orig = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 8192)
    factor = params.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", orig) / orig if rope_type == "yarn" else 1.0
    return RopeConfig(
        theta=float(theta), rope_type=rope_type, factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(orig),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleave=bool(interleave))


def _eos(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _need(cfg: dict, key: str):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"config.json lacks {key!r}: the checkpoint's config is incomplete")
    return cfg[key]


def model_config_from_hf(cfg: dict) -> ModelConfig:
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else cfg.get("model_type", "?")
    if name not in SUPPORTED_ARCHS:
        raise CheckpointError(f"unsupported architecture {name!r}: Helix supports "
                              f"{', '.join(sorted(SUPPORTED_ARCHS))}")
    arch = SUPPORTED_ARCHS[name]
    heads = int(_need(cfg, "num_attention_heads"))
    hidden = int(_need(cfg, "hidden_size"))
    layers = int(_need(cfg, "num_hidden_layers"))
    common = dict(
        arch=arch, vocab_size=int(_need(cfg, "vocab_size")), hidden_size=hidden, num_layers=layers,
        num_heads=heads, intermediate_size=int(_need(cfg, "intermediate_size")),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=_rope(cfg, arch), bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"unsupported activation {act!r}: Helix supports silu")

    if arch in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        kv = int(cfg.get("num_key_value_heads") or heads)
        extra = dict(num_kv_heads=kv, head_dim=int(cfg.get("head_dim") or hidden // heads),
                     qk_norm=arch in ("qwen3", "qwen3_moe"),
                     qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                     o_bias=arch == "llama" and bool(cfg.get("attention_bias", False)),
                     mlp_bias=bool(cfg.get("mlp_bias", False)))
        if arch == "qwen3_moe":
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            step = int(cfg.get("decoder_sparse_step", 1))
            dense_only = set(cfg.get("mlp_only_layers") or [])
            extra.update(
                num_experts=experts, experts_per_token=int(_need(cfg, "num_experts_per_tok")),
                moe_intermediate_size=int(_need(cfg, "moe_intermediate_size")),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers)))
        return ModelConfig(**common, **extra)

    # DeepSeek V2 / V3: MLA + MoE
    experts = int(cfg.get("n_routed_experts") or 0)
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1))
    v3 = arch == "deepseek_v3"
    topk_method = "noaux_tc" if v3 else cfg.get("topk_method", "greedy")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise CheckpointError(f"unsupported topk_method {topk_method!r}")
    extra = dict(
        num_kv_heads=1, head_dim=0, o_bias=bool(cfg.get("attention_bias", False)),
        num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) and v3,
        scoring="sigmoid" if v3 else "softmax", topk_method=topk_method,
        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_layers=tuple(experts > 0 and i >= first_dense and i % freq == 0 for i in range(layers)),
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(_need(cfg, "kv_lora_rank")),
        qk_nope_head_dim=int(_need(cfg, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim")), v_head_dim=int(_need(cfg, "v_head_dim")))
    return ModelConfig(**common, **extra)
