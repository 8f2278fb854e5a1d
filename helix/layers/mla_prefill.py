"""MLA prefill in the cheaper of its two exact forms, chosen per step by FLOPs.

- absorbed (what decode runs, helix.layers.attention_mla): q_nope goes through W_UK into the
  latent space, attention reads the latent cache row [c | k_rope] as key and c as value, the
  exchange merges latent partials, and W_UV maps the merged heads to value dims.
- decompressed (DeepSeek's prefill form): each local key's latent c is expanded per head,
  k = [W_UK c ; k_rope] (dn + Dr = 192 dims), v = W_UV c (dv = 128), and the chunk's queries
  [q_nope ; q_rope] attend over them as multi-head attention (the backend's GQA prefill, one
  query head per KV head, causal by global position as ever). O is then in value space: the
  exchange merges dv-wide partials and no W_UV follows the merge.

FLOPs on one rank for a step's chunks: H local heads, T new tokens, N local keys (whole pages:
what gets expanded), `pairs` query-key pairs the causal mask keeps (one sequence with P cached
keys at kvp 1: pairs = T P + T (T + 1) / 2, N = P + T):
    absorbed     = 2 H (Dl + Dr + Dl) pairs + 2 H Dl (dn + dv) T   (attention; W_UK on q, W_UV on O)
    decompressed = 2 H (dn + Dr + dv) pairs + 2 H Dl (dn + dv) N   (attention; W_UK, W_UV on keys)
(W_UV on O actually runs on the H / N heads a rank holds after the merge; counting all H leans
the rule towards absorbed.) With DeepSeek's dims (Dl 512, Dr 64, dn = dv = 128) a pair costs
2176 FLOPs a head absorbed and 640 decompressed, while expanding costs 262144 a key and head
where absorbing costs as much a query: decompressed is cheaper iff 1536 pairs > 262144 (N - T),
which holds for any prefix once a sequence's chunk has T >= 171 tokens (pairs >= T (N - T)),
and for shorter chunks over short prefixes. An 8K-token chunk of a 128K-token prompt:
3.4x fewer FLOPs. Decode rows (one query each) always stay absorbed.

The rule needs the chunks' query and key counts on the host: one sync per layer, taken only for
steps of at least MIN_TOKENS prefill tokens (below that the attention is small in either form)
and never under CUDA graph capture (the absorbed form runs there). The expanded K/V are
transient, built in head blocks of at most DECOMPRESS_BYTES. FORM ("auto" | "absorbed" |
"decompressed", env HELIX_MLA_PREFILL) forces a form (tests, benchmarks).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from helix.errors import ConfigError
from helix.kv.manager import LocalKVMeta, upload

FORMS = ("auto", "absorbed", "decompressed")
FORM = os.environ.get("HELIX_MLA_PREFILL", "auto")
MIN_TOKENS = 64
DECOMPRESS_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class MLADims:
    latent: int        # Dl (kv_lora_rank)
    rope: int          # Dr
    nope: int          # dn
    value: int         # dv


def prefill_flops(form: str, pairs: int, keys: int, queries: int, heads: int,
                  dims: MLADims) -> int:
    """The FLOP count of the module doc for one form."""
    expand = 2 * heads * dims.latent * (dims.nope + dims.value)
    if form == "absorbed":
        return 2 * heads * (2 * dims.latent + dims.rope) * pairs + expand * queries
    return 2 * heads * (dims.nope + dims.rope + dims.value) * pairs + expand * keys


def causal_pairs(q_lens: list[int], kv_lens: list[int], kvp: int) -> int:
    """Query-key pairs of chunks whose queries are the last positions of their sequences:
    exact at kvp 1 (T N - T (T - 1) / 2); with kvp > 1 the rank holds about 1 / kvp of the
    chunk's positions."""
    return sum(max(0, t * n - t * (t - 1) // (2 * kvp)) for t, n in zip(q_lens, kv_lens))


def decompress_plan(pre: LocalKVMeta, heads: int, dims: MLADims) -> list[int] | None:
    """pre: a step's prefill rows (pass-Q). -> the local key counts of its sequences when the
    decompressed form runs, None for the absorbed form."""
    T = pre.q_pos.shape[0]
    if FORM not in FORMS:
        raise ConfigError(f"HELIX_MLA_PREFILL must be one of {', '.join(FORMS)}, got {FORM!r}")
    if FORM == "absorbed" or (pre.kv_lens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    if FORM == "auto" and T < MIN_TOKENS:
        return None
    if pre.host_lens is not None:                  # the engine's steps: no sync
        kv_lens, q_lens = pre.host_lens
    else:
        q_lens, kv_lens = torch.stack((pre.cu_q[1:] - pre.cu_q[:-1], pre.kv_lens)).tolist()
    if FORM == "decompressed":
        return kv_lens
    page = pre.page_size
    keys = sum(-(-n // page) * page for n in kv_lens)
    pairs = causal_pairs(q_lens, kv_lens, pre.kvp)
    cheaper = (prefill_flops("decompressed", pairs, keys, T, heads, dims)
               < prefill_flops("absorbed", pairs, keys, T, heads, dims))
    return kv_lens if cheaper else None


def decompressed_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                           w_kv: torch.Tensor, pre: LocalKVMeta, kv_lens: list[int], backend,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope [T, H, dn], q_rope [T, H, Dr] (rotated) of the prefill rows; kv_cache
    [P, page, Dl + Dr]; w_kv [H, dn + dv, Dl] (kv_b_proj rows of the local heads: W_UK, then
    W_UV); kv_lens: the local key counts from decompress_plan -> o [T, H, dv] in value space,
    lse [T, H] fp32.

    The sequences' pages are copied out whole ([Np, page, Dl + Dr], a new block table indexing
    them), expanded per head block, and attended through backend.prefill_gqa (rows past a
    sequence's length, stale or not, are never read)."""
    page, width = pre.page_size, pre.block_tables.shape[1]
    dl = kv_cache.shape[-1] - q_rope.shape[-1]
    H, per, _ = w_kv.shape
    dn = q_nope.shape[-1]
    pages = [-(-n // page) for n in kv_lens]
    flat = torch.cat([torch.arange(n) + s * width for s, n in enumerate(pages)])
    rows = kv_cache[pre.block_tables.reshape(-1)[upload(flat, kv_cache.device)].long()]
    rows = rows.to(q_nope.dtype)                       # an fp8 cache's pages, dequantized
    table = torch.zeros((len(pages), max(pages + [1])), dtype=torch.int32)
    first = 0
    for s, n in enumerate(pages):
        table[s, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    meta = dataclasses.replace(pre, block_tables=upload(table, kv_cache.device))
    q = torch.cat((q_nope, q_rope), dim=-1)                           # [T, H, dn + Dr]
    latent = rows[..., :dl].reshape(-1, dl)                            # [Np * page, Dl]
    k_rope = rows[..., dl:].unsqueeze(2)                               # [Np, page, 1, Dr]
    # one head's expanded keys: the GEMM's [W_UK c ; W_UV c] and k = [W_UK c ; k_rope]
    head_bytes = rows.shape[0] * page * (per + dn + q_rope.shape[-1]) * rows.element_size()
    block = max(1, min(H, DECOMPRESS_BYTES // max(1, head_bytes)))
    outs, lses = [], []
    for h0 in range(0, H, block):
        h = min(H, h0 + block) - h0
        kv = (latent @ w_kv[h0:h0 + h].reshape(h * per, dl).t()).view(*rows.shape[:2], h, per)
        k = torch.cat((kv[..., :dn], k_rope.expand(-1, -1, h, -1)), dim=-1)  # [Np, page, h, 192]
        o, lse = backend.prefill_gqa(q[:, h0:h0 + h], k, kv[..., dn:], meta, scale)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)
