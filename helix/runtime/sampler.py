"""The sampler: it owns the device token buffer that a step's sampled tokens land in, in the
graph path and the eager path alike, and the host buffers they are read back through.

    tokens [rows] int64 on the device: row i = the i-th sampled row of the last step
    greedy(logits)           argmax of every row (the one place it is written; capturable)
    sample_rows(logits, p)   temperature / top-k / top-p rows overwrite their greedy token
    select(src, ids)         a step's input ids: ids, or tokens[src] where src >= 0 (a token
                             still on the device from the step before: no host round trip)
    readback(n)              queue tokens[:n] into a host buffer; wait on the returned event

Randomness is counter based (helix/runtime/sampling_ops.py): a row's draw depends only on its
request's seed and the position sampled, not on the batch, the bucket, overlap or the rank.
"""

from __future__ import annotations

import torch

from helix.layers.fused_ops import select_tokens
from helix.runtime.sampling import SamplingParams, row_params
from helix.runtime.sampling_ops import greedy_argmax, sample_rows


class Sampler:
    def __init__(self, rows: int, device: torch.device):
        self.device = device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        # two alternating host buffers: with overlap, step N + 1's copy must not land in the
        # buffer step N's tokens are still being read from
        self._host = [torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._flip = 0

    def greedy(self, logits: torch.Tensor) -> None:
        """logits [S, V] -> tokens[:S] = argmax per row (no host sync)."""
        greedy_argmax(logits, self.tokens)

    def sample_rows(self, logits: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Rows with temperature > 0 draw from their filtered distribution; the others keep the
        greedy token. rows: row_params' tensors on the device (static buffers under graphs)."""
        sample_rows(logits, rows["temperature"], rows["top_k"], rows["top_p"], rows["seed"],
                    rows["counter"], self.tokens)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               counters: list[int]) -> None:
        """Eager path: greedy, then the sampled rows (their parameters uploaded asynchronously).
        counters: the position of the token each row samples."""
        self.greedy(logits)
        if all(p.greedy for p in params):
            return
        pin = logits.is_cuda
        rows = {k: (v.pin_memory() if pin else v).to(logits.device, non_blocking=pin)
                for k, v in row_params(params, seeds, counters).items()}
        self.sample_rows(logits, rows)

    def select(self, src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return select_tokens(src, ids, self.tokens)

    def readback(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue a copy of tokens[:n] to the host: (host buffer, event to wait on, or None when
        the copy is already done)."""
        host = self._host[self._flip]
        self._flip ^= 1
        host[:n].copy_(self.tokens[:n], non_blocking=self.device.type == "cuda")
        if self.device.type != "cuda":
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event
