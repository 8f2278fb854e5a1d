"""DeepSeek-V2/V3: MLA attention (absorbed for decode) and MoE with shared experts after the
first `first_k_dense_replace` dense layers."""

from helix.layers.attention_mla import MLAAttention
from helix.layers.mlp import ParallelMLP
from helix.layers.moe import MoE
from helix.layers.rope import RotaryEmbedding
from helix.models.base import CausalLM, DecoderLayer


def build(cfg, comm, dtype, max_position):
    rope = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, max_position)
    layers = [DecoderLayer(cfg, MLAAttention(cfg, comm, rope, dtype),
                           MoE(cfg, comm, dtype) if cfg.moe_layers[i]
                           else ParallelMLP(cfg.hidden_size, cfg.intermediate_size, comm,
                                            dtype=dtype), dtype)
              for i in range(cfg.num_layers)]
    return CausalLM(cfg, comm, layers, dtype)
