"""Per-rank KV bookkeeping: which pages each sequence holds on this rank, and the step's
metadata (slot mapping, block tables, local lengths) as tensors for the attention backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helix.kv.allocator import PageAllocator
from helix.kv.ownership import KVSharding, kv_owner, local_index
from helix.kv.page_table import PageTable


@dataclass
class LocalKVMeta:
    """One step's attention metadata on one rank. S sequences, T query tokens in total. The first
    `num_decode` sequences are decode rows: one query each, at the end of the sequence's KV."""

    slots: torch.Tensor         # [T] int64: flat slot (page * page_size + offset) or -1 (not owner)
    block_tables: torch.Tensor  # [S, max_pages] int32: local pages of each sequence
    kv_lens: torch.Tensor       # [S] int32: local KV positions after this step's append
    cu_q: torch.Tensor          # [S+1] int32: query token offsets of each sequence
    q_pos: torch.Tensor         # [T] int64: global position of each query token
    kvp_rank: int               # this rank's KVP index (global position of local KV)
    kvp: int                    # KVP degree
    interleave: int             # kv_interleave
    page_size: int
    num_decode: int             # leading sequences with one query token at their end
    max_q: int = 1              # most query tokens of any sequence (prefill kernels' grid)
    max_kv: int = 0             # most local KV positions of any prefill sequence (host; 0: none)
    cp: object = None           # helix.kv.context_parallel.CPPlan: this step's chunks pass KV
    host_lens: tuple | None = None   # (kv_lens, query counts) as host lists, when known: kernels
                                     # that size work on the host read them without a sync
    micro_batches: int = 1      # HOP-B: decode rows split into this many micro-batches

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence is a decode row."""
        return self.num_decode == self.num_seqs

    def rows(self, a: int, b: int) -> "LocalKVMeta":
        """Decode rows [a, b) (a HOP-B micro-batch): one query per sequence."""
        assert self.is_decode
        return LocalKVMeta(self.slots[a:b], self.block_tables[a:b], self.kv_lens[a:b],
                           self.cu_q[a:b + 1] - a, self.q_pos[a:b], self.kvp_rank, self.kvp,
                           self.interleave, self.page_size, num_decode=b - a)

    def split(self, d: int | None = None) -> tuple["LocalKVMeta", "LocalKVMeta"]:
        """(decode rows, prefill rows): the two parts of a mixed step, sequences (and queries)
        [:d] and [d:]; d defaults to num_decode."""
        d = self.num_decode if d is None else d
        common = dict(kvp_rank=self.kvp_rank, kvp=self.kvp, interleave=self.interleave,
                      page_size=self.page_size)
        lens = self.host_lens
        dec = LocalKVMeta(self.slots[:d], self.block_tables[:d], self.kv_lens[:d],
                          self.cu_q[:d + 1], self.q_pos[:d], num_decode=d, max_q=1,
                          host_lens=lens and (lens[0][:d], lens[1][:d]), **common)
        pre = LocalKVMeta(_aligned(self.slots[d:]), _aligned(self.block_tables[d:]),
                          _aligned(self.kv_lens[d:]), self.cu_q[d:] - d,
                          _aligned(self.q_pos[d:]), num_decode=0, max_q=self.max_q,
                          max_kv=self.max_kv, host_lens=lens and (lens[0][d:], lens[1][d:]),
                          **common)
        return dec, pre


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy where the slice starts off a 16-byte boundary: Triton compiles a kernel per
    pointer alignment it sees, and a mixed step's prefill rows start at every decode count, so
    without the copy a server compiles a new variant mid-serving (a ~1.3 s step on the H200,
    profiling/results/serve.md). The copies are a few hundred bytes."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


class KVManager:
    def __init__(self, num_pages: int, page_size: int, kvp_rank: int, kvp: int, interleave: int):
        self.alloc = PageAllocator(num_pages)
        self.page_size = page_size
        self.kvp_rank, self.kvp, self.interleave = kvp_rank, kvp, interleave
        self.sharding = KVSharding(kvp, interleave, page_size)
        self.pages: dict[int, list[int]] = {}   # seq id -> local pages
        self.lengths: dict[int, int] = {}       # seq id -> global length written
        self.table = PageTable()                # the same pages as one int32 table
        self.shared: dict[int, int] = {}        # seq id -> its leading pages that are cached
                                                # blocks' (not freed with the sequence)
        self.block_pages: dict[int, list[int]] = {}   # cached block id -> its local pages

    def local_tokens(self, seq_id: int) -> int:
        return self.sharding.local_len(self.lengths.get(seq_id, 0), self.kvp_rank)

    def _grow(self, seq_id: int, new_len: int) -> int:
        """Pages for new_len positions; returns the positions this rank then holds."""
        local = self.sharding.local_len(new_len, self.kvp_rank)
        need = -(-local // self.page_size)
        pages = self.pages.setdefault(seq_id, [])
        if need > len(pages):
            pages.extend(self.alloc.allocate(need - len(pages)))
            self.table.set(seq_id, pages)
        self.lengths[seq_id] = new_len
        return local

    def assume_prefix(self, seq_id: int, length: int) -> None:
        """Take positions [0, length) of a new sequence as already written (their pages hold
        whatever they hold): long-context benchmarks start decoding without a prefill."""
        if self.lengths.get(seq_id, 0):
            raise RuntimeError(f"sequence {seq_id} already holds KV: a synthetic prefix is for a "
                               f"new sequence")
        self._grow(seq_id, length)

    def import_prefix(self, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take positions [0, length) of a new sequence as written by a KV import: this rank's
        pages for them are allocated; returns the positions it owns [n] and their slots [n]."""
        self.assume_prefix(seq_id, length)
        pos = torch.arange(length)
        slots = self._slots(self.pages[seq_id], pos)
        mine = slots >= 0
        return pos[mine], slots[mine]

    def owned(self, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [n], slots [n]) of [0, length) of a sequence this rank holds (KV export)."""
        pos = torch.arange(min(length, self.lengths.get(seq_id, 0)))
        slots = self._slots(self.pages.get(seq_id, []), pos)
        mine = slots >= 0
        return pos[mine], slots[mine]

    def free(self, seq_id: int) -> None:
        """Release a sequence's pages, but those of cached blocks (the prefix cache's)."""
        self.alloc.free(self.pages.pop(seq_id, [])[self.shared.pop(seq_id, 0):])
        self.lengths.pop(seq_id, None)
        self.table.drop(seq_id)

    # -- the scheduler's decisions (helix/runtime/scheduler.py, helix/kv/prefix_cache.py) -----
    def apply_ops(self, ops: list[tuple], host=None) -> None:
        """Apply the scheduler's KV ops in their order: ("free", seq) - a sequence that ended or
        was preempted; the prefix cache's attach / register / evict, and with its host tier
        (host: helix.kv.host_cache.HostCache) offload / load."""
        n = self.sharding.block_pages
        for op in ops:
            if op[0] == "free":
                self.free(op[1])
            elif op[0] == "attach":                   # a new sequence starts with cached blocks
                _, seq_id, blocks = op
                if self.lengths.get(seq_id, 0):
                    raise RuntimeError(f"sequence {seq_id} already holds KV: cached blocks "
                                       f"start a new sequence")
                self.pages[seq_id] = [p for b in blocks for p in self.block_pages[b]]
                self.shared[seq_id] = len(blocks) * n
                self.lengths[seq_id] = len(blocks) * self.sharding.block_tokens
                self.table.set(seq_id, self.pages[seq_id])
            elif op[0] == "register":               # a sequence's block b becomes cached
                _, seq_id, b, block = op
                if self.shared.get(seq_id, 0) != b * n:
                    raise RuntimeError(f"sequence {seq_id}: block {b} registered out of order")
                self.block_pages[block] = self.pages[seq_id][b * n:(b + 1) * n]
                self.shared[seq_id] = (b + 1) * n
            elif op[0] == "evict":
                self.alloc.free(self.block_pages.pop(op[1]))
            elif op[0] == "offload":                # to host memory, its pages then free
                pages = self.block_pages.pop(op[1])
                host.offload(pages, op[2])
                self.alloc.free(pages)
            elif op[0] == "load":                   # back from host memory into new pages
                pages = self.block_pages[op[1]] = self.alloc.allocate(n)
                host.load(op[2], pages)
            else:
                raise ValueError(f"unknown KV op {op[0]!r}")

    def _slots(self, pages: list[int], p):
        """Flat slot of position(s) p (an int, or a tensor of a prompt's positions) on this rank;
        -1 where another KVP rank owns the position."""
        j = local_index(p, self.kvp, self.interleave)
        mine = kv_owner(p, self.kvp, self.interleave) == self.kvp_rank
        if isinstance(p, int):
            return pages[j // self.page_size] * self.page_size + j % self.page_size if mine else -1
        if not pages:                       # this rank owns none of the sequence yet
            return torch.full_like(p, -1)
        # positions owned elsewhere index past this rank's pages: clamp, then mask them out
        page = torch.tensor(pages, dtype=torch.int64)[
            (j // self.page_size).clamp(max=len(pages) - 1)]
        return torch.where(mine, page * self.page_size + j % self.page_size, -1)

    def truncate(self, seq_id: int, length: int) -> None:
        """Back to `length` positions (a step that failed before it ran): pages past it freed."""
        if seq_id not in self.lengths:
            return
        keep = self.sharding.pages(length, self.kvp_rank)
        if keep < self.shared.get(seq_id, 0):
            raise RuntimeError(f"sequence {seq_id}: truncating into its cached blocks")
        pages = self.pages[seq_id]
        if len(pages) > keep:
            self.alloc.free(pages[keep:])
            del pages[keep:]
            self.table.set(seq_id, pages)
        self.lengths[seq_id] = length

    def prepare(self, batch: list[tuple[int, int, int]], device) -> LocalKVMeta:
        """batch: (seq_id, start position, number of new tokens) per sequence, in batch order,
        decode rows (one token) first. Grows each sequence's pages and returns this rank's
        metadata for the step. Decode rows stay Python ints until one tensor per field (a
        step's host work is paid per row: ~1 us a row here, not a torch op per row)."""
        slots, q_pos, cu, lens = [], [], [0], []
        prompt_slots, prompt_pos = [], []         # (row, tensor) of the prompt chunks
        for seq_id, start, n in batch:
            have = self.lengths.get(seq_id, 0)
            if have != start:
                raise RuntimeError(f"sequence {seq_id}: step starts at position {start}, the "
                                   f"KV cache holds {have} (scheduler and KV out of step)")
            local = self._grow(seq_id, start + n)
            if n == 1:
                slots.append(self._slots(self.pages[seq_id], start))
                q_pos.append(start)
            else:                                           # prompts: vectorised
                pos = torch.arange(start, start + n)
                prompt_slots.append((len(slots), self._slots(self.pages[seq_id], pos)))
                prompt_pos.append((len(slots), pos))
                slots.append(None)
                q_pos.append(None)
            cu.append(cu[-1] + n)
            lens.append(local)
        table = self.table.rows([s for s, _, _ in batch])
        num_decode = next((i for i, (_, _, n) in enumerate(batch) if n != 1), len(batch))
        return LocalKVMeta(
            slots=upload(_join(slots, prompt_slots), device),
            block_tables=upload(table, device),
            kv_lens=upload(torch.tensor(lens, dtype=torch.int32), device),
            cu_q=upload(torch.tensor(cu, dtype=torch.int32), device),
            q_pos=upload(_join(q_pos, prompt_pos), device),
            kvp_rank=self.kvp_rank, kvp=self.kvp, interleave=self.interleave,
            page_size=self.page_size, num_decode=num_decode,
            max_q=max([n for _, _, n in batch] + [1]),
            max_kv=max([n for (_, _, q), n in zip(batch, lens) if q > 1] + [0]),
            host_lens=(lens, [n for _, _, n in batch]))


def _join(ints: list, chunks: list) -> torch.Tensor:
    """One int64 tensor of per-row values: `ints` holds a decode row's int, or None at the row
    of each (row, tensor) in `chunks`, whose tensor goes there."""
    if not chunks:
        return torch.tensor(ints, dtype=torch.int64)
    parts, prev = [], 0
    for i, t in chunks:
        parts += [torch.tensor(ints[prev:i], dtype=torch.int64), t]
        prev = i + 1
    parts.append(torch.tensor(ints[prev:], dtype=torch.int64))
    return torch.cat(parts)


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory and an asynchronous copy, so the
    host does not wait for the stream (the caching host allocator keeps the pinned block until
    the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
