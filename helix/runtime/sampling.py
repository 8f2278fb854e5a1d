"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request.
Every rank holds the same full logits and the same generator state, so every rank draws the
same token with no extra collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helix.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16                 # tokens to generate (fewer if a stop id comes)
    temperature: float = 0.0                 # 0 = greedy
    top_k: int = 0                           # keep the k most likely tokens (0 = all)
    top_p: float = 1.0                       # keep the smallest set with this probability mass
    seed: int | None = None                  # per-request seed (None: derived from the request id)
    stop_token_ids: tuple[int, ...] = ()     # extra ids that end the request
    ignore_eos: bool = False                 # do not stop at the model's eos ids
    forced_tokens: tuple[int, ...] = ()      # emit these instead of sampling (teacher forcing:
                                             # logits of a given continuation, parity runs)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with filtered entries at -inf."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample_into(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], out: torch.Tensor,
                greedy_done: bool = False) -> None:
    """logits [S, V] fp32 -> one token id per row, written into out[:S] (int64, logits' device)
    with no host sync. greedy_done: out already holds the argmax (e.g. from a CUDA graph)."""
    if not greedy_done:
        torch.argmax(logits, -1, out=out[:logits.shape[0]])
    for i, p in enumerate(params):
        if not p.greedy:
            probs = filter_logits(logits[i], p).softmax(-1)
            out[i:i + 1].copy_(torch.multinomial(probs, 1, generator=generators[i]))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [S, V] fp32 -> one token id per row (a host list)."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    sample_into(logits, params, generators, out)
    return out.tolist()
