"""Llama 3.x / Qwen2 / Qwen3: GQA attention (+ q/k norm for Qwen3) and a dense gated MLP."""

from helix.layers.attention_gqa import GQAAttention
from helix.layers.mlp import ParallelMLP
from helix.layers.rope import RotaryEmbedding
from helix.models.base import CausalLM, DecoderLayer


def build(cfg, comm, dtype, max_position):
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_position)
    layers = [DecoderLayer(cfg, GQAAttention(cfg, comm, rope, dtype),
                           ParallelMLP(cfg.hidden_size, cfg.intermediate_size, comm, cfg.mlp_bias,
                                       dtype), dtype)
              for _ in range(cfg.num_layers)]
    return CausalLM(cfg, comm, layers, dtype)
