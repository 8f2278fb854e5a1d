"""Rotary position embedding with default, linear, llama3 and YaRN frequency schedules.
cos/sin tables are precomputed for [0, max_position) and indexed by the global position."""

from __future__ import annotations

import math

import torch
from torch import nn

from helix.config import RopeConfig
from helix.layers.fused_ops import rope as apply_rope


def inv_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] fp32, factor applied to cos and sin)."""
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = 1.0 / base
    if rope.rope_type == "linear":
        return inv / rope.factor, 1.0
    if rope.rope_type == "llama3":
        low_wl = rope.original_max_position / rope.low_freq_factor
        high_wl = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, inv)
    return inv, 1.0


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, extrapolated: torch.Tensor) -> tuple[torch.Tensor, float]:
    f = rope.factor
    if rope.attention_factor is not None:
        attn = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn = _yarn_mscale(f, rope.mscale) / _yarn_mscale(f, rope.mscale_all_dim)
    else:
        attn = _yarn_mscale(f)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                  # 1: extrapolate (high freq), 0: interpolate
    inv = (extrapolated / f) * (1 - keep) + extrapolated * keep
    return inv, attn


class RotaryEmbedding(nn.Module):
    """apply(x [T, h, dim], pos [T]) rotates x by its global position."""

    def __init__(self, rope: RopeConfig, dim: int, max_position: int):
        super().__init__()
        inv, attn = inv_frequencies(rope, dim)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", freqs.cos() * attn, persistent=False)   # [P, dim/2]
        self.register_buffer("sin", freqs.sin() * attn, persistent=False)
        self.adjacent_pairs = rope.adjacent_pairs

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [T, h, dim] (any strides) -> [T, h, dim] in x.dtype, computed in fp32. adjacent_pairs:
        pairs (2i, 2i+1), output in [evens | odds] order; else halves (rotate_half). One Triton
        kernel on CUDA (helix.layers.fused_ops.rope)."""
        return apply_rope(x, self.cos, self.sin, pos, self.adjacent_pairs)
