"""Model families, keyed by ModelConfig.arch."""

from helix.models import deepseek, llama, qwen3_moe

BUILDERS = {"llama": llama.build, "qwen2": llama.build, "qwen3": llama.build,
            "qwen3_moe": qwen3_moe.build, "deepseek_v2": deepseek.build,
            "deepseek_v3": deepseek.build}


def build_model(cfg, comm, dtype, max_position):
    return BUILDERS[cfg.arch](cfg, comm, dtype, max_position)
