"""The Triton attention backend: paged split-KV decode (GQA and absorbed MLA), flash prefill (GQA
and absorbed MLA, causal by global position), KV append, and the Helix exchange's pack / merge,
each one kernel launch with no host sync (CUDA-graph capturable).

GQA prefill may instead run one of torch's attention kernels over K/V gathered from the pages
(helix.attention.torch_prefill: FA2 or cuDNN; kvp == 1, 16-bit, eager steps only), chosen per
device by measurement: `prefill` = "auto" (default; env HELIX_PREFILL) runs the kernel of
TORCH_PREFILL[device name] for steps whose longest prefill sequence holds at least its keys
(meta.max_kv) and the Triton kernel otherwise; "flash" / "cudnn" run that kernel wherever it
applies; "triton" never does.

Absorbed MLA decode runs the Gluon kernel (helix.attention.gluon_mla, variant GLUON_VARIANT, or
GLUON_FEW_VARIANT for a launch of few heads) on
sm_90 where it compiled and passed its self-check in `prepare` and the shape suits it (16-bit KV,
512 + 64 dims, not a few-heads launch of a small batch: triton_mla_few.routes and
GLUON_FEW_HEADS_FROM_BATCH), else triton_mla (env
HELIX_MLA_GLUON=0 keeps triton_mla): profiling/results/mla_gluon.md measured it 1.18-1.77 x
faster than triton_mla at every bench_attention shape (DeepSeek-V3 rank, batch 1-64 x 4K-512K).

On CPU the kernels run only through Triton's interpreter (TRITON_INTERPRET=1, set before triton
is imported); tests use that path."""

from __future__ import annotations

import os

import torch

from helix.attention import (torch_prefill, triton_append, triton_decode, triton_merge,
                             triton_mla, triton_mla_few, triton_prefill)
from helix.attention.backend import AttentionBackend
from helix.errors import ConfigError
from helix.kv.manager import LocalKVMeta

PREFILL_IMPLS = ("auto", "triton") + torch_prefill.KERNELS
GLUON_VARIANT = "seesaw"     # the faster variant at every shape of profiling/results/mla_gluon.md
# Launches of at most gluon_mla.FEW_MAX_HEADS heads run the "few" variant (swapped products: no
# padding of the heads to the wgmma's 64 rows) where it compiled and passed its self-check;
# None keeps them on GLUON_VARIANT (benches switch it)
GLUON_FEW_VARIANT: str | None = "few"
# A few-heads MLA launch (triton_mla_few.routes) of at least this batch runs the Gluon kernel where
# it runs (sm_90). H200, 16 heads, as the step runs them (a chain of layers under PDL,
# profiling/results/mla_small.md): Gluon at 128 splits with its KV streaming under the previous
# kernel against the few-heads kernel: see that note (batch 1 had been the few-heads kernel's,
# when Gluon took at most 64 splits and launched without PDL).
GLUON_FEW_HEADS_FROM_BATCH = 1
# By device name: (torch kernel, keys of the longest prefill sequence (meta.max_kv) from which it
# beats the Triton prefill kernel), as profiling/bench_prefill.py part (a) measures and prints it.
# A device not listed runs the Triton kernel under "auto". H200 (profiling/results/prefill.md):
# cuDNN reading the GQA groups natively, with host-known lengths (no sync) and no copies, wins
# from 16K keys (run e; the first try, with K/V repeated per query head, a sync and an output
# copy, won only from 64K). But cuDNN builds a graph for every new (queries, keys) shape, 40 ms
# or more of host time (run e), and a server's shapes are all new: from 32K keys, where one
# chunk's attention over 32 layers saves several times that.
TORCH_PREFILL: dict[str, tuple[str, int]] = {"NVIDIA H200": ("cudnn", 32768)}


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ConfigError("attention backend 'triton' needs --device cuda (or TRITON_INTERPRET=1 "
                          "to run its kernels on CPU through the interpreter)")


