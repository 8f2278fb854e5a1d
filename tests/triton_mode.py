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


def gpu_rounding():
    """A context manager: in the interpreter, fp32 -> bf16 casts round to nearest even, as on
    the GPU (the interpreter truncates); on the GPU, nothing."""
    import contextlib
    if ON_GPU:
        return contextlib.nullcontext()
    from unittest import mock

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it
    real = it.InterpreterBuilder.create_fp_trunc

    def rtne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return it.TensorHandle(bits.reshape(np.shape(src.data)), dst_type.scalar)
        return real(self, src, dst_type)
    return mock.patch.object(it.InterpreterBuilder, "create_fp_trunc", rtne)
