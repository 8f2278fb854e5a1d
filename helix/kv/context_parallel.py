"""Context-parallel prefill: who projects which prompt tokens, and where each rank's queries find
the KV of the whole causal prefix. Pure bookkeeping on the host; the collectives live in
helix/layers/cp_attention.py.

Two ways to run a step's prefill chunks over KVP ranks (decode rows always take the Helix
decode path):

- pass-Q (the decode path, what every step did before): every KVP rank projects Q/K/V for all
  of the chunk's tokens (its TP_A head slice), appends the positions it owns, attends all the
  chunk's queries over its local shard and exchanges partial (O, LSE) for every token.
- pass-KV: KVP rank k projects Q/K/V only for the positions it owns, (p // I) % kvp == k (the
  interleave strategy with block I), and appends them: prefill leaves on each rank exactly the
  KV that decode reads. Its queries then attend over the whole causal prefix: the KV pages of
  every KVP rank for the chunk's sequences, gathered (or passed around a ring when a gathered
  copy would not fit), each source a partial (O, LSE) merged exactly. A token all-to-all
  then hands every rank its H/N heads of every token for the output projection.

The rule (Meta's context-parallel inference paper, section 3.5 of the survey): pass-KV moves
(P + T) tokens of KV, pass-Q moves T tokens of partial outputs (T new tokens, P cached before
them), so pass-KV is the cheaper message when T / (T + P) >= kv_row / q_row, the ratio of one
token's KV bytes to one token's partial (O + LSE) bytes on a rank: 2 Hkv d / (H (d + 1)) for GQA
(about 2 Hkv / H: 0.5 for Llama-3 8B), (Dl + Dr) / (H (Dl + 1)) for MLA (about 1 / H). So a
first chunk (P = 0) always passes KV; a short chunk after a long cached prefix (a later chunk,
a continued conversation) passes Q. pass-Q also repeats the Q/K/V projection on every KVP rank,
which the message rule leaves out; it only favours pass-KV further.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helix.kv.manager import KVManager, LocalKVMeta, upload
from helix.kv.ownership import KVSharding, kv_owner


def pass_kv_cheaper(new_tokens: int, cached_tokens: int, kv_row: int, q_row: int) -> bool:
    """Meta's rule: pass-KV when T / (T + P) >= kv_row / q_row."""
    total = new_tokens + cached_tokens
    return total > 0 and new_tokens * q_row >= total * kv_row


def own_counts(sharding: KVSharding, chunks: list[tuple[int, int, int]]) -> list[int]:
    """Positions of the chunks (seq, start, n) that each KVP rank owns: the chunk rows it
    projects under pass-KV."""
    return [sum(sharding.local_len(s + n, k) - sharding.local_len(s, k) for _, s, n in chunks)
            for k in range(sharding.kvp)]


@dataclass
class CPPlan:
    """One step's context-parallel prefill on one rank (pass-KV)."""

    rows: torch.Tensor           # [R] int64: rows of the step's tokens this rank projects:
                                 # every decode row, then its own chunk rows (a captured step
                                 # reads them from a static buffer, padded past R)
    host_rows: torch.Tensor      # [R] int64 on the host: the same rows
    num_decode: int              # the first D rows of the step (and of `rows`) are decode rows
    own_counts: list[int]        # own chunk rows of each KVP rank (the token all-to-all)
    dest: torch.Tensor           # [kvp * M] int64: step row of received row (i, m); M = max
                                 # own count; padding rows point at row D + Tc, past the step's
    num_chunk_rows: int          # Tc: chunk rows of the step
    gather_pages: torch.Tensor   # [slots] int64: this rank's page in each slot of the shared
                                 # layout (0 where it holds none)
    sources: list[LocalKVMeta]   # per KVP source rank j: this rank's own queries against j's
                                 # shard, laid out in the slots (block tables index slots)
    ring: bool                   # pass the KV around a ring instead of gathering it


def plan_pass_kv(kv: KVManager, batch: list[tuple[int, int, int]], num_decode: int,
                 page_bytes: int, gather_limit: int, device) -> CPPlan:
    """The pass-KV plan of a step whose batch is (seq, start, n) rows, decode rows first. Call
    after kv.prepare (the chunks' pages exist). page_bytes: one page of one layer's KV; a
    gathered copy of more than gather_limit bytes passes around the ring instead."""
    kvp, me = kv.kvp, kv.kvp_rank
    chunks = batch[num_decode:]
    rows = list(range(num_decode))
    owners, cu_own, q_pos = [], [0], []
    t = num_decode
    for _, start, n in chunks:
        pos = torch.arange(start, start + n)
        own = kv_owner(pos, kvp, kv.interleave)
        owners.append(own)
        mine = torch.nonzero(own == me).flatten()
        rows += (t + mine).tolist()
        q_pos.append(pos[mine])
        cu_own.append(cu_own[-1] + mine.numel())
        t += n
    owner = torch.cat(owners) if owners else torch.zeros(0, dtype=torch.long)
    counts = own_counts(kv.sharding, chunks)
    width = max(counts + [1])
    dest = torch.full((kvp, width), len(owner), dtype=torch.long)
    for i in range(kvp):
        idx = torch.nonzero(owner == i).flatten()
        dest[i, :idx.numel()] = idx
    dest += num_decode
    # the slots layout: each chunk's sequence gets as many page slots as KVP rank 0 holds (the
    # most); rank r fills the first pages(end, r) of them with its pages
    slots, tables, offset = [], [], 0
    for seq, start, n in chunks:
        width_s = kv.sharding.max_pages(start + n)
        pages = kv.pages[seq][:kv.sharding.pages(start + n, me)]
        slots += pages + [0] * (width_s - len(pages))
        tables.append(list(range(offset, offset + width_s)))
        offset += width_s
    table_w = max([len(r) for r in tables] + [1])
    table = torch.zeros((len(chunks), table_w), dtype=torch.int32)
    for i, r in enumerate(tables):
        table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    table = upload(table, device)
    cu = upload(torch.tensor(cu_own, dtype=torch.int32), device)
    pos = upload(torch.cat(q_pos) if q_pos else torch.zeros(0, dtype=torch.long), device)
    max_q = max([b - a for a, b in zip(cu_own, cu_own[1:])] + [1])
    sources = []
    for j in range(kvp):
        lens = torch.tensor([kv.sharding.local_len(s + n, j) for _, s, n in chunks],
                            dtype=torch.int32)
        sources.append(LocalKVMeta(slots=pos.new_full((pos.numel(),), -1), block_tables=table,
                                   kv_lens=upload(lens, device), cu_q=cu, q_pos=pos, kvp_rank=j,
                                   kvp=kvp, interleave=kv.interleave, page_size=kv.page_size,
                                   num_decode=0, max_q=max_q))
    host_rows = torch.tensor(rows, dtype=torch.long)
    return CPPlan(rows=upload(host_rows, device), host_rows=host_rows, num_decode=num_decode,
                  own_counts=counts, dest=upload(dest.flatten(), device), num_chunk_rows=len(owner),
                  gather_pages=upload(torch.tensor(slots, dtype=torch.long), device),
                  sources=sources, ring=kvp * len(slots) * page_bytes > gather_limit)
