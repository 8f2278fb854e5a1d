"""Parse a Hugging Face config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)
into a ModelConfig."""

from __future__ import annotations

import math

from helix.config import SUPPORTED_ARCHS, ModelConfig, RopeConfig
from helix.errors import CheckpointError


def _rope(f: _Fields, arch: str) -> RopeConfig:
    params = dict(f.dict("rope_parameters"))
    params.update(f.dict("rope_scaling"))
    p = _Fields(params, f"{f.where} rope_scaling")
    theta = p.float("rope_theta", f.float("rope_theta", 10000.0))
    rope_type = p.str("rope_type", p.str("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "yarn", "linear"):
        raise CheckpointError(f"unsupported rope type {rope_type!r}: Helix supports default, "
                              f"llama3, yarn and linear")
    adjacent = arch == "deepseek_v2" or (arch == "deepseek_v3" and f.bool("rope_interleave", True))
    max_pos = f.int("max_position_embeddings", 8192)
    orig = p.int("original_max_position_embeddings", max_pos)
    factor = p.float("factor", max_pos / orig if rope_type == "yarn" else 1.0)
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta, rope_type=rope_type, factor=factor,
        low_freq_factor=p.float("low_freq_factor", 1.0),
        high_freq_factor=p.float("high_freq_factor", 4.0),
        original_max_position=orig,
        beta_fast=p.float("beta_fast", 32.0), beta_slow=p.float("beta_slow", 1.0),
        mscale=p.float("mscale", 0.0, positive=False),
        mscale_all_dim=p.float("mscale_all_dim", 0.0, positive=False),
        attention_factor=None if attention_factor is None else p.float("attention_factor", 1.0),
        truncate=p.bool("truncate", True), adjacent_pairs=bool(adjacent))


class _Fields:
    """Typed reads of config.json fields: a missing required field or a value of the wrong type
    or range is one CheckpointError naming the field, the value and what it must be."""

    def __init__(self, cfg: dict, where: str = "config.json"):
        self.cfg, self.where = cfg, where

    def _bad(self, key: str, value, want: str):
        return CheckpointError(f"{self.where}: {key} = {value!r} is invalid: it must be {want}; "
                               f"fix the checkpoint's config")

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def int(self, key: str, default=None, minimum: int = 1):
        v = self.cfg.get(key)
        if v is None:
            if default is None:
                raise CheckpointError(f"{self.where} lacks {key!r}: the checkpoint's config is "
                                      f"incomplete")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(key, v, f"an integer >= {minimum}")
        if v < minimum:
            raise self._bad(key, v, f"an integer >= {minimum}")
        return v

    def float(self, key: str, default: float, positive: bool = True) -> float:
        v = self.cfg.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                positive and v <= 0):
            raise self._bad(key, v, "a finite positive number" if positive else "a finite number")
        return float(v)

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(key, v, "true or false")
        return v

    def str(self, key: str, default: str) -> str:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(key, v, "a string")
        return v

    def dict(self, key: str) -> dict:
        v = self.cfg.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise self._bad(key, v, "a mapping (JSON object)")
        return v

    def token_ids(self, key: str) -> tuple[int, ...]:
        v = self.cfg.get(key)
        if v is None:
            return ()
        ids = v if isinstance(v, list) else [v]
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise self._bad(key, v, "a token id or a list of token ids (integers >= 0)")
        return tuple(ids)


