"""Weight loaders: each parameter carries `weight_loader(param, full_tensor, name)`, which checks
the checkpoint tensor's full shape and copies this rank's slice into the parameter."""

from __future__ import annotations

import torch

from helix.errors import CheckpointError


def _check(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}: "
                              f"the checkpoint does not match its config.json")


def load_full(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    _check(name, full.shape, param.shape)
    param.data.copy_(full)


def sliced_loader(full_shape: tuple[int, ...], dim: int, start: int, stop: int, dst: int = 0):
    """Loader for a parameter holding [start, stop) of dimension `dim` of a tensor of full_shape,
    at offset `dst` of that dimension (several checkpoint tensors fused into one parameter);
    rows past the end of the full tensor (vocab padding) stay zero."""
    def load(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
        _check(name, full.shape, full_shape)
        stop_ = min(stop, full.shape[dim])
        block = param.data.narrow(dim, dst, stop - start)
        block.zero_()
        block.narrow(dim, 0, stop_ - start).copy_(full.narrow(dim, start, stop_ - start))
    load.full_shape = tuple(full_shape)
    load.dim, load.start, load.stop, load.dst = dim, start, stop, dst
    return load
