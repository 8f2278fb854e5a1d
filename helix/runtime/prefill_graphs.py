"""Prefill and mixed steps (prompt chunks, with or without decode rows) through breakable CUDA
graphs: one graph per per-rank token bucket and per way the chunks attend (pass-KV or not),
captured at start-up into the decode graphs' pool, replayed with per-rank padded inputs.

What a graph holds (docs/design.md, "Prefill under graphs"):
- captured: the embedding and its all-reduce; per layer the norms, the gather of this rank's
  rows (pass-KV), the QKV projection with RoPE, the output projection and its all-reduce, the
  FFN / MoE and theirs. Fixed-shape work, whose launches an eager step pays for on the host.
- eager, the break "attention": KV append, the decode rows' attention and exchange, the
  chunks' attention over their causal prefix (pass-KV: the gather or ring of their KV pages,
  the merge, the token all-to-all). Its shapes follow the step's prompts (sequences, pages
  gathered, per-rank counts) and the prefill kernels read host values, so it runs on the step's
  own metadata: the break reads `metas[key]`, whose fields each step replaces (the captured
  segments read only the static buffers those fields point at).
- eager, after the replay: the final norm of the sampled rows, the LM head, sampling (their row
  count is the step's sequence count), as in an eager step.

Buckets count the tokens a rank projects. Without pass-KV ("local": one rank, or pass-Q) every
rank projects all T tokens: bucket b >= T. With pass-KV KVP rank k projects R_k = D + own_k rows
(the decode rows and its own chunk positions): b >= max_k R_k, the same on every rank (every
rank knows every rank's counts from the replicated schedule), and the replicated layers run on
min(kvp * b, max step) tokens, which holds the step since T <= sum_k R_k <= kvp * b. Each rank
pads its own rows to b (gather index 0; their q/k/v are never read) and the step's tokens to the
bucket's token count (id 0, position 0, slot -1: no KV write; local mode gives them one extra
sequence of KV length 0, so attention returns O = 0, LSE = -inf for them). Capture runs on a
step of padding rows only: an empty KV shard per sequence, every collective at its real size.
On CPU the same runners run every step eagerly through the same code.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from helix.graphs import BucketLadder, GraphPool, GraphRunner, HostStaging, StaticBuffers
from helix.kv.context_parallel import CPPlan
from helix.kv.manager import LocalKVMeta, upload
from helix.runtime.sampler import Sampler

# The default ladder stops here: graphs pay where a step is bound by kernel launches; a larger
# step's kernels outlast their launches, while every bucket costs a capture at start-up and its
# padding costs compute. Measured on one H200 (4 Llama-3.1-8B layers,
# profiling/results/prefill_graphs.md): 1.37 x at 512 tokens, 1.20 x at 700, 1.06 x at 1024,
# 0.97-1.07 x from 2048 on. RuntimeConfig.prefill_graph_buckets sets any ladder.
DEFAULT_MAX_TOKENS = 1024

LOCAL, PASS_KV = "local", "pass-kv"


class PrefillGraphs:
    def __init__(self, model, caches, backend, sampler: Sampler, kv_geometry: dict,
                 ladder: BucketLadder, max_tokens: int, modes: tuple[str, ...],
                 breaks: tuple[str, ...], device, enabled: bool = True,
                 pool: GraphPool | None = None):
        """kv_geometry: LocalKVMeta's rank fields (kvp_rank, kvp, interleave, page_size);
        max_tokens: the most tokens a step holds (max_batch + max_prefill_tokens); modes: the
        graph families to capture, LOCAL and / or PASS_KV."""
        self.model, self.caches, self.backend, self.sampler = model, caches, backend, sampler
        self.geometry, self.ladder, self.max_tokens = kv_geometry, ladder, max_tokens
        self.device = torch.device(device)
        # rows last: an upload copies only the bucket's rows of the last buffer
        bufs = StaticBuffers.packed(max_tokens, device, {
            "ids": ((), torch.int64, 0), "src": ((), torch.int64, -1),
            "pos": ((), torch.int64, 0), "slots": ((), torch.int64, -1),
            "rows": ((), torch.int64, 0)})
        self.bufs = bufs
        self.needed_breaks = {"attention", *breaks}
        if not all(getattr(m, "graph_safe", True) for m in model.modules()):
            self.needed_breaks.add("moe")
        self.runners = {mode: GraphRunner(partial(self._step, mode), ladder, bufs,
                                          breaks=self.needed_breaks, enabled=enabled,
                                          warmup=1, pool=pool)
                        for mode in modes}
        self.mirrors = (HostStaging(bufs), HostStaging(bufs))   # alternate: see HostStaging
        self._flip = 0
        self.metas: dict[tuple[str, int], LocalKVMeta] = {}    # the break's view of its step
        self.last_key: tuple[str, int] | None = None           # (mode, bucket) last replayed

    def capture(self) -> None:
        """Capture every bucket of every mode, largest first (collective: every rank)."""
        for runner in self.runners.values():
            runner.capture_all()

    def tokens(self, mode: str, bucket: int) -> int:
        """The step tokens a graph holds: its bucket, or with pass-KV up to kvp buckets."""
        return bucket if mode == LOCAL else min(self.geometry["kvp"] * bucket, self.max_tokens)

    def choose(self, tokens: int, rows_per_rank: list[int] | None) -> tuple[str, int] | None:
        """The graph a step of `tokens` tokens replays, (mode, bucket), the same on every rank;
        None when it has none (the step runs eagerly). rows_per_rank: the rows each KVP rank
        projects with pass-KV, None without (every rank projects all tokens)."""
        mode = LOCAL if rows_per_rank is None else PASS_KV
        if mode not in self.runners:
            return None
        bucket = self.ladder.choose(tokens if rows_per_rank is None else max(rows_per_rank))
        return None if bucket is None else (mode, bucket)

    def _step(self, mode: str, bucket: int, bufs: StaticBuffers, ctx):
        T = self.tokens(mode, bucket)
        if (mode, bucket) not in self.metas:                   # capture: padding rows only
            self.metas[mode, bucket] = self._padding_meta(mode, bucket)
        meta = self.metas[mode, bucket]
        ids = self.sampler.select(bufs["src"][:T], bufs["ids"][:T])
        return self.model.hidden(ids, bufs["pos"][:T], meta, self.caches, self.backend, ctx)

    def run(self, key: tuple[str, int], ids: torch.Tensor, src: torch.Tensor,
            meta: LocalKVMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of n tokens from this rank's host-side metadata (meta from KVManager.prepare
        on the host, its pass-KV plan in meta.cp) -> (h, residual) [tokens, D], the last layer's
        output (views of the graph's outputs: valid until the next replay; rows past n are
        padding). ids/src: host ids, and per row the row of the sampler's token buffer to take
        the id from instead (-1: use ids)."""
        mode, bucket = key
        T = self.tokens(mode, bucket)
        m = self.mirrors[self._flip]
        self._flip ^= 1
        m.put("ids", ids, T)
        m.put("src", src, T)
        m.put("pos", meta.q_pos, T)
        m.put("slots", meta.slots, T)
        if meta.cp is not None:
            m.put("rows", meta.cp.host_rows, bucket)
        m.upload(bucket, non_blocking=True)
        fresh = self._step_meta(mode, bucket, meta)
        holder = self.metas[key]
        for f in dataclasses.fields(LocalKVMeta):
            setattr(holder, f.name, getattr(fresh, f.name))
        self.last_key = key
        return self.runners[mode].replay(bucket)

    def _step_meta(self, mode: str, bucket: int, meta: LocalKVMeta) -> LocalKVMeta:
        """The step's metadata as the break sees it: slots and positions in the static buffers,
        the rest of this step's on the device; pass-KV: the plan's rows in the static buffer;
        local: the padding rows as one sequence of KV length 0."""
        T, bufs = self.tokens(mode, bucket), self.bufs
        cu_q, kv_lens, tables, max_q = meta.cu_q, meta.kv_lens, meta.block_tables, meta.max_q
        pad, cp, lens = T - meta.slots.numel(), meta.cp, meta.host_lens
        if mode == LOCAL and pad:
            cu_q = torch.cat((cu_q, cu_q.new_tensor([T])))
            kv_lens = torch.cat((kv_lens, kv_lens.new_zeros(1)))
            tables = torch.cat((tables, tables.new_zeros(1, tables.shape[1])))
            max_q = max(max_q, pad)
            lens = lens and (lens[0] + [0], lens[1] + [pad])
        if cp is not None:
            cp = dataclasses.replace(cp, rows=bufs["rows"][:bucket])
        return dataclasses.replace(
            meta, slots=bufs["slots"][:T], q_pos=bufs["pos"][:T], cu_q=upload(cu_q, self.device),
            kv_lens=upload(kv_lens, self.device), block_tables=upload(tables, self.device),
            max_q=max_q, cp=cp, host_lens=lens)

    def _padding_meta(self, mode: str, bucket: int) -> LocalKVMeta:
        """A step of padding rows only, what capture runs on: one sequence of KV length 0
        (local); pass-KV: every rank's rows of one chunk, split as evenly as the bucket allows,
        each attending an empty shard (one gathered page slot, never read)."""
        T, dev, bufs = self.tokens(mode, bucket), self.device, self.bufs
        g = self.geometry

        def empty(q_rows: int, **kw) -> LocalKVMeta:
            fields = dict(g, slots=bufs["slots"][:T], q_pos=bufs["pos"][:T], num_decode=0)
            fields.update(kw)
            return LocalKVMeta(block_tables=torch.zeros((1, 1), dtype=torch.int32, device=dev),
                               kv_lens=torch.zeros(1, dtype=torch.int32, device=dev),
                               cu_q=torch.tensor([0, q_rows], dtype=torch.int32, device=dev),
                               max_q=max(q_rows, 1), **fields)

        if mode == LOCAL:
            return empty(T)
        kvp, me = g["kvp"], g["kvp_rank"]
        counts = [min(bucket, max(0, T - i * bucket)) for i in range(kvp)]
        width = max(counts)
        dest = torch.full((kvp, width), T, dtype=torch.long)
        for i, c in enumerate(counts):
            dest[i, :c] = torch.arange(i * bucket, i * bucket + c)
        mine = counts[me]
        own = torch.zeros(mine, dtype=torch.long, device=dev)
        sources = [empty(mine, kvp_rank=j, slots=own - 1, q_pos=own) for j in range(kvp)]
        plan = CPPlan(rows=bufs["rows"][:bucket],
                      host_rows=torch.arange(me * bucket, me * bucket + mine),
                      num_decode=0, own_counts=counts, dest=dest.flatten().to(dev),
                      num_chunk_rows=T, gather_pages=torch.zeros(1, dtype=torch.long, device=dev),
                      sources=sources, ring=False)
        return empty(T, cp=plan)

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.metas.clear()