def _quantization(cfg: dict) -> str | None:
    """config.json's quantization_config -> None (16/32-bit weights) or "fp8" (e4m3 with
    128x128 block scales, DeepSeek-V3's format); other formats are refused, naming the fix."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    fix = ("Helix reads 16/32-bit checkpoints and fp8 ones with 128x128 block scales "
           "(quant_method fp8, weight_block_size [128, 128]): dequantize this one first")
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json: quantization_config must be an object: {fix}")
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"config.json: quantization {method!r} is not supported: {fix}")
    if q.get("fmt", "e4m3") != "e4m3" or list(q.get("weight_block_size") or []) != [128, 128]:
        raise CheckpointError(f"config.json: fp8 with fmt {q.get('fmt', 'e4m3')!r} and "
                              f"weight_block_size {q.get('weight_block_size')!r}: {fix}")
    return "fp8"


def _max_position(f: _Fields, cfg: dict, name: str) -> int:
    """max_position_embeddings, capped at the sliding window where the model attends through
    one (Mistral's sliding_window; Qwen's with use_sliding_window): within the window a
    sliding-window layer attends to every earlier position, so Helix's full attention is
    exact there, and longer requests are refused as too long."""
    most = f.int("max_position_embeddings", 4096)
    windowed = (name == "MistralForCausalLM"
                or (name.startswith("Qwen") and f.bool("use_sliding_window")))
    if windowed and cfg.get("sliding_window") is not None:
        return min(most, f.int("sliding_window"))
    return most


def model_config_from_hf(cfg) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise CheckpointError(f"config.json must hold a JSON object, got {type(cfg).__name__}: "
                              f"fix the checkpoint's config")
    f = _Fields(cfg)
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    name = archs[0] if archs else cfg.get("model_type", "?")
    if name not in SUPPORTED_ARCHS:
        raise CheckpointError(f"unsupported architecture {name!r}: Helix supports "
                              f"{', '.join(sorted(SUPPORTED_ARCHS))}")
    arch = SUPPORTED_ARCHS[name]
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    layers = f.int("num_hidden_layers")
    bos = f.token_ids("bos_token_id")
    common = dict(
        arch=arch, vocab_size=f.int("vocab_size"), hidden_size=hidden, num_layers=layers,
        num_heads=heads, intermediate_size=f.int("intermediate_size"),
        rms_eps=f.float("rms_norm_eps", 1e-6), max_position=_max_position(f, cfg, name),
        tie_embeddings=f.bool("tie_word_embeddings"), rope=_rope(f, arch),
        bos_token_id=bos[0] if bos else None, eos_token_ids=f.token_ids("eos_token_id"),
        quantization=_quantization(cfg))
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"unsupported activation {act!r}: Helix supports silu")

    if arch in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        kv = f.int("num_key_value_heads", heads)
        head_dim = f.int("head_dim", hidden // heads if hidden % heads == 0 else None)
        if not f.has("head_dim") and hidden % heads:
            raise CheckpointError(f"config.json: hidden_size {hidden} is not divisible by "
                                  f"num_attention_heads {heads} and head_dim is not given")
        if heads % kv:
            raise CheckpointError(f"config.json: num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {kv}: fix the checkpoint's config")
        extra = dict(num_kv_heads=kv, head_dim=head_dim, qk_norm=arch in ("qwen3", "qwen3_moe"),
                     qkv_bias=arch == "qwen2" or f.bool("attention_bias"),
                     attention_bias=arch == "llama" and f.bool("attention_bias"),
                     mlp_bias=f.bool("mlp_bias"))
        if arch == "qwen3_moe":
            experts = f.int("num_experts", f.int("num_local_experts", 0, 0), 0)
            step = f.int("decoder_sparse_step", 1)
            dense_only = cfg.get("mlp_only_layers") or []
            if not isinstance(dense_only, list):
                raise CheckpointError("config.json: mlp_only_layers must be a list of layer "
                                      "indices")
            extra.update(
                num_experts=experts, experts_per_token=f.int("num_experts_per_tok"),
                moe_intermediate_size=f.int("moe_intermediate_size"),
                norm_topk_prob=f.bool("norm_topk_prob"),
                moe_layers=tuple(i not in dense_only and (i + 1) % step == 0
                                 for i in range(layers)))
        return ModelConfig(**common, **extra)

    # DeepSeek V2 / V3: MLA + MoE
    experts = f.int("n_routed_experts", 0, 0)
    first_dense = f.int("first_k_dense_replace", 0, 0)
    freq = f.int("moe_layer_freq", 1)
    v3 = arch == "deepseek_v3"
    topk_method = "noaux_tc" if v3 else f.str("topk_method", "greedy")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise CheckpointError(f"unsupported topk_method {topk_method!r}")
    extra = dict(
        num_kv_heads=1, head_dim=0, attention_bias=f.bool("attention_bias"),
        num_experts=experts, experts_per_token=f.int("num_experts_per_tok", 0, 0),
        moe_intermediate_size=f.int("moe_intermediate_size", 0, 0),
        num_shared_experts=f.int("n_shared_experts", 0, 0),
        norm_topk_prob=f.bool("norm_topk_prob") and v3,
        scoring="sigmoid" if v3 else "softmax", topk_method=topk_method,
        n_group=f.int("n_group", 1), topk_group=f.int("topk_group", 1),
        routed_scaling_factor=f.float("routed_scaling_factor", 1.0),
        moe_layers=tuple(experts > 0 and i >= first_dense and i % freq == 0 for i in range(layers)),
        q_lora_rank=f.int("q_lora_rank", 0, 0) or None, kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=f.int("qk_rope_head_dim"),
        v_head_dim=f.int("v_head_dim"))
    if experts and not (extra["experts_per_token"] and extra["moe_intermediate_size"]):
        raise CheckpointError("config.json: a MoE model needs num_experts_per_tok and "
                              "moe_intermediate_size >= 1")
    return ModelConfig(**common, **extra)
