"""The Triton attention backend: paged split-KV decode (GQA and absorbed MLA), KV append, and the
Helix exchange's pack / merge, each one kernel launch with no host sync (CUDA-graph capturable).
Prefill (several query tokens per sequence, causal) falls back to the torch reference.

On CPU the kernels run only through Triton's interpreter (TRITON_INTERPRET=1, set before triton
is imported); tests use that path."""

from __future__ import annotations

import os

import torch

from helix.attention import triton_append, triton_decode, triton_merge, triton_mla
from helix.attention.backend import AttentionBackend
from helix.attention.torch_ref import TorchAttention
from helix.errors import ConfigError
from helix.kv.manager import LocalKVMeta


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ConfigError("attention backend 'triton' needs --device cuda (or TRITON_INTERPRET=1 "
                          "to run its kernels on CPU through the interpreter)")


class TritonAttention(AttentionBackend):
    name = "triton"
    graph_safe = True          # decode needs no host sync: capturable (helix.runtime.decode_graphs)

    def __init__(self):
        self.reference = TorchAttention()      # prefill until the flash kernel lands

    def append_kv(self, cache, rows, slots):
        _check_device(cache)
        triton_append.append_kv(cache, rows, slots)

    def append_kv_pair(self, k_cache, v_cache, k, v, slots):
        _check_device(k_cache)
        triton_append.append_kv_pair(k_cache, v_cache, k, v, slots)

    def decode_gqa(self, q, k_cache, v_cache, meta: LocalKVMeta, scale):
        """q [B, Hq, d] -> o [B, Hq, d], lse [B, Hq]; one query per sequence, at its end."""
        _check_device(q)
        return triton_decode.gqa_decode(q, k_cache, v_cache, meta.block_tables, meta.kv_lens,
                                        scale)

    def prefill_gqa(self, q, k_cache, v_cache, meta: LocalKVMeta, scale):
        return self.reference.prefill_gqa(q, k_cache, v_cache, meta, scale)

    def decode_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta: LocalKVMeta, scale):
        """q_latent [B, H, Dl], q_rope [B, H, Dr] -> o [B, H, Dl], lse [B, H]."""
        _check_device(q_latent)
        assert kv_cache.shape[-1] == kv_lora_rank + q_rope.shape[-1]
        return triton_mla.mla_decode(q_latent, q_rope, kv_cache, meta.block_tables, meta.kv_lens,
                                     scale)

    def prefill_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta: LocalKVMeta, scale):
        return self.reference.prefill_mla(q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale)

    def pack_partials(self, o, lse, n):
        _check_device(o)
        return triton_merge.pack_partials(o, lse, n)

    def merge_received(self, recv, d):
        _check_device(recv)
        return triton_merge.merge_received(recv, d)
