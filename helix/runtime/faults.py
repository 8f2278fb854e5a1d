"""Fault injection for the reliability tests: HELIX_INJECT_FAULT="<rank>:<step>[:<kind>]" makes
that rank's engine raise while launching its <step>-th step (0-based), as a failure inside a step
would (kind "oom": torch.OutOfMemoryError, else RuntimeError). Unset (always, outside tests):
one dictionary lookup per step."""

from __future__ import annotations

import os

import torch


def check(rank: int, step: int) -> None:
    spec = os.environ.get("HELIX_INJECT_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    if int(parts[0]) == rank and int(parts[1]) == step:
        if len(parts) > 2 and parts[2] == "oom":
            raise torch.OutOfMemoryError("injected: CUDA out of memory. "
                                         "Tried to allocate 32.00 GiB")
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
