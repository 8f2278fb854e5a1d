"""Gluon (triton.experimental.gluon) helpers shared by the Hopper kernels written in it: the
absorbed-MLA decode (helix.attention.gluon_mla_kernel, gluon_mla_few_kernel) and the one-row
MoE (helix.layers.gluon_moe_kernel). Written against triton 3.6's Gluon (the GPU machine's);
the names that 3.9 renamed are resolved here once.

- `tma_load`: `tma.async_copy_global_to_shared` in 3.6, `tma.async_load` in 3.9 (where the old
  name raises).
- `sync_threads`: the partition's threads meet (`gl.thread_barrier` in 3.6, `gl.barrier` in 3.9).
- `reinterpret`: a shared-memory view with another dtype / shape / layout
  (`_reinterpret` in 3.6, `reinterpret` in 3.9).
- `globaltimer`: the GPU's global timer (trace stamps).
- `gdc`: one grid-dependency-control instruction; `pdl_wait`: helix.triton_util.pdl_sync's rule
  (wait for the previous kernel, let the next one launch) for a partition that reads the
  previous kernel's output or writes its own.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
sync_threads = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _reinterpret_39(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return smem.reinterpret(dtype, shape, layout)


@gluon.jit
def _reinterpret_36(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return smem._reinterpret(dtype, shape, layout)


# smem viewed with another dtype, shape or layout (the same bytes)
reinterpret = (_reinterpret_39 if hasattr(gl.shared_memory_descriptor, "reinterpret")
               else _reinterpret_36)


@gluon.jit
def gdc(asm: gl.constexpr):
    """One grid-dependency-control instruction (griddepcontrol.wait / .launch_dependents)."""
    gl.inline_asm_elementwise(asm + " // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def globaltimer():
    """The GPU's global nanosecond timer (int64; one clock for every SM): trace stamps."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def pdl_wait(PDL: gl.constexpr):
    """Wait for the previous kernel and let the next kernel launch (before the wait with
    PDL_EARLY, bit 2; after it otherwise). Nothing with PDL = 0."""
    if PDL & 2:
        gdc("griddepcontrol.launch_dependents;")
        gdc("griddepcontrol.wait;")
    elif PDL:
        gdc("griddepcontrol.wait;")
        gdc("griddepcontrol.launch_dependents;")


@gluon.jit
def grid_wait(PDL: gl.constexpr):
    """Only wait for the previous kernel (a partition that reads its output but leaves the
    launch of the next kernel to another partition's pdl_wait)."""
    if PDL:
        gdc("griddepcontrol.wait;")


@gluon.jit
def exp_f32(x):
    """exp(x) in fp32 to a few ulp: helix.layers.fused_ops._exp_f32's rule (Cody-Waite with
    FMA, exp2 on |r log2e| <= 1/2, 2^n as two exact power-of-two factors) in Gluon, so the
    Gluon router rounds its scores as the Triton one."""
    x = gl.minimum(gl.maximum(x, -110.0), 89.0)
    n = gl.floor(x * 1.4426950408889634 + 0.5)
    r = gl.fma(n, -0.693145751953125, x)
    r = gl.fma(n, -1.428606765330187e-06, r)
    e = gl.exp2(r * 1.4426950408889634)
    ni = n.to(gl.int32)
    n1 = ni >> 1
    s1 = ((n1 + 127) << 23).to(gl.float32, bitcast=True)
    s2 = ((ni - n1 + 127) << 23).to(gl.float32, bitcast=True)
    return e * s1 * s2
