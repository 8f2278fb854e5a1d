"""Weights in float8 e4m3 with one fp32 scale per 128 x 128 block: DeepSeek-V3's checkpoint
format (`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`, a tensor
`<name>.weight` in e4m3 beside `<name>.weight_scale_inv`), also Qwen3's FP8 checkpoints.

    w[n, k] = w8[n, k] * scale[n // 128, k // 128]

A decode step at small batch streams its weights; at one byte an element a projection reads
half of bf16's bytes, and the model takes half of the memory, leaving the rest to the KV pool.

Which weights (RuntimeConfig.quantization, resolved by `resolve`): the checkpoint's own format
("auto": an fp8 checkpoint stays fp8), "fp8" (16-bit weights quantized here at load, by the
same 128 x 128 grid: amax / 448 a block) or "none" (fp8 checkpoints dequantized at load). The
linear layers (helix.layers.linear) and the routed experts (helix.layers.moe.LocalExperts) hold
fp8; embeddings, the LM head, norms, the router and MLA's kv_b_proj (absorbed into W_UK / W_UV,
helix.layers.attention_mla) stay in the runtime dtype (a checkpoint's fp8 tensor dequantized
on load). A layer's shard keeps the checkpoint's blocks only where its slice starts on a block
edge and ends on one (or at the tensor's end), and the parts of a merged projection too
(`aligned`): a layer whose shard cuts a block stays 16-bit (dequantized), and the log says how
many did.

Products (`linear`), on CUDA (sm_89+): one or two rows, skinny_gemm's one-tile GEMV with the
tile dequantized in registers; up to DEQUANT_ROWS rows, `_fp8_linear_kernel`: grid (row blocks,
feature blocks), each K step loads an fp8 [BLOCK_K, BLOCK_N] weight tile, converts it to the
activation's dtype and adds its tl.dot times the tile's per-feature block scale to an fp32
accumulator, rounded once; more rows (prefill chunks: compute-bound), `_dequant_kernel` writes
the weight in the activation's dtype and cuBLAS multiplies (the dequantization streams ~5 bytes
an element once, against 2 * rows FLOPs an element). Weights only in fp8: activations stay
16-bit, no activation scales. Elsewhere: F.linear over the dequantized weight (the reference).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from helix.errors import CheckpointError, ConfigError
from helix.layers import skinny_gemm
from helix.layers.fused_ops import use_triton
from helix.triton_util import HAS_TRITON, pdl_sync, run_kernel, tl, triton

BLOCK = 128                    # the scale grid's block, both axes
DEQUANT_ROWS = 128             # past this many rows: dequantize, then cuBLAS (module flag; not
                               # yet measured: profiling/bench_fp8_linear.py times all three)
DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                # e4m3's largest finite value


class Blocked(NamedTuple):
    """A [N, K] tensor in block fp8: weight [N, K] e4m3, scale [cdiv(N, 128), cdiv(K, 128)]
    fp32 (what the checkpoint calls weight_scale_inv: it multiplies)."""
    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def element_bytes(quantization: str | None, dtype_bytes: float) -> float:
    """Bytes of a weight element that resolve() put in fp8 (its share of the block's scale
    included), else dtype_bytes: the cost model's and the planner's weight bytes."""
    return 1 + 4 / (BLOCK * BLOCK) if quantization == "fp8" else dtype_bytes


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == DTYPE


def resolve(quantization: str, checkpoint: str | None) -> str | None:
    """RuntimeConfig.quantization and the checkpoint's own format (ModelConfig.quantization)
    -> "fp8" (fp8 weights in memory) or None (the runtime dtype)."""
    if quantization == "auto":
        return checkpoint
    return "fp8" if quantization == "fp8" else None


def check_device(device: torch.device) -> None:
    """fp8 products need an sm_89+ GPU on CUDA (CPUs dequantize per product)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError("fp8 weights need an sm_89+ GPU (Ada, Hopper or newer): pass "
                          "--quantization none to dequantize them at load")


def _grid(scale: torch.Tensor, shape) -> torch.Tensor:
    """[..., cdiv(N, 128), cdiv(K, 128)] block scales -> [..., N, K], one per element."""
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return full[..., :shape[-2], :shape[-1]]


