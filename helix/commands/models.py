"""`helix models`: the model presets (random weights, real shapes) and their shapes."""

from __future__ import annotations

from helix.loader import list_presets, read_model_config


def add_parser(subparsers):
    p = subparsers.add_parser("models", help="list the model presets and their shapes")
    p.set_defaults(func=run)
    return p


def parameters(cfg) -> float:
    """Parameter count (embedding, attention, FFN / experts, LM head), for the listing."""
    D, L = cfg.hidden_size, cfg.num_layers
    if cfg.is_mla:
        q = (D * cfg.q_lora_rank
             + cfg.q_lora_rank * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
             if cfg.q_lora_rank
             else D * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
        attn = (q + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                + cfg.kv_lora_rank * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                + cfg.num_heads * cfg.v_head_dim * D)
    else:
        attn = D * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    moe = sum(cfg.moe_layers) if cfg.moe_layers else 0
    dense = L - moe
    expert = 3 * D * cfg.moe_intermediate_size
    ffn = dense * 3 * D * cfg.intermediate_size + moe * expert * (
        cfg.num_experts + cfg.num_shared_experts)
    embed = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2)
    return L * attn + ffn + embed


def run(args) -> int:
    print(f"{'preset':<22} {'arch':<12} {'layers':>6} {'hidden':>6} {'heads':>9} "
          f"{'experts':>9} {'context':>8} {'params':>8}")
    for name in list_presets():
        cfg, _ = read_model_config(name)
        heads = (f"{cfg.num_heads}/MLA" if cfg.is_mla else f"{cfg.num_heads}/{cfg.num_kv_heads}")
        experts = f"{cfg.num_experts}x{cfg.experts_per_token}" if cfg.is_moe else "-"
        n = parameters(cfg)
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        print(f"{name:<22} {cfg.arch:<12} {cfg.num_layers:>6} {cfg.hidden_size:>6} {heads:>9} "
              f"{experts:>9} {cfg.max_position:>8} {size:>8}")
    print("heads: query/KV heads (MLA: one latent KV head). Use a preset with --model NAME; "
          "--layers n keeps the first n layers.")
    return 0
