"""KV transfer between a prefill server and Helix (prefill/decode disaggregation): the format, its
validation, what one rank keeps of it, and conversions from Helix's own export and from a Hugging
Face cache.

The format: the KV of a prompt's positions 0..T-1, every layer, all KV heads, as the attention
reads it (keys after RoPE, as Helix and Hugging Face cache them):

- GQA (Llama, Qwen): layer -> (K [T, Hkv, d], V [T, Hkv, d]);
- MLA (DeepSeek): layer -> latent rows [T, kv_lora + rope] (the normed latent, then the roped key);

as a dict {layer index: tensors}, or a safetensors file holding `layers.{i}.k` / `layers.{i}.v`
(GQA) or `layers.{i}.kv` (MLA) for i = 0..L-1 (`save_kv` writes one). Any float dtype (cast to the
cache's). T may be shorter than the prompt: the rest is prefilled; the last prompt position is
always recomputed (its logits give the first token), so KV of the whole prompt is fine too.

A dict travels to every rank inside the step's commands; a file is opened by every rank itself
(same path on every rank: shared storage), each reading only its KV heads, and keeping only the
positions it owns (the ownership rule, helix/kv/ownership.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from helix.config import ModelConfig
from helix.errors import RequestError


@dataclass(frozen=True)
class ImportedKV:
    """A validated KV import: `tensors` (layer -> tuple of [T, ...] CPU tensors) or `path`."""

    length: int                                   # T: positions 0..T-1
    tensors: dict | None = None
    path: str | None = None

    def rows(self, layer: int, positions: torch.Tensor, heads: tuple[int, int] | None
             ) -> tuple[torch.Tensor, ...]:
        """This rank's part of one layer: rows at `positions` [n] (and KV heads [h0, h1) for GQA)
        -> ([n, h1 - h0, d], [n, h1 - h0, d]) or ([n, C],)."""
        parts = self._layer(layer, heads)
        return tuple(p[positions] for p in parts)

    def _layer(self, layer: int, heads) -> tuple[torch.Tensor, ...]:
        if self.tensors is not None:
            parts = self.tensors[layer]
            return tuple(p if heads is None else p[:, heads[0]:heads[1]] for p in parts)
        from safetensors import safe_open
        with safe_open(self.path, framework="pt") as f:
            names = _names(layer, heads is None)
            if heads is None:
                return tuple(f.get_tensor(n) for n in names)
            return tuple(f.get_slice(n)[:, heads[0]:heads[1]] for n in names)


def _names(layer: int, mla: bool) -> tuple[str, ...]:
    return (f"layers.{layer}.kv",) if mla else (f"layers.{layer}.k", f"layers.{layer}.v")


def _shapes(cfg: ModelConfig, T: int) -> tuple[tuple[int, ...], ...]:
    """Expected shapes of one layer's tensors for T positions."""
    if cfg.is_mla:
        return ((T, cfg.kv_lora_rank + cfg.qk_rope_head_dim),)
    return ((T, cfg.num_kv_heads, cfg.head_dim),) * 2


def _check_layer(cfg: ModelConfig, layer: int, shapes: list[tuple[int, ...]], dtypes: list,
                 length: int | None) -> int:
    """The layer's T, after checking its tensor count, shapes and dtypes against the model."""
    want = _shapes(cfg, shapes[0][0] if shapes and shapes[0] else 0)
    what = ("latent rows [T, kv_lora + rope]" if cfg.is_mla else "(K [T, Hkv, d], V [T, Hkv, d])")
    if len(shapes) != len(want) or any(tuple(s) != w for s, w in zip(shapes, want)):
        got = ", ".join(str(list(s)) for s in shapes)
        raise RequestError(f"kv layer {layer}: expected {what} = "
                           f"{', '.join(str(list(w)) for w in want)}, got {got}")
    if any(not d.is_floating_point for d in dtypes):
        raise RequestError(f"kv layer {layer}: tensors must be floating point, got "
                           f"{', '.join(str(d) for d in dtypes)}")
    T = want[0][0]
    if T < 1:
        raise RequestError(f"kv layer {layer} holds no positions: give T >= 1 rows")
    if length is not None and T != length:
        raise RequestError(f"kv layer {layer} holds {T} positions, layer 0 holds {length}: every "
                           f"layer covers the same positions 0..T-1")
    return T


