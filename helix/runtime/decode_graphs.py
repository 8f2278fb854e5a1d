"""The whole decode step (every layer, the Helix all-to-all and all-reduces, the LM head, the
greedy argmax) captured as one breakable CUDA graph per batch bucket, replayed with per-rank
padded inputs.

Static inputs (rows = the largest bucket): ids, src, pos, slots, kv_lens and block_tables, packed
in one int64 and one int32 arena: a step writes them into a pinned host mirror (two mirrors,
alternating, so a step can be prepared while the previous one still runs) and uploads them with
two asynchronous copies. Each rank writes its own per-rank metadata (its slots, its local lengths,
its pages); padded rows get slot -1 (no KV write) and length 0 (LSE = -inf, output ignored).
Token ids need no host round trip: a row whose token was sampled by the previous step (still on
the device) has src = its row in the sampler's token buffer, and the graph gathers it. Every rank
replays the same bucket: the scheduler is replicated, so the batch size is the same on every
rank by construction.

Regions a backend cannot capture run as eager breaks: "attention" when the attention backend is
not graph-safe (the torch reference syncs with the host), "moe" when the experts are not.
On CPU the same runner runs every step eagerly through the same code, so CI covers the logic.
"""

from __future__ import annotations

import torch

from helix import triton_util
from helix.graphs import BucketLadder, GraphPool, GraphRunner, HostStaging, StaticBuffers
from helix.kv.manager import LocalKVMeta
from helix.runtime.sampler import Sampler


class DecodeGraphs:
    def __init__(self, model, caches, backend, sampler: Sampler, kv_geometry: dict,
                 ladder: BucketLadder, breaks: tuple[str, ...], max_pages: int, device,
                 enabled: bool = True, micro_batches=lambda rows: 1,
                 pool: GraphPool | None = None):
        """kv_geometry: LocalKVMeta's rank fields (kvp_rank, kvp, interleave, page_size);
        micro_batches(rows): HOP-B's split of a bucket (fixed per bucket, so it captures);
        pool: the memory pool to capture into (shared with the prefill graphs)."""
        pool = pool if pool is not None else GraphPool()
        self.model, self.caches, self.backend, self.sampler = model, caches, backend, sampler
        self.mla = model.config.is_mla
        self.geometry = kv_geometry
        self.ladder = ladder
        # block_tables last: an upload copies only the bucket's rows of the widest buffer
        bufs = StaticBuffers.packed(ladder.max, device, {
            "ids": ((), torch.int64, 0), "src": ((), torch.int64, -1),
            "pos": ((), torch.int64, 0), "slots": ((), torch.int64, -1),
            "kv_lens": ((), torch.int32, 0), "block_tables": ((max_pages,), torch.int32, 0)})
        self.arange = torch.arange(ladder.max + 1, dtype=torch.int32, device=device)   # cu_q
        self.needed_breaks = set(breaks)
        if not getattr(backend, "graph_safe", False):
            self.needed_breaks.add("attention")
        # HOP-B's streams cannot straddle an eager attention break of a captured graph
        enabled = enabled and torch.device(device).type == "cuda"
        self.micro_batches = ((lambda rows: 1) if enabled and "attention" in self.needed_breaks
                              else micro_batches)
        if not all(getattr(m, "graph_safe", True) for m in model.modules()):
            self.needed_breaks.add("moe")
        self.runner = GraphRunner(self._step, ladder, bufs, breaks=self.needed_breaks,
                                  enabled=enabled, pool=pool)
        self.mirrors = (HostStaging(bufs), HostStaging(bufs))   # alternate: see HostStaging
        self._flip = 0
        # the sampler (temperature / top-k / top-p rows) as its own graph per bucket, replayed
        # after the step's graph only when a row samples; it reads that graph's logits
        sbufs = StaticBuffers.packed(ladder.max, device, {
            "temperature": ((), torch.float32, 0.0), "top_p": ((), torch.float32, 1.0),
            "top_k": ((), torch.int64, 0), "seed": ((), torch.int64, 0),
            "counter": ((), torch.int64, 0)})
        self.sampling = GraphRunner(self._sample_step, ladder, sbufs, enabled=enabled, pool=pool)
        self.sampling_mirrors = (HostStaging(sbufs), HostStaging(sbufs))
        self._logits = None

    def capture(self) -> None:
        """Capture every bucket, largest first (collective: every rank at start-up)."""
        self.runner.capture_all()
        self.sampling.capture_all()

    def _step(self, bucket: int, bufs: StaticBuffers, ctx):
        meta = LocalKVMeta(slots=bufs.view("slots", bucket),
                           block_tables=bufs.view("block_tables", bucket),
                           kv_lens=bufs.view("kv_lens", bucket), cu_q=self.arange[:bucket + 1],
                           q_pos=bufs.view("pos", bucket), num_decode=bucket,
                           micro_batches=self.micro_batches(bucket), **self.geometry)
        # the bucket's PDL bits (one row of MLA: the next kernel launched before each wait)
        with triton_util.launch_flags(triton_util.decode_flags(bucket, self.mla)):
            ids = self.sampler.select(bufs.view("src", bucket), bufs.view("ids", bucket))
            # every row is its sequence's last token: last=None, no gather
            logits = self.model(ids, meta.q_pos, meta, self.caches, self.backend, None, ctx)
            self.sampler.greedy(logits)
        return logits

    def _sample_step(self, bucket: int, bufs: StaticBuffers, ctx):
        g = self.runner.graphs.get(bucket)
        # captured: the step graph's static logits of this bucket; eager: the last step's
        logits = g.output if self.runner.use_graphs and g is not None else self._logits
        if logits is None:                     # the eager "capture" before any step: no-op
            return None
        self.sampler.sample_rows(logits, {name: bufs.view(name, bucket) for name in bufs.names()})

    def fits(self, rows: int) -> bool:
        return self.ladder.choose(rows) is not None

    def run(self, ids: torch.Tensor, src: torch.Tensor, meta: LocalKVMeta,
            sampling: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step of n <= ladder.max rows from this rank's host-side metadata -> logits
        [n, V] (a view of the graph's output: valid until the next step); the step's tokens land
        in the sampler's token buffer. ids/src: host ids, and per row the row of the token
        buffer to take the id from instead (-1: use ids). sampling: row_params of the rows when
        any row samples (None: all greedy, the graph's argmax is the token)."""
        n = ids.numel()
        bucket = self.ladder.choose(n)
        m = self.mirrors[self._flip]
        sm = self.sampling_mirrors[self._flip]
        self._flip ^= 1
        m.put("ids", ids, bucket)
        m.put("src", src, bucket)
        m.put("pos", meta.q_pos, bucket)
        m.put("slots", meta.slots, bucket)
        m.put("kv_lens", meta.kv_lens, bucket)
        # columns past a row's pages are never read (kernels stop at kv_len): left stale
        m.put("block_tables", meta.block_tables, bucket, pad_tail=False)
        m.upload(bucket, non_blocking=True)
        self._logits = self.runner.replay(bucket)
        if sampling is not None:
            for name, t in sampling.items():
                sm.put(name, t, bucket)
            sm.upload(bucket, non_blocking=True)
            self.sampling.replay(bucket)
        return self._logits[:n]

    def close(self) -> None:
        self.sampling.close()
        self.runner.close()
