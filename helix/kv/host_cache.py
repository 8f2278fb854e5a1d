"""The prefix cache's host tier on one rank: slots of host memory, each holding one block's KV
(its `block_pages` pages of every layer's cache tensors), pinned on CUDA so the copies run
asynchronously on the step's stream (helix/kv/prefix_cache.py decides; KVManager.apply_ops
calls offload / load in the order of its ops, before the step that reads the pages)."""

from __future__ import annotations

import torch

from helix.errors import ConfigError
from helix.kv.quant import as_bytes


class HostCache:
    def __init__(self, caches: list[list[torch.Tensor]], slots: int, block_pages: int):
        # fp8 caches as bytes (torch has no CPU index_copy_ for fp8)
        caches = [[as_bytes(c) for c in layer] for layer in caches]
        self.caches, self.block_pages = caches, block_pages
        pin = caches[0][0].device.type == "cuda"
        n = slots * block_pages
        try:
            self.store = [[torch.empty((n, *c.shape[1:]), dtype=c.dtype, pin_memory=pin)
                           for c in layer] for layer in caches]
        except RuntimeError as e:             # pinned (or plain) host memory refused
            gib = n * sum(c[0].numel() * c.element_size() for layer in caches for c in layer)
            raise ConfigError(f"the host cache's {gib / 2**30:.1f} GiB of "
                              f"{'pinned ' if pin else ''}host memory could not be allocated "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                              f"lower --host-cache-gb") from None

    @staticmethod
    def slots_for(gb: float, block_pages: int, page_bytes: int) -> int:
        """Slots that fit `gb` GiB of host memory (page_bytes: one page of every layer)."""
        return int(gb * 2**30) // (block_pages * page_bytes)

    def _rows(self, slot: int) -> slice:
        return slice(slot * self.block_pages, (slot + 1) * self.block_pages)

    def offload(self, pages: list[int], slot: int) -> None:
        """The block's pages -> host slot `slot` (queued; the pages may be taken after)."""
        rows = self._rows(slot)
        idx = torch.tensor(pages, dtype=torch.long).to(self.caches[0][0].device)
        for layer, host in zip(self.caches, self.store):
            for c, h in zip(layer, host):
                h[rows].copy_(c.index_select(0, idx), non_blocking=True)

    def load(self, slot: int, pages: list[int]) -> None:
        """Host slot `slot` -> the block's new pages (queued before the step that reads them)."""
        rows = self._rows(slot)
        device = self.caches[0][0].device
        idx = torch.tensor(pages, dtype=torch.long).to(device)
        for layer, host in zip(self.caches, self.store):
            for c, h in zip(layer, host):
                c.index_copy_(0, idx, h[rows].to(device, non_blocking=True))
