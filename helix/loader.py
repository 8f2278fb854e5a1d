"""Model construction and weights: a Hugging Face checkpoint directory (config.json + safetensors,
single file or sharded index) or a preset YAML with random weights. Each rank reads only the
slices its layout gives it; missing or mis-shaped tensors fail with the tensor's name. A tensor
with a `<name>_scale_inv` beside it is block fp8 (helix.layers.fp8.Blocked): kept as fp8 by the
layers converted to fp8 (`to_fp8`, RuntimeConfig.quantization), dequantized for the others."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import zlib
from collections.abc import Iterator

import torch

from helix.config import ModelConfig
from helix.errors import CheckpointError, ConfigError
from helix.layers import fp8
from helix.layers.moe import PROJS, LocalExperts
from helix.models import build_model
from helix.yamlio import load_yaml

log = logging.getLogger("helix")

PRESET_DIR = os.environ.get("HELIX_PRESETS") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")


def preset_path(name: str) -> str | None:
    path = os.path.join(PRESET_DIR, f"{name}.yaml")
    return path if os.path.isfile(path) else None


def list_presets() -> list[str]:
    if not os.path.isdir(PRESET_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml"))


def read_model_config(model: str, layers: int = 0) -> tuple[ModelConfig, str | None]:
    """-> (config, checkpoint dir or None for a random-weight preset); `layers` > 0 keeps only the
    first `layers` decoder layers."""
    cfg, ckpt = _read_model_config(model)
    return (cfg.with_layers(layers) if layers else cfg), ckpt


def _read_model_config(model: str) -> tuple[ModelConfig, str | None]:
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"{model} has no config.json: point --model at a Hugging Face "
                                  f"checkpoint directory or a preset ({', '.join(list_presets())})")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON "
                                  f"({e.msg} at line {e.lineno})") from None
        return ModelConfig.from_hf(cfg), model
    path = (model if model.endswith((".yaml", ".yml")) and os.path.isfile(model)
            else preset_path(model))
    if path is None:
        raise CheckpointError(f"model {model!r} not found: give a checkpoint directory or one of "
                              f"the presets {', '.join(list_presets())}")
    spec = load_yaml(path)
    if not isinstance(spec, dict) or not isinstance(spec.get("hf_config"), dict):
        raise ConfigError(f"{path}: a model preset needs an 'hf_config' mapping "
                          f"(config.json fields)")
    cfg = ModelConfig.from_hf(spec["hf_config"])
    layers = spec.get("layers")
    if layers:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ConfigError(f"{path}: layers must be a positive integer, got {layers!r}")
        cfg = cfg.with_layers(layers)
    return cfg, None


def expected_tensors(model: torch.nn.Module) -> Iterator[tuple[str, tuple[int, ...], object]]:
    """(checkpoint name, full shape, loader(full, name)) for every tensor this rank needs;
    `full` may be an fp8 checkpoint's Blocked tensor (dequantized here for 16-bit parameters)."""
    def call(f, p):
        if fp8.is_fp8(p):
            return lambda t, n: f(p, t, n)
        return lambda t, n: f(p, fp8.dense(t, p.dtype), n)

    for name, p in model.named_parameters():
        if ".experts." in name and isinstance(_owner(model, name), LocalExperts):
            continue
        if getattr(p, "with_weight", False):   # an fp8 weight's block scales: loaded with it
            continue
        parts = getattr(p, "checkpoint_parts", None)
        if parts:  # fused parameter: one checkpoint tensor per part, `<parent>.<part>.<leaf>`
            parent, _, leaf = name.rsplit(".", 2)
            for part, f in parts:
                yield f"{parent}.{part}.{leaf}", f.full_shape, call(f, p)
            continue
        loader = p.weight_loader
        yield name, getattr(loader, "full_shape", tuple(p.shape)), call(loader, p)
    for prefix, mod in model.named_modules():
        if isinstance(mod, LocalExperts):
            for e in range(mod.first, mod.first + mod.n_local):
                for proj in PROJS:
                    shape = mod.loaders[proj].full_shape
                    yield (f"{prefix}.{e}.{proj}.weight", shape,
                           lambda t, n, m=mod, e=e, pr=proj: m.load_expert(e, pr, t, n))


