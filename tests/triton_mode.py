"""Imported first by the kernel test modules. On a machine without CUDA (or with
TRITON_INTERPRET=1) Triton runs in its interpreter; that must be chosen before triton is imported
anywhere, since triton.jit reads it at decoration (its own library too): .ci/run exports it for
the whole suite, and this module sets it for a module run alone. On a GPU with TRITON_INTERPRET
unset, the same tests run the compiled kernels."""

import os

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton.language.standard  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not ON_GPU and not isinstance(triton.language.standard.cdiv, InterpretedFunction):
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (triton.jit reads it at "
                "decoration, its own library too): export TRITON_INTERPRET=1 as .ci/run does",
                pytrace=False)

DEV = "cuda" if ON_GPU else "cpu"
