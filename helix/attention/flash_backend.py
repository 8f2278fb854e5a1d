"""flash-attn backend: GQA decode through flash_attn.flash_attn_with_kvcache on the paged pool.
Everything else (MLA, prefill, KV append, the exchange, fp32 caches) goes to the Triton backend,
or to the torch reference where Triton is missing. Importable only with flash_attn installed."""

from __future__ import annotations

import torch
from flash_attn import flash_attn_with_kvcache

from helix.attention.backend import AttentionBackend
from helix.errors import ConfigError
from helix.kv.manager import LocalKVMeta

FLASH_PAGE_MULTIPLE = 256    # flash-attn's paged KV needs page_block_size % 256 == 0


def _fallback() -> AttentionBackend:
    try:
        from helix.attention.triton_backend import TritonAttention
        return TritonAttention()
    except ImportError:
        from helix.attention.torch_ref import TorchAttention
        return TorchAttention()


class FlashAttention(AttentionBackend):
    name = "flash-attn"

    def __init__(self):
        self.other = _fallback()
        self.graph_safe = getattr(self.other, "graph_safe", False)   # flash decode is capturable

    def prepare(self, device, mla):
        self.other.prepare(device, mla)

    def append_kv(self, cache, rows, slots):
        self.other.append_kv(cache, rows, slots)

    def decode_gqa(self, q, k_cache, v_cache, meta: LocalKVMeta, scale):
        """q [B, Hq, d] -> o [B, Hq, d], lse [B, Hq] fp32 natural log (-inf where kv_len == 0)."""
        if k_cache.dtype not in (torch.float16, torch.bfloat16):
            return self.other.decode_gqa(q, k_cache, v_cache, meta, scale)
        page = k_cache.shape[1]
        if page % FLASH_PAGE_MULTIPLE:
            raise ConfigError(f"attention backend 'flash-attn' needs --page-size a multiple of "
                              f"{FLASH_PAGE_MULTIPLE} (got {page}): use --page-size 256, or "
                              f"--attention-backend triton")
        out, lse = flash_attn_with_kvcache(
            q.unsqueeze(1).to(k_cache.dtype), k_cache, v_cache,        # q [B, 1, Hq, d]
            cache_seqlens=meta.kv_lens.int(), block_table=meta.block_tables.int(),
            softmax_scale=scale, causal=False, return_softmax_lse=True)
        o = out.squeeze(1)                                              # [B, Hq, d]
        lse = lse.squeeze(-1).float()                                   # [B, Hq], natural log
        lse = torch.where(torch.isnan(lse) | (lse == float("inf")),
                          torch.full_like(lse, float("-inf")), lse)
        empty = (meta.kv_lens == 0)[:, None]                            # [B, 1]
        lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
        o = torch.where(empty[..., None], torch.zeros_like(o), o)
        return o.to(q.dtype), lse

    def prefill_gqa(self, q, k_cache, v_cache, meta, scale):
        return self.other.prefill_gqa(q, k_cache, v_cache, meta, scale)

    def decode_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale):
        return self.other.decode_mla(q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale)

    def prefill_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale):
        return self.other.prefill_mla(q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale)

    def pack_partials(self, o, lse, n):
        return self.other.pack_partials(o, lse, n)

    def merge_received(self, recv, d):
        return self.other.merge_received(recv, d)
