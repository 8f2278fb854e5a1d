"""Qwen3-MoE: GQA attention with q/k norm; softmax top-k routed experts (no shared expert)."""

from helix.layers.attention_gqa import GQAAttention
from helix.layers.mlp import ParallelMLP
from helix.layers.moe import MoE
from helix.layers.rope import RotaryEmbedding
from helix.models.base import CausalLM, DecoderLayer


def build(cfg, comm, dtype, max_position):
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_position)
    layers = [DecoderLayer(cfg, GQAAttention(cfg, comm, rope, dtype),
                           MoE(cfg, comm, dtype) if cfg.moe_layers[i]
                           else ParallelMLP(cfg.hidden_size, cfg.intermediate_size, comm,
                                            dtype=dtype), dtype)
              for i in range(cfg.num_layers)]
    return CausalLM(cfg, comm, layers, dtype)
