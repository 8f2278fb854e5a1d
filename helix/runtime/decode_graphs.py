"""The whole decode step (every layer, the Helix all-to-all and all-reduces, the LM head) captured
as one breakable CUDA graph per batch bucket, replayed with per-rank padded inputs.

Static inputs (rows = the largest bucket): ids, pos, slots, kv_lens and block_tables. Each rank
copies its own per-rank metadata into them (its slots, its local lengths, its pages); padded rows
get slot -1 (no KV write) and length 0 (LSE = -inf, output ignored). Every rank replays the same
bucket: the scheduler is replicated, so the batch size is the same on every rank by construction,
and `agree` can additionally take the max over ranks (one small all-reduce) as a check.

Regions a backend cannot capture run as eager breaks: "attention" when the attention backend is
not graph-safe (the torch reference syncs with the host), "moe" when the experts are not.
On CPU the same runner runs every step eagerly through the same code, so CI covers the logic.
"""

from __future__ import annotations

import torch

from graphs import BucketLadder, GraphRunner, StaticBuffers
from graphs.buckets import dist_reduce_max
from helix.kv.manager import LocalKVMeta


class DecodeGraphs:
    def __init__(self, engine, buckets: tuple[int, ...], breaks: tuple[str, ...], max_pages: int,
                 check_agreement: bool = False):
        self.engine = engine
        dev = engine.device
        ladder = (BucketLadder(buckets=buckets) if buckets
                  else BucketLadder(max_size=engine.runtime.max_batch))
        bufs = StaticBuffers(ladder.max, dev)
        bufs.add("ids", (), torch.int64, pad=0)
        bufs.add("pos", (), torch.int64, pad=0)
        bufs.add("slots", (), torch.int64, pad=-1)
        bufs.add("kv_lens", (), torch.int32, pad=0)
        bufs.add("block_tables", (max_pages,), torch.int32, pad=0)
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
        # pinned host staging: one asynchronous copy per input, no host stall before the replay
        pin = dev.type == "cuda"
        self.staging = {name: torch.zeros((rows, *bufs.spec(name).row_shape), dtype=bufs[name].dtype,
                                          pin_memory=pin) for name in bufs.names()}
        self.agree = dist_reduce_max(device=dev) if check_agreement else None
        self.max_pages = max_pages

    @property
    def ladder(self) -> BucketLadder:
        return self.runner.ladder

    def capture(self) -> None:
        """Capture every bucket, largest first (collective: every rank at start-up)."""
        self.runner.capture_all()

    def _step(self, bucket: int, bufs: StaticBuffers, ctx):
        e = self.engine
        kv = e.kv
        meta = LocalKVMeta(slots=bufs.view("slots", bucket), block_tables=bufs.view("block_tables", bucket),
                           kv_lens=bufs.view("kv_lens", bucket), cu_q=self.arange[:bucket + 1],
                           q_pos=bufs.view("pos", bucket), kvp_rank=kv.kvp_rank, kvp=kv.kvp,
                           interleave=kv.interleave, page_size=kv.page_size, is_decode=True)
        # every row is its sequence's last token: last=None, no gather
        return e.model(bufs.view("ids", bucket), meta.q_pos, meta, e.caches, e.backend, None, ctx)

    def run(self, ids: torch.Tensor, meta: LocalKVMeta) -> torch.Tensor:
        """One decode step from this rank's host-side metadata -> logits [n, V] (a copy)."""
        n = ids.numel()
        st = {k: v[:n] for k, v in self.staging.items()}
        st["ids"].copy_(ids)
        st["pos"].copy_(meta.q_pos)
        st["slots"].copy_(meta.slots)
        st["kv_lens"].copy_(meta.kv_lens)
        st["block_tables"].zero_()
        st["block_tables"][:, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        logits = self.runner.run(n, st, agree=self.agree, non_blocking=True)
        return logits[:n].clone()

    def close(self) -> None:
        self.runner.close()
