"""The whole decode step (every layer, the Helix all-to-all and all-reduces, the LM head) captured
as one breakable CUDA graph per batch bucket, replayed with per-rank padded inputs.

Static inputs (rows = the largest bucket): ids, src, pos, slots, kv_lens and block_tables, packed
in one int64 and one int32 arena: a step writes them into a pinned host mirror (two mirrors,
alternating, so a step can be prepared while the previous one still runs) and uploads them with
two asynchronous copies. Each rank writes its own per-rank metadata (its slots, its local lengths,
its pages); padded rows get slot -1 (no KV write) and length 0 (LSE = -inf, output ignored).
Token ids need no host round trip: a row whose token was sampled by the previous step (still
on the device, overlapped scheduling) has src = its row in the engine's token buffer, and the
graph gathers it; the graph ends with the greedy argmax written back into that buffer. Every rank replays the same
bucket: the scheduler is replicated, so the batch size is the same on every rank by construction,
and `agree` can additionally take the max over ranks (one small all-reduce) as a check.

Regions a backend cannot capture run as eager breaks: "attention" when the attention backend is
not graph-safe (the torch reference syncs with the host), "moe" when the experts are not.
On CPU the same runner runs every step eagerly through the same code, so CI covers the logic.
"""

from __future__ import annotations

import torch

from graphs import BucketLadder, GraphRunner, HostStaging, StaticBuffers
from graphs.buckets import agreed_rows, dist_reduce_max
from helix.kv.manager import LocalKVMeta
from helix.layers.fused_ops import select_tokens
from helix.runtime.sampler import sample_rows


class DecodeGraphs:
    def __init__(self, engine, buckets: tuple[int, ...], breaks: tuple[str, ...], max_pages: int,
                 check_agreement: bool = False):
        self.engine = engine
        dev = engine.device
        ladder = (BucketLadder(buckets=buckets) if buckets
                  else BucketLadder(max_size=engine.runtime.max_batch))
        # block_tables last: an upload copies only the bucket's rows of the widest buffer
        bufs = StaticBuffers.packed(ladder.max, dev, {
            "ids": ((), torch.int64, 0), "src": ((), torch.int64, -1),
            "pos": ((), torch.int64, 0), "slots": ((), torch.int64, -1),
            "kv_lens": ((), torch.int32, 0), "block_tables": ((max_pages,), torch.int32, 0)})
        # cu_q of a decode step is 0..rows; rows <= max_batch also in the eager fallback
        rows = max(ladder.max, engine.runtime.max_batch)
        self.arange = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.needed_breaks = set(breaks)
        if not getattr(engine.backend, "graph_safe", False):
            self.needed_breaks.add("attention")
        if not all(getattr(m, "graph_safe", True) for m in engine.model.modules()):
            self.needed_breaks.add("moe")
        self.runner = GraphRunner(self._step, ladder, bufs, breaks=self.needed_breaks,
                                  enabled=dev.type == "cuda" and not engine.runtime.graph_eager)
        self.mirrors = (HostStaging(bufs), HostStaging(bufs))   # alternate: see HostStaging
        self._flip = 0
        # the sampler (temperature / top-k / top-p rows) as its own graph per bucket, replayed
        # after the step's graph only when a row samples; it reads that graph's logits
        sbufs = StaticBuffers.packed(ladder.max, dev, {
            "temperature": ((), torch.float32, 0.0), "top_p": ((), torch.float32, 1.0),
            "top_k": ((), torch.int64, 0), "seed": ((), torch.int64, 0),
            "counter": ((), torch.int64, 0)})
        self.sampler = GraphRunner(self._sample_step, ladder, sbufs,
                                   enabled=dev.type == "cuda" and not engine.runtime.graph_eager)
        self.sampler_mirrors = (HostStaging(sbufs), HostStaging(sbufs))
        self._logits = None
        self.agree = dist_reduce_max(device=dev) if check_agreement else None
        self.max_pages = max_pages

    @property
    def ladder(self) -> BucketLadder:
        return self.runner.ladder

    def capture(self) -> None:
        """Capture every bucket, largest first (collective: every rank at start-up)."""
        self.runner.capture_all()
        self.sampler.capture_all()

    def _step(self, bucket: int, bufs: StaticBuffers, ctx):
        e = self.engine
        kv = e.kv
        meta = LocalKVMeta(slots=bufs.view("slots", bucket), block_tables=bufs.view("block_tables", bucket),
                           kv_lens=bufs.view("kv_lens", bucket), cu_q=self.arange[:bucket + 1],
                           q_pos=bufs.view("pos", bucket), kvp_rank=kv.kvp_rank, kvp=kv.kvp,
                           interleave=kv.interleave, page_size=kv.page_size, is_decode=True)
        ids = select_tokens(bufs.view("src", bucket), bufs.view("ids", bucket), e.tok_buf)
        # every row is its sequence's last token: last=None, no gather
        logits = e.model(ids, meta.q_pos, meta, e.caches, e.backend, None, ctx)
        torch.argmax(logits, -1, out=e.tok_buf[:bucket])     # greedy tokens, on the device
        return logits

    def _sample_step(self, bucket: int, bufs: StaticBuffers, ctx):
        g = self.runner.graphs.get(bucket)
        # captured: the step graph's static logits of this bucket; eager: the last step's
        logits = g.output if self.runner.use_graphs and g is not None else self._logits
        if logits is None:                     # the eager "capture" before any step: no-op
            return None
        sample_rows(logits, bufs.view("temperature", bucket), bufs.view("top_k", bucket),
                    bufs.view("top_p", bucket), bufs.view("seed", bucket),
                    bufs.view("counter", bucket), self.engine.tok_buf)

    def run(self, ids: torch.Tensor, src: torch.Tensor, meta: LocalKVMeta,
            sampling: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step from this rank's host-side metadata -> logits [n, V] (a view of the
        graph's output: valid until the next step); the step's tokens land in the engine's
        token buffer. ids/src: host ids, and per row the row of the token buffer to take the id
        from instead (-1: use ids). sampling: sampling.row_params of the rows when any row
        samples (None: all greedy, the graph's argmax is the token)."""
        n = ids.numel()
        rows = agreed_rows(n, self.agree)        # the bucket every rank replays
        bucket = self.ladder.choose(rows)
        if bucket is None:                       # above the largest bucket: the eager fallback
            inputs = dict(ids=ids, src=src, pos=meta.q_pos, slots=meta.slots,
                          kv_lens=meta.kv_lens, block_tables=meta.block_tables)
            self._logits = self.runner.run(rows, inputs)
            if sampling is not None:
                self.sampler.run(rows, sampling)
            return self._logits[:n]
        m = self.mirrors[self._flip]
        sm = self.sampler_mirrors[self._flip]
        self._flip ^= 1
        m.put("ids", ids, bucket)
        m.put("src", src, bucket)
        m.put("pos", meta.q_pos, bucket)
        m.put("slots", meta.slots, bucket)
        m.put("kv_lens", meta.kv_lens, bucket)
        # columns past a row's pages are never read (kernels stop at kv_len): left stale
        m.put("block_tables", meta.block_tables, bucket, pad_tail=False)
        m.upload(bucket, non_blocking=True)
        self._logits = self.runner.run(rows)
        if sampling is not None:
            for name, t in sampling.items():
                sm.put(name, t, bucket)
            sm.upload(bucket, non_blocking=True)
            self.sampler.run(rows)
        return self._logits[:n]

    def close(self) -> None:
        self.sampler.close()
        self.runner.close()
