"""The sampler: it owns the device token buffer that a step's sampled tokens land in, in the
graph path and the eager path alike, and the host buffers they are read back through.

    tokens [rows] int64 on the device: row i = the i-th sampled row of the last step
    greedy(logits)           argmax of every row (the one place it is written; capturable)
    sample_rows(logits, p)   temperature / top-k / top-p rows overwrite their greedy token
    select(src, ids)         a step's input ids: ids, or tokens[src] where src >= 0 (a token
                             still on the device from the step before: no host round trip)
    process_rows(logits, rows, ...)  rows with penalties / logit_bias: their token again, from
                             their processed logits (penalties.py)
    logprobs(logits, k, forced)  the rows' tokens' log-probabilities and top k (logprobs.py),
                             into device buffers made on first use
    readback(n, k)           queue tokens[:n] (and, k not None, their log-probabilities) into
                             host buffers; wait on the returned event

Randomness is counter based (helix/runtime/sampling_ops.py): a row's draw depends only on its
request's seed and the position sampled, not on the batch, the bucket, overlap or the rank.
"""

from __future__ import annotations

import torch

from helix.kv.manager import upload
from helix.layers.fused_ops import select_tokens
from helix.runtime import penalties
from helix.runtime.logprobs import MAX_LOGPROBS, token_logprobs
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
        self._lp = self._lp_host = None     # log-probability buffers (_buffers), made on first use

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
        if not all(p.greedy for p in params):
            self.sample_rows(logits, self._row_params(params, seeds, counters))

    def _row_params(self, params: list[SamplingParams], seeds: list[int],
                    counters: list[int]) -> dict[str, torch.Tensor]:
        """row_params' tensors uploaded asynchronously."""
        return {k: upload(v, self.device) for k, v in row_params(params, seeds, counters).items()}

    def select(self, src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return select_tokens(src, ids, self.tokens)

    def process_rows(self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     outputs: list[list[int]], pending: torch.Tensor,
                     vocab_rows: tuple[torch.Tensor, torch.Tensor], seeds: list[int],
                     counters: list[int], suppress: list[tuple[int, ...]],
                     allowed: torch.Tensor | None = None) -> None:
        """After the step's tokens are in: rows `rows` of logits [n, V] (their params, output
        tokens the host knows, pending [m] the device token not read back yet or -1,
        vocab_rows their prompt masks and biases [m, V] (penalties.request_rows), the ids each
        must not produce now, and allowed [m, V] bool: the ids their grammars allow, or None)
        get their token again from their processed logits: the argmax, or the same seeded draw
        as an unprocessed row. No host sync."""
        dev = logits.device

        def col(name):
            return upload(torch.tensor([getattr(p, name) for p in params], dtype=torch.float32),
                          dev)
        rows_t = upload(torch.tensor(rows, dtype=torch.long), dev)
        counts = penalties.output_counts(outputs, pending, logits.shape[1])
        x = penalties.apply(logits.index_select(0, rows_t), counts, *vocab_rows,
                            col("repetition_penalty"), col("frequency_penalty"),
                            col("presence_penalty"), suppress)
        if allowed is not None:
            x = x.masked_fill(~allowed, -torch.inf)
        out = x.argmax(-1)
        if not all(p.greedy for p in params):
            r = self._row_params(params, seeds, counters)
            sample_rows(x, r["temperature"], r["top_k"], r["top_p"], r["seed"], r["counter"],
                        out)
        self.tokens.index_copy_(0, rows_t, out)

    def _buffers(self, device_side: bool) -> tuple:
        """(lp [rows], top_lp [rows * MAX], top_ids [rows * MAX]) on the device, or the two host
        copies. A step's top k entries are the first n * k of the flat buffers (contiguous, so
        its device-to-host copies are single asynchronous copies)."""
        if self._lp is None:
            rows, pin = len(self.tokens), self.device.type == "cuda"

            def bufs(device, pin=False):
                return (torch.zeros(rows, dtype=torch.float32, device=device, pin_memory=pin),
                        torch.zeros(rows * MAX_LOGPROBS, dtype=torch.float32, device=device,
                                    pin_memory=pin),
                        torch.zeros(rows * MAX_LOGPROBS, dtype=torch.long, device=device,
                                    pin_memory=pin))
            self._lp = bufs(self.device)
            self._lp_host = [bufs("cpu", pin) for _ in range(2)]
        return self._lp if device_side else self._lp_host

    @staticmethod
    def _views(bufs: tuple, n: int, k: int) -> tuple:
        lp, top_lp, top_ids = bufs
        return lp[:n], top_lp[:n * k].view(n, k), top_ids[:n * k].view(n, k)

    def logprobs(self, logits: torch.Tensor, k: int, forced: torch.Tensor | None = None) -> None:
        """After the step's tokens are in: rows [:n] of logits [n, V] -> the log-probability of
        each row's token (forced[i] >= 0: that id instead of the sampled one) and its k most
        likely entries, into the device buffers readback(n, k) copies. No host sync."""
        n = logits.shape[0]
        tokens = self.tokens[:n] if forced is None else torch.where(forced >= 0, forced,
                                                                     self.tokens[:n])
        for dst, src in zip(self._views(self._buffers(device_side=True), n, k),
                            token_logprobs(logits, tokens, k)):
            dst.copy_(src)

    def readback(self, n: int, k: int | None = None
                 ) -> tuple[torch.Tensor, torch.cuda.Event | None, tuple | None]:
        """Queue a copy of tokens[:n] to the host, and with k not None of their log-probabilities
        and top k (logprobs() ran for the step): (host tokens, event to wait on or None when the
        copies are done, None or host (lp [n], top_lp [n, k], top_ids [n, k]))."""
        cuda = self.device.type == "cuda"
        host = self._host[self._flip]
        host[:n].copy_(self.tokens[:n], non_blocking=cuda)
        lps = None
        if k is not None:
            lps = self._views(self._buffers(device_side=False)[self._flip], n, k)
            for h, d in zip(lps, self._views(self._buffers(device_side=True), n, k)):
                h.copy_(d, non_blocking=cuda)
        self._flip ^= 1
        if not cuda:
            return host, None, lps
        event = torch.cuda.Event()
        event.record()
        return host, event, lps
