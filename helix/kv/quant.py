"""The KV cache's storage dtype (RuntimeConfig.kv_cache_dtype), written once.

"auto" stores K/V in the model's dtype. "fp8" stores them as float8 e4m3 (torch.float8_e4m3fn,
Triton's fp8e4nv): half the bytes of bf16, so a rank holds twice the positions and a decode step
at long context reads half the KV. No scale (as a checkpoint without calibrated KV scales runs
in vLLM): a value is rounded to the nearest e4m3 value, ties to even, and saturates at
+-FP8_MAX; e4m3 keeps 3 mantissa bits (a relative error up to 2^-4) and values down to 2^-9.
Kernels read a cached value and convert it to the query's dtype before any product, so only
the storage changes (triton_util.cache_cast is the same rounding inside the kernels that
write the cache; this module's `to_cache` is it in torch)."""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a KV pool of kv_cache_dtype `name` is allocated in."""
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (uint8, same shape), others as they are: for moving it where
    torch has no fp8 kernel or type (CPU index_copy_, gloo)."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype (fp8: saturated at +-FP8_MAX, rounded to nearest even)."""
    if is_fp8(dtype):
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)