def _owner(model, param_name: str):
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def _safe_open(file: str):
    """safe_open that reports a corrupt or truncated file as a CheckpointError, not a traceback."""
    from safetensors import safe_open
    try:
        return safe_open(file, "pt")
    except Exception as e:  # SafetensorError (bad header) or OSError
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}): re-save the "
                              f"checkpoint") from None


class _SafetensorsIndex:
    def __init__(self, path: str):
        single = os.path.join(path, "model.safetensors")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index} is not a safetensors index (JSON with a "
                                      f"'weight_map'): re-save the checkpoint") from None
            self.files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            with _safe_open(single) as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise CheckpointError(f"{path} has no model.safetensors or "
                                  f"model.safetensors.index.json: save the checkpoint with "
                                  f"safe_serialization=True")
        self._handles = {}

    def get(self, name: str) -> torch.Tensor | None:
        file = self.files.get(name)
        if file is None:
            return None
        if file not in self._handles:
            if not os.path.isfile(file):
                raise CheckpointError(f"shard {file} listed in the index is missing")
            self._handles[file] = _safe_open(file)
        try:
            return self._handles[file].get_tensor(name)
        except Exception as e:  # data past the end of a truncated file
            raise CheckpointError(f"cannot read tensor {name!r} from {file} ({e}): re-save the "
                                  f"checkpoint") from None


def _progress(model: torch.nn.Module, what: str, show: bool):
    """expected_tensors with a progress bar on a terminal (large models take minutes)."""
    tensors = list(expected_tensors(model))
    if not show:
        return tensors
    from tqdm import tqdm
    return tqdm(tensors, desc=what, unit="tensor", disable=None, leave=False, file=sys.stderr)


def load_checkpoint(model: torch.nn.Module, path: str, show: bool = False) -> None:
    files = _SafetensorsIndex(path)
    for name, _, load in _progress(model, f"loading {path}", show):
        t = files.get(name)
        if t is None:
            raise CheckpointError(f"checkpoint {path} lacks tensor {name!r}")
        scale = files.get(f"{name}_scale_inv") if name.endswith(".weight") else None
        load(fp8.checkpoint_tensor(t, scale, name), name)


def _seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + 1000003 * seed) % (2 ** 63)


def init_random(model: torch.nn.Module, seed: int, device, show: bool = False) -> None:
    """Deterministic random weights: each full tensor is drawn from a generator seeded by its name,
    so every layout slices the same model."""
    for name, shape, load in _progress(model, "random weights", show):
        g = torch.Generator(device=device).manual_seed(_seed(name, seed))
        if re.search(r"norm\.weight$", name):
            full = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
        elif name.endswith("e_score_correction_bias"):
            full = 0.1 * torch.rand(shape, generator=g, device=device)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            std = 1.0 if "embed_tokens" in name else fan_in ** -0.5
            full = std * torch.randn(shape, generator=g, device=device)
        load(full, name)


def to_fp8(model: torch.nn.Module) -> tuple[int, int]:
    """Convert the layers that can hold block fp8 (the linear layers and routed experts) ->
    (converted, kept in 16 bits: a shard cutting a 128-block, helix.layers.fp8.keeps_blocks)."""
    done = kept = 0
    for mod in list(model.modules()):
        if hasattr(mod, "to_fp8"):
            if mod.to_fp8():
                done += 1
            else:
                kept += 1
    return done, kept


def build_and_load(model_ref: str, comm, dtype: torch.dtype, device, max_position: int, seed: int,
                   cfg: ModelConfig | None = None, ckpt: str | None = None,
                   quantization: str = "auto"):
    """The model with its weights; quantization: RuntimeConfig.quantization (auto: the
    checkpoint's own format, fp8, none)."""
    if cfg is None:
        cfg, ckpt = read_model_config(model_ref)
    with torch.device(device):
        model = build_model(cfg, comm, dtype, max_position)
    show = comm.mesh.rank == 0
    if fp8.resolve(quantization, cfg.quantization) == "fp8":
        fp8.check_device(torch.device(device))
        done, kept = to_fp8(model)
        if show:
            log.info("fp8 weights (128x128 block scales): %d layers%s", done,
                     f", {kept} kept in {str(dtype).replace('torch.', '')} (a slice they hold "
                     f"cuts a 128x128 block: helix/layers/fp8.py keeps_blocks)" if kept else "")
    if ckpt is not None:
        load_checkpoint(model, ckpt, show)
    else:
        init_random(model, seed, device, show)
    return model.eval()