def quantize(w: torch.Tensor) -> Blocked:
    """A [..., N, K] 16/32-bit tensor (a matrix, or a stack of experts' [E, N, K]) -> its block
    fp8 form, scales [..., cdiv(N, 128), cdiv(K, 128)]: a block's scale maps its largest
    magnitude to 448 (1 for an all-zero block); values rounded to nearest even."""
    if w.dim() < 2:
        raise ValueError(f"fp8 quantization takes [..., N, K] weights, got {tuple(w.shape)}")
    *lead, n, k = w.shape
    wf = F.pad(w.float(), (0, blocks(k) * BLOCK - k, 0, blocks(n) * BLOCK - n))
    amax = wf.view(*lead, blocks(n), BLOCK, blocks(k), BLOCK).abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / _grid(scale, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(DTYPE)
    return Blocked(q, scale)


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K] e4m3 and its block scales [..., cdiv(N, 128), cdiv(K, 128)] -> [..., N, K]
    in dtype (products in fp32, rounded once)."""
    want = (*w.shape[:-2], *(blocks(d) for d in w.shape[-2:]))
    if tuple(scale.shape) != want:
        raise ValueError(f"block scales {tuple(scale.shape)} do not fit weights "
                         f"{tuple(w.shape)}: want {want}")
    return (w.float() * _grid(scale.float(), w.shape)).to(dtype)


def dense(t, dtype: torch.dtype):
    """A checkpoint tensor for a parameter of `dtype` that is not fp8: a Blocked one
    dequantized, any other as it is (checkpoint_tensor refused fp8 ones without scales)."""
    if isinstance(t, Blocked):
        return dequantize(t.weight, t.scale, dtype)
    return t


def checkpoint_tensor(weight: torch.Tensor, scale: torch.Tensor | None, name: str):
    """A checkpoint's `name` and its `name`_scale_inv (None: absent) -> Blocked or the tensor;
    an fp8 tensor needs its scales, of the block grid's shape."""
    if scale is None:
        if is_fp8(weight):
            raise CheckpointError(f"tensor {name!r} is float8 without {name}_scale_inv: Helix "
                                  f"reads fp8 checkpoints with 128x128 block scales only")
        return weight
    want = tuple(blocks(d) for d in weight.shape)
    if weight.dim() != 2 or tuple(scale.shape) != want:
        raise CheckpointError(f"{name}_scale_inv has shape {tuple(scale.shape)}, expected {want} "
                              f"(128x128 blocks of {tuple(weight.shape)}): the checkpoint does "
                              f"not match its config.json")
    if not is_fp8(weight):
        raise CheckpointError(f"tensor {name!r} has a scale but dtype {weight.dtype}, not "
                              f"float8_e4m3fn: re-save the checkpoint")
    return Blocked(weight, scale.float())


