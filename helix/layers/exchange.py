"""The Helix exchange: ONE all-to-all over the KVP group carrying packed (O, LSE) partials, then
the exact log-sum-exp merge. Input: this rank's partial over its local KV for all its H/TP_A
heads; output: the exact attention of its H/N heads (chunk kvp_rank of the head slice)."""

from __future__ import annotations

import torch
from torch import nn

from helix.parallel.comm import Comm
from helix.tracing import phase


class KVPExchange(nn.Module):
    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm
        self.kvp = comm.size("kvp")

    def forward(self, o: torch.Tensor, lse: torch.Tensor, backend) -> torch.Tensor:
        """o [T, H/tpa, d], lse [T, H/tpa] fp32 -> o [T, H/N, d]."""
        if self.kvp == 1:
            return o
        with phase("a2a"):
            send = backend.pack_partials(o, lse, self.kvp)    # [kvp, T, H/N, d + c]
            recv = self.comm.all_to_all(send, "kvp")          # chunk i: rank i's partial of
                                                              # my heads
        with phase("merge"):
            return backend.merge_received(recv, o.shape[-1])