def device_name(device: torch.device) -> str | None:
    """TORCH_PREFILL's key for a device (None off CUDA)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


class TritonAttention(AttentionBackend):
    name = "triton"
    graph_safe = True          # decode needs no host sync: capturable (helix.runtime.decode_graphs)

    def __init__(self, prefill: str | None = None):
        self.prefill = prefill or os.environ.get("HELIX_PREFILL", "auto")
        if self.prefill not in PREFILL_IMPLS:
            raise ConfigError(f"HELIX_PREFILL must be one of {', '.join(PREFILL_IMPLS)}, got "
                              f"{self.prefill!r}")
        self.gluon_mla = False     # decided by prepare(), before any graph is captured
        self.gluon_few = False     # ... and whether the few-heads variant runs

    def prepare(self, device: torch.device, mla: bool) -> None:
        """Compile and self-check the Gluon MLA kernel once (it synchronises: never under
        capture)."""
        if mla and device.type == "cuda" and os.environ.get("HELIX_MLA_GLUON", "1") != "0":
            from helix.attention import gluon_mla
            self.gluon_mla = gluon_mla.gluon_available(device, GLUON_VARIANT)
            self.gluon_few = bool(GLUON_FEW_VARIANT and self.gluon_mla
                                  and gluon_mla.gluon_available(device, GLUON_FEW_VARIANT))

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
        """q [T, Hq, d] -> o [T, Hq, dv], lse [T, Hq]; several queries per sequence, causal."""
        _check_device(q)
        kernel = self.torch_prefill(q, k_cache, v_cache, meta)
        if kernel is not None:
            try:
                return torch_prefill.prefill_gqa(kernel, q, k_cache, v_cache, meta, scale)
            except torch_prefill.NoLSE:
                pass
        return triton_prefill.gqa_prefill(q, k_cache, v_cache, meta, scale)

    def torch_prefill(self, q, k_cache, v_cache, meta: LocalKVMeta) -> str | None:
        """The torch kernel this GQA prefill call runs, None for the Triton kernel (see the
        module doc)."""
        kernel, start = self.prefill, 0
        if kernel == "auto":
            kernel, start = TORCH_PREFILL.get(device_name(q.device), ("triton", 0))
        if (kernel == "triton" or meta.max_kv < start
                or not torch_prefill.usable(kernel, q, k_cache, v_cache, meta)):
            return None
        return kernel

    def decode_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta: LocalKVMeta, scale):
        """q_latent [B, H, Dl], q_rope [B, H, Dr] -> o [B, H, Dl], lse [B, H]."""
        _check_device(q_latent)
        assert kv_cache.shape[-1] == kv_lora_rank + q_rope.shape[-1]
        if self.gluon_mla and self._gluon_fits(q_latent, q_rope, kv_cache):
            from helix.attention import gluon_mla
            return gluon_mla.mla_decode_gluon(q_latent, q_rope, kv_cache, meta.block_tables,
                                              meta.kv_lens, scale,
                                              variant=self.gluon_variant(q_latent.shape[1]))
        return triton_mla.mla_decode(q_latent, q_rope, kv_cache, meta.block_tables, meta.kv_lens,
                                     scale)

    def gluon_variant(self, heads: int) -> str:
        """The Gluon variant a launch of `heads` query heads runs."""
        from helix.attention import gluon_mla
        if self.gluon_few and GLUON_FEW_VARIANT and heads <= gluon_mla.FEW_MAX_HEADS:
            return GLUON_FEW_VARIANT
        return GLUON_VARIANT

    @staticmethod
    def _gluon_fits(q_latent, q_rope, kv_cache) -> bool:
        from helix.attention import gluon_mla
        B, H, Dl = q_latent.shape
        Dr = q_rope.shape[2]
        P, page, _ = kv_cache.shape
        return ((not triton_mla_few.routes(H) or B >= GLUON_FEW_HEADS_FROM_BATCH)
                and gluon_mla.unsupported_reason(H, Dl, Dr, page, kv_cache.dtype, P * page) is None
                and gluon_mla.tma_ready(kv_cache) is None)

    def prefill_mla(self, q_latent, q_rope, kv_cache, kv_lora_rank, meta: LocalKVMeta, scale):
        """Absorbed MLA prefill: o [T, H, Dl] in latent space, lse [T, H]."""
        _check_device(q_latent)
        return triton_prefill.mla_prefill(q_latent, q_rope, kv_cache, kv_lora_rank, meta, scale)

    def pack_partials(self, o, lse, n):
        _check_device(o)
        return triton_merge.pack_partials(o, lse, n)

    def merge_received(self, recv, d):
        _check_device(recv)
        return triton_merge.merge_received(recv, d)