def expert_scales(gate, up, down, scales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scales = (gate_s, up_s, down_s) of float8 expert stacks [E, n, k], each [E, cdiv(n, 128),
    cdiv(k, 128)] (the MoE kernels' argument) -> the tuple; ValueError naming what is off."""
    if len(scales) != 3:
        raise ValueError("scales: (gate_s, up_s, down_s)")
    for name, w, s in zip(("gate", "up", "down"), (gate, up, down), scales):
        E, n, k = w.shape
        want = (E, blocks(n), blocks(k))
        if not is_fp8(w):
            raise ValueError(f"{name}: block scales go with float8_e4m3fn stacks, not {w.dtype}")
        if tuple(s.shape) != want:
            raise ValueError(f"{name} scales {tuple(s.shape)}: want {want} for {tuple(w.shape)}")
    return tuple(scales)


def aligned(start: int, stop: int, full: int) -> bool:
    """Whether a slice [start, stop) of an axis of `full` elements keeps whole 128-blocks:
    it starts on a block edge and ends on one or at the axis's end."""
    return start % BLOCK == 0 and (stop % BLOCK == 0 or stop >= full)


def keeps_blocks(loader, stored: int) -> bool:
    """Whether a weight_loader's slice (helix.layers.weights.sliced_loader: [start, stop) of
    axis `dim`, at offset dst of a parameter with `stored` elements on that axis) keeps the
    checkpoint's blocks in the parameter: whole blocks from a block edge, landing on one; a
    part ending inside a block only at the end of the tensor and of the parameter."""
    full = loader.full_shape[loader.dim]
    size = loader.stop - loader.start
    return (aligned(loader.start, loader.stop, full) and loader.dst % BLOCK == 0
            and (size % BLOCK == 0 or loader.dst + size >= stored))


def block_loader(weight_loader, scale_param: torch.Tensor):
    """A loader of this rank's slice of an fp8 weight (helix.layers.weights.sliced_loader
    geometry: dim, start, stop, dst, all on block edges) that also copies the matching blocks
    of the scale grid into scale_param; a 16-bit tensor is quantized first (the full tensor's
    grid, as a checkpoint's would be, on the parameter's device)."""
    from helix.layers.weights import sliced_loader
    full_shape, dim = weight_loader.full_shape, weight_loader.dim
    grid = tuple(blocks(d) for d in full_shape)
    scale_loader = sliced_loader(grid, dim, weight_loader.start // BLOCK,
                                 blocks(weight_loader.stop), weight_loader.dst // BLOCK)

    def load(param: torch.Tensor, full, name: str) -> None:
        b = full if isinstance(full, Blocked) else quantize(full.to(param.device))
        weight_loader(param, b.weight, name)
        scale_loader(scale_param, b.scale, f"{name}_scale_inv")
    load.full_shape = full_shape
    return load


def scale_param(rows: int, cols: int, lead: tuple[int, ...] = (),
                device=None) -> torch.nn.Parameter:
    """The block scales of a [.., rows, cols] fp8 weight, loaded with it (block_loader)."""
    p = torch.nn.Parameter(torch.ones((*lead, blocks(rows), blocks(cols)), dtype=torch.float32,
                                      device=device), requires_grad=False)
    p.with_weight = True               # no checkpoint tensor of its own (helix.loader)
    return p


# -- products ----------------------------------------------------------------------------------

def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, dequantize(w, scale), bias) -> [T, N] in x.dtype: on CUDA the one-tile
    GEMV at one or two rows (skinny_gemm.gemv_scaled), the tiled kernel up to DEQUANT_ROWS,
    the dequantized weight in a cuBLAS GEMM past them; the dequantized weight elsewhere."""
    if use_triton(x):
        if x.dim() == 2 and skinny_gemm.gemv_scaled_fits(x, w):
            return skinny_gemm.gemv_scaled(x, w, scale, bias)
        if x.numel() // max(1, x.shape[-1]) > DEQUANT_ROWS:
            return F.linear(x, dequantize_triton(w, scale, x.dtype), bias)
        return linear_triton(x, w, scale, bias)
    return F.linear(x, dequantize(w, scale, x.dtype), bias)


def launch_config(T: int, N: int) -> dict:
    """Tiles from static sizes (graph safe): the weight streamed over >= ~2 programs an SM
    (narrower feature tiles for narrow weights; on the H100 64 rows over 128-wide tiles were
    48-96 programs and 2-6 x slower than bf16, profiling/results/fp8_weights.md)."""
    bt = 16 if T <= 16 else 64
    bn = 64 if T <= 16 else 128
    while bn > 16 and -(-T // bt) * -(-N // bn) < 264:
        bn //= 2
    if T <= 16:
        return dict(BLOCK_T=16, BLOCK_N=bn, BLOCK_K=BLOCK, num_warps=4, num_stages=4)
    return dict(BLOCK_T=64, BLOCK_N=bn, BLOCK_K=BLOCK // 2, num_warps=8 if bn == 128 else 4,
                num_stages=3)


def linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """linear's kernel, whatever the device (tests run it in the interpreter)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and w.stride(1) == 1 and is_fp8(w), (w.shape, w.dtype, K)
    assert tuple(scale.shape) == (blocks(N), blocks(K)) and scale.stride(1) == 1, scale.shape
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T and N:
        cfg = config or launch_config(T, N)
        assert BLOCK % cfg["BLOCK_K"] == 0, cfg
        run_kernel(_fp8_linear_kernel,
                   (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(N, cfg["BLOCK_N"])),
                   x, w, scale, bias if bias is not None else y, y, T, N, K,
                   x.stride(0), w.stride(0), scale.stride(0), y.stride(0),
                   HAS_BIAS=bias is not None,
                   PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cfg)
    return y.view(*shape[:-1], N)


def dequantize_triton(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize's kernel, whatever the device: [N, K] e4m3 -> [N, K] in dtype."""
    N, K = w.shape
    assert w.stride(1) == 1 and is_fp8(w) and tuple(scale.shape) == (blocks(N), blocks(K))
    out = torch.empty((N, K), dtype=dtype, device=w.device)
    if out.numel():
        run_kernel(_dequant_kernel, (blocks(N), blocks(K)), w, scale, out, N, K, w.stride(0),
                   scale.stride(0), scale.stride(1), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


if HAS_TRITON:
    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, o_ptr, N, K, stride_wn, stride_sn, stride_sk, stride_on,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        """Program (i, j): the 128 x 128 block (i, j) times its scale, in o's dtype."""
        i, j = tl.program_id(0), tl.program_id(1)
        n = i * BLOCK + tl.arange(0, BLOCK)
        k = j * BLOCK + tl.arange(0, BLOCK)
        m = (n < N)[:, None] & (k < K)[None, :]
        pdl_sync(PDL)
        s = tl.load(s_ptr + i * stride_sn + j * stride_sk)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=m, other=0.0)
        tl.store(o_ptr + n.to(tl.int64)[:, None] * stride_on + k[None, :],
                 (w.to(tl.float32) * s).to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, T, N, K,
                           stride_xt, stride_wn, stride_sn, stride_yt,
                           HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr = 0):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)          # [BT] rows
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)          # [BN] features
        tmask, nmask = t < T, n < N
        x_rows = x_ptr + t[:, None].to(tl.int64) * stride_xt            # [BT, 1]
        w_cols = w_ptr + n[None, :].to(tl.int64) * stride_wn            # [1, BN]
        s_rows = s_ptr + (n // 128) * stride_sn                         # [BN] block rows
        pdl_sync(PDL)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < K
            xt = tl.load(x_rows + kk[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            s = tl.load(s_rows + k0 // 128, mask=nmask, other=0.0)     # [BN] this K block's
            part = tl.dot(xt, w.to(xt.dtype), input_precision=PRECISION)
            acc += part * s[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + t[:, None].to(tl.int64) * stride_yt + n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])
else:                                   # pragma: no cover - triton absent
    _fp8_linear_kernel = _dequant_kernel = None
