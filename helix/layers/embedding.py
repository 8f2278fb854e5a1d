"""Vocab-parallel embedding and LM head over all N ranks.

Rank r holds vocab rows [r*s, (r+1)*s), s = ceil(V / N); rows past V are zero padding, so any V
works. Embedding: look up local ids, zero the rest, all-reduce. LM head: local logits, all-gather,
drop the padding -> full [T, V] logits on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helix.layers.weights import sliced_loader
from helix.parallel.comm import Comm


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, comm: Comm, dtype=torch.float32):
        super().__init__()
        n, r = comm.size("world"), comm.mesh.rank
        self.vocab, self.shard = vocab, -(-vocab // n)
        self.start = r * self.shard
        self.weight = nn.Parameter(torch.zeros((self.shard, dim), dtype=dtype), requires_grad=False)
        self.weight.weight_loader = sliced_loader((vocab, dim), 0, self.start,
                                                  self.start + self.shard)
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> h [T, D], replicated."""
        if self.shard >= self.vocab:           # one rank holds the whole vocabulary
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        h = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        h = h * inside.unsqueeze(-1).to(h.dtype)
        return self.comm.all_reduce(h, "world")


class ParallelLMHead(nn.Module):
    def __init__(self, vocab: int, dim: int, comm: Comm, dtype=torch.float32,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        n, r = comm.size("world"), comm.mesh.rank
        self.vocab, self.shard = vocab, -(-vocab // n)
        self.tied = tied
        if tied is None:
            self.weight = nn.Parameter(torch.zeros((self.shard, dim), dtype=dtype),
                                       requires_grad=False)
            self.weight.weight_loader = sliced_loader((vocab, dim), 0, r * self.shard,
                                                      (r + 1) * self.shard)
        self.comm = comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [S, D] -> logits [S, V] fp32, identical on every rank."""
        w = self.tied.weight if self.tied is not None else self.weight
        local = F.linear(h, w).float()                       # [S, shard]
        if self.shard >= self.vocab:
            return local[:, :self.vocab]
        full = self.comm.all_gather(local, "world")          # [N, S, shard]
        S = h.shape[0]
        return full.permute(1, 0, 2).reshape(S, full.shape[0] * self.shard)[:, :self.vocab]
