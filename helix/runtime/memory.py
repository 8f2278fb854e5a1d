"""Sizing the KV pool to the machine: the memory left after the weights, a share of it (like
vLLM's gpu_memory_utilization; on CPU a share of the RAM available, split between the ranks of
this machine), less a reserve for one step's activations, capped by what max_batch requests of
max_context positions need. Every rank takes the smallest pool any rank can hold, so the
replicated scheduler counts one pool."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from helix.config import Layout, ModelConfig, RuntimeConfig
from helix.errors import ConfigError
from helix.kv.ownership import KVSharding

log = logging.getLogger("helix")


@dataclass(frozen=True)
class KVPool:
    num_pages: int              # pages per rank
    page_bytes: int             # bytes of one page, all layers
    budget_bytes: int           # memory the pool could have taken (before the cap)
    needed_pages: int           # what max_batch x max_context needs (the cap)

    @property
    def gib(self) -> float:
        return self.num_pages * self.page_bytes / 2**30

    def describe(self, page_size: int, max_context: int, kvp: int, dtype: str = "") -> str:
        tokens = self.num_pages * page_size
        return (f"KV pool: {self.num_pages} pages of {page_size} positions per rank "
                f"({self.gib:.2f} GiB{', ' + dtype if dtype else ''}), {tokens} positions per "
                f"rank; ~{tokens * kvp} tokens "
                f"over the {kvp} KVP rank(s), "
                f"{self.num_pages / max(1, self.needed_pages) * 100:.0f}"
                f" % of max_batch x max_context ({max_context})")


def page_bytes(model, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV page across every layer's caches (shapes from the model)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape[1:]) * elem
               for shapes in model.kv_cache_shapes(1, page_size) for shape in shapes)


def activation_reserve(cfg: ModelConfig, layout: Layout, runtime: RuntimeConfig) -> int:
    """A generous bound on one step's transient memory: the largest step's tokens
    of hidden states, this rank's q/k/v/o and FFN activations, a layer's attention workspace,
    the logits of the sampled rows, and with fp8 weights the largest projection dequantized for
    a prefill chunk's GEMM (helix.layers.fp8.linear)."""
    elem = runtime.torch_dtype.itemsize
    tokens = runtime.step_tokens
    n = layout.world_size
    heads = cfg.num_heads // layout.tpa
    qkv = heads * max(cfg.head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    ffn = 3 * max(cfg.intermediate_size,
                  cfg.moe_intermediate_size * max(1, cfg.experts_per_token)) // n
    per_token = (8 * cfg.hidden_size + qkv + ffn) * max(elem, 4)
    logits = 3 * runtime.max_batch * cfg.vocab_size * 4
    reference_scores = 1 << 28 if runtime.resolved_backend == "torch" else 0
    return (tokens * per_token + logits + reference_scores + (1 << 28)
            + _dequantized_projection(cfg, layout, runtime))


def _dequantized_projection(cfg: ModelConfig, layout: Layout, runtime: RuntimeConfig) -> int:
    """Bytes of the largest linear layer's weight shard in the runtime dtype where the weights
    are fp8 (prefill chunks multiply a dequantized copy), else 0."""
    from helix.layers import fp8
    if fp8.resolve(runtime.quantization, cfg.quantization) != "fp8":
        return 0
    n, D = layout.world_size, cfg.hidden_size
    hq = cfg.num_heads // layout.tpa
    if cfg.is_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = (cfg.q_lora_rank or D) * hq * qk
        attn = max(q, D * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                   cfg.num_heads // n * cfg.v_head_dim * D)
    else:
        attn = D * (hq + 2 * cfg.num_kv_heads) * cfg.head_dim
    ffn = 2 * D * max(cfg.intermediate_size, cfg.moe_intermediate_size
                      * cfg.num_shared_experts) // n
    return max(attn, ffn) * runtime.torch_dtype.itemsize


def available_bytes(device: torch.device, utilization: float, ranks_here: int) -> int:
    """Memory this rank may still fill: device memory (CUDA) or the machine's available RAM
    shared by its ranks (CPU), times the utilization. On CUDA the blocks this process's caching
    allocator holds but no tensor uses count as free: the driver reports them in use, yet new
    tensors take them (an engine built after another was closed in the same process, as in
    `helix sweep` or a benchmark comparing configurations, would otherwise find its
    predecessor's memory gone)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(total * utilization) - (total - free - cached)
    avail = _mem_available()
    return int(avail * utilization / max(1, ranks_here))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plan_kv_pool(model, cfg: ModelConfig, layout: Layout, runtime: RuntimeConfig,
                 device: torch.device, ranks_here: int, agree=None) -> KVPool:
    """The pool this rank holds. agree(n) -> the minimum of n over ranks (None: one rank)."""
    per_page = page_bytes(model, runtime.page_size, runtime.torch_kv_dtype)
    max_context = runtime.resolved_max_context(cfg)
    sharding = KVSharding(layout.kvp, layout.kv_interleave, runtime.page_size)
    needed = runtime.max_batch * sharding.max_pages(max_context)
    budget = (available_bytes(device, runtime.resolved_memory_utilization, ranks_here)
              - activation_reserve(cfg, layout, runtime))
    fits = max(0, budget // per_page)
    if runtime.num_pages:
        if runtime.num_pages > fits:
            raise ConfigError(f"--num-pages {runtime.num_pages} needs "
                              f"{runtime.num_pages * per_page / 2**30:.2f} GiB per rank, "
                              f"{max(0, budget) / 2**30:.2f} GiB is free for the KV pool: "
                              f"lower --num-pages or leave it 0 (sized to the machine)")
        pages = runtime.num_pages
    else:
        pages = min(needed, fits)
    pages = agree(pages) if agree is not None else pages
    one = sharding.max_pages(1)
    if pages < one:
        raise ConfigError(f"no memory left for the KV cache ({max(0, budget) / 2**30:.2f} GiB "
                          f"after the weights and activations, {per_page} bytes a page): use "
                          f"more ranks, a smaller --max-batch, or raise --memory-utilization")
    return KVPool(pages, per_page, budget, needed)
