"""FLOP floors of a prefill: what one prompt of T tokens costs at the matmul rate, for the models of
profiling/bench_prefill.py (Llama / Qwen GQA, DeepSeek MLA + MoE).

    linear    = 2 T (weights a token multiplies: attention projections, FFN or the k routed +
                shared experts and the router) + 2 D V (the LM head, one row)
    attention = per layer, the causal pairs T (T + 1) / 2 (each query sees itself and all
                earlier tokens):
                GQA: 4 H d pairs (QK^T and PV);
                MLA: the cheaper form of helix/layers/mla_prefill.py for one chunk with no
                cached prefix (decompressed for any T worth measuring), its expansion included.

`floor_s = (linear + attention) / matmul rate`; floor_fraction = floor_s / measured time.
"""

from __future__ import annotations

from helix.config import ModelConfig
from helix.layers.mla_prefill import MLADims, prefill_flops


def _attn_weights(cfg: ModelConfig) -> int:
    """Weights of one layer's attention projections one token multiplies."""
    D, H = cfg.hidden_size, cfg.num_heads
    if not cfg.is_mla:
        return D * (H + 2 * cfg.num_kv_heads) * cfg.head_dim + H * cfg.head_dim * D
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk) if cfg.q_lora_rank else D * H * qk
    return q + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + H * cfg.v_head_dim * D


def _ffn_weights(cfg: ModelConfig, layer: int) -> int:
    D = cfg.hidden_size
    if cfg.is_moe and cfg.moe_layers and cfg.moe_layers[layer]:
        expert = 3 * D * cfg.moe_intermediate_size
        return (D * cfg.num_experts + cfg.experts_per_token * expert
                + cfg.num_shared_experts * expert)
    return 3 * D * cfg.intermediate_size


def linear_flops(cfg: ModelConfig, T: int) -> float:
    per_token = sum(_attn_weights(cfg) + _ffn_weights(cfg, i) for i in range(cfg.num_layers))
    return 2.0 * T * per_token + 2.0 * cfg.hidden_size * cfg.vocab_size


def attention_flops(cfg: ModelConfig, T: int) -> float:
    pairs = T * (T + 1) // 2
    if not cfg.is_mla:
        return 4.0 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
    dims = MLADims(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim)
    one = min(prefill_flops(form, pairs, T, T, cfg.num_heads, dims)
              for form in ("absorbed", "decompressed"))
    return float(one) * cfg.num_layers


def floor_s(cfg: ModelConfig, T: int, matmul_flops: float) -> float:
    return (linear_flops(cfg, T) + attention_flops(cfg, T)) / matmul_flops