def _as_tuple(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    raise RequestError(f"kv values must be tensors: (K, V) for GQA or the latent rows for MLA, "
                       f"got {type(value).__name__}")


def check_kv(kv, cfg: ModelConfig) -> ImportedKV:
    """A user's KV import (dict or safetensors path) checked against the model: every layer
    0..L-1 present, nothing else, shapes and dtypes right. Tensors are copied to the CPU."""
    if isinstance(kv, ImportedKV):
        return kv
    if isinstance(kv, (str, os.PathLike)):
        return _check_file(os.fspath(kv), cfg)
    if not isinstance(kv, dict):
        raise RequestError(f"kv must be a dict layer -> tensors or a safetensors file path, got "
                           f"{type(kv).__name__}")
    layers = {}
    for key, value in kv.items():
        if isinstance(key, bool) or not hasattr(key, "__index__"):
            raise RequestError(f"kv keys are layer indices, got {key!r}")
        layers[int(key)] = _as_tuple(value)
    _check_layer_set(set(layers), cfg)
    length = None
    out = {}
    for i in range(cfg.num_layers):
        parts = layers[i]
        length = _check_layer(cfg, i, [tuple(p.shape) for p in parts], [p.dtype for p in parts],
                              length)
        out[i] = tuple(p.detach().to("cpu").contiguous() for p in parts)
    return ImportedKV(length, tensors=out)


def _check_layer_set(have: set[int], cfg: ModelConfig) -> None:
    want = set(range(cfg.num_layers))
    if have - want:
        raise RequestError(f"kv holds layer {min(have - want)}, the model has layers "
                           f"0..{cfg.num_layers - 1}")
    if want - have:
        raise RequestError(f"kv lacks layer {min(want - have)}: give every layer "
                           f"0..{cfg.num_layers - 1}")


def _check_file(path: str, cfg: ModelConfig) -> ImportedKV:
    from safetensors import SafetensorError, safe_open
    if not os.path.isfile(path):
        raise RequestError(f"kv file {path} not found: give a safetensors file (helix.kv.transfer"
                           f".save_kv writes one)")
    try:
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
            layers = {int(n.split(".")[1]) for n in names
                      if n.startswith("layers.") and n.split(".")[1].isdigit()}
            _check_layer_set(layers, cfg)
            length = None
            for i in range(cfg.num_layers):
                want = _names(i, cfg.is_mla)
                missing = [n for n in want if n not in names]
                if missing:
                    raise RequestError(f"kv file {path} lacks tensor {missing[0]!r}")
                slices = [f.get_slice(n) for n in want]
                shapes = [tuple(s.get_shape()) for s in slices]
                dtypes = [_dtype(s.get_dtype()) for s in slices]
                length = _check_layer(cfg, i, shapes, dtypes, length)
    except SafetensorError as e:
        raise RequestError(f"kv file {path} is not a readable safetensors file: {e}") from None
    return ImportedKV(length, path=os.path.abspath(path))


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}


def _dtype(name: str) -> torch.dtype:
    return _DTYPES.get(name, torch.int64)         # anything else: refused as not floating point


def save_kv(kv: dict, path: str) -> str:
    """Write a KV dict (the format above) as a safetensors file."""
    from safetensors.torch import save_file
    tensors = {}
    for layer, value in kv.items():
        parts = _as_tuple(value)
        for name, t in zip(_names(int(layer), len(parts) == 1), parts):
            tensors[name] = t.detach().to("cpu").contiguous()
    save_file(tensors, path, metadata={"format": "helix-kv"})
    return path


def kv_from_hf(past_key_values, batch_index: int = 0) -> dict:
    """A Hugging Face GQA cache (a DynamicCache, or the legacy tuple of (k, v) per layer, each
    [B, Hkv, T, d]) -> the dict format for one sequence of the batch. HF caches keys after RoPE,
    as Helix does. (HF's DeepSeek caches decompressed per-head K/V, not MLA's latent rows: export
    those from Helix instead.)"""
    if hasattr(past_key_values, "layers"):                        # transformers >= 4.56
        pairs = [(layer.keys, layer.values) for layer in past_key_values.layers]
    elif hasattr(past_key_values, "key_cache"):
        pairs = list(zip(past_key_values.key_cache, past_key_values.value_cache))
    else:
        pairs = [(k, v) for k, v in past_key_values]
    return {i: (k[batch_index].transpose(0, 1).contiguous(),
                v[batch_index].transpose(0, 1).contiguous()) for i, (k, v) in enumerate(pairs)}


def assemble(parts: list[dict], cfg: ModelConfig, length: int) -> dict:
    """The KV dict of one sequence from every rank's export (Engine.export_kv): each part holds
    its positions [n] and heads (h0, h1), and per layer its rows."""
    out = {}
    for layer in range(cfg.num_layers):
        full = None
        for part in parts:
            rows = part["layers"][layer]
            if full is None:
                full = [torch.zeros((length, *s[1:]), dtype=r.dtype)
                        for s, r in zip(_shapes(cfg, length), rows)]
            pos, heads = part["positions"], part["heads"]
            for f, r in zip(full, rows):
                if heads is None:
                    f[pos] = r
                else:
                    f[pos, heads[0]:heads[1]] = r
        out[layer] = tuple(full) if len(full) > 1 else full[0]
    return out
