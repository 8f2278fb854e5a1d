"""The attention backend interface. Every backend returns the partial output over this rank's
local KV *and* its log-sum-exp (fp32, natural log, [T, H]), so Helix can merge partials exactly.

KV pool layouts (one rank, one layer):
  GQA: k_cache, v_cache [num_pages, page_size, Hkv_local, d]
  MLA: kv_cache [num_pages, page_size, kv_lora + rope]  (latent row, then the rope key)
"""

from __future__ import annotations

import torch

from helix.attention.merge import merge_partials, pack_partials, unpack_partials
from helix.errors import ConfigError
from helix.kv.manager import LocalKVMeta


class AttentionBackend:
    name = "abstract"

    def prepare(self, device: torch.device, mla: bool) -> None:
        """Once per engine, before any graph is captured: a backend may compile or self-check
        kernels here (mla: the model's attention is MLA)."""

    def append_kv(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Write rows [T, ...] into cache [P, page, ...] at flat slots [T]; slot -1 is skipped."""
        raise NotImplementedError

    def append_kv_pair(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, slots: torch.Tensor) -> None:
        """K and V of the same positions (kernel backends do it in one launch)."""
        self.append_kv(k_cache, k, slots)
        self.append_kv(v_cache, v, slots)

    def attend_gqa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: LocalKVMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, d] -> (o [T, Hq, dv] in q.dtype, lse [T, Hq] fp32). Query head h reads KV
        head h // (Hq / Hkv). Causal over global positions; empty local KV gives o = 0,
        lse = -inf. Decode rows go to the decode kernel, prefill chunks to the prefill kernel."""
        def run(fn, lo, hi, m):
            return fn(q[lo:hi], k_cache, v_cache, m, scale)
        return _by_kind(meta, q.shape[0], run, self.decode_gqa, self.prefill_gqa)

    def attend_mla(self, q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                   kv_lora_rank: int, meta: LocalKVMeta, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed MLA: q_latent [T, H, Dl], q_rope [T, H, Dr] against the latent cache ->
        (o [T, H, Dl] in latent space, lse [T, H] fp32)."""
        def run(fn, lo, hi, m):
            return fn(q_latent[lo:hi], q_rope[lo:hi], kv_cache, kv_lora_rank, m, scale)
        return _by_kind(meta, q_latent.shape[0], run, self.decode_mla, self.prefill_mla)

    def decode_gqa(self, q, k_cache, v_cache, meta: LocalKVMeta, scale):
        """attend_gqa for decode rows only (one query per sequence, at its end)."""
        raise NotImplementedError

    def prefill_gqa(self, q, k_cache, v_cache, meta: LocalKVMeta, scale):
        """attend_gqa for prefill chunks (several queries per sequence, causal)."""
        raise NotImplementedError

    def decode_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta: LocalKVMeta, scale):
        raise NotImplementedError

    def prefill_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta: LocalKVMeta, scale):
        raise NotImplementedError

    # -- the Helix exchange (defaults in plain torch; kernel backends override) -----------------
    def pack_partials(self, o: torch.Tensor, lse: torch.Tensor, n: int) -> torch.Tensor:
        """o [T, H, d], lse [T, H] fp32 -> send buffer [n, T, H/n, d + c] (chunk j to KVP
        rank j)."""
        return pack_partials(o, lse, n)

    def merge_received(self, recv: torch.Tensor, d: int) -> torch.Tensor:
        """recv [n, T, h, d + c] (partial i from KVP rank i) -> exact merged o [T, h, d]."""
        o, lse = unpack_partials(recv, d)
        return merge_partials(o, lse)[0]


def _by_kind(meta: LocalKVMeta, T: int, run, decode, prefill):
    """A step's decode rows [:D] through `decode`, its prefill rows [D:] through `prefill`;
    run(fn, lo, hi, meta) calls fn on query rows [lo, hi)."""
    if meta.is_decode:
        return run(decode, 0, T, meta)
    if meta.num_decode == 0:
        return run(prefill, 0, T, meta)
    dec, pre = meta.split()
    o1, l1 = run(decode, 0, meta.num_decode, dec)
    o2, l2 = run(prefill, meta.num_decode, T, pre)
    return torch.cat((o1, o2)), torch.cat((l1, l2))


def get_backend(name: str, device: str) -> AttentionBackend:
    if name == "torch":
        from helix.attention.torch_ref import TorchAttention
        return TorchAttention()
    if name == "triton":
        try:
            from helix.attention.triton_backend import TritonAttention
        except ImportError as e:
            raise ConfigError(f"attention backend 'triton' is unavailable ({e}): "
                              f"pip install triton, or use --attention-backend torch") from None
        return TritonAttention()
    if name == "flash-attn":
        try:
            from helix.attention.flash_backend import FlashAttention
        except ImportError as e:
            raise ConfigError(f"attention backend 'flash-attn' is unavailable ({e}): "
                              f"pip install flash-attn, or use --attention-backend torch") from None
        if device != "cuda":
            raise ConfigError("attention backend 'flash-attn' needs --device cuda")
        return FlashAttention()
    raise ConfigError(f"unknown attention backend {name!r}: use torch, triton or flash-attn")
