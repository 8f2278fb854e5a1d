"""Sampling parameters and the sampler's entry point: greedy, temperature, top-k, top-p, seeded per
request. Every rank holds the same full logits and draws with the same (seed, position)-keyed
noise (helix/runtime/sampler.py), so every rank gets the same token with no extra collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helix.errors import RequestError
from helix.runtime.sampler import sample_rows


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


def row_params(params: list[SamplingParams], seeds: list[int], counters: list[int]
               ) -> dict[str, torch.Tensor]:
    """The sampler's per-row inputs as host tensors: temperature and top_p (fp32), top_k,
    seed and counter (int64)."""
    return {"temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
            "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
            "seed": torch.tensor(seeds, dtype=torch.int64),
            "counter": torch.tensor(counters, dtype=torch.int64)}


def sample_into(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                counters: list[int], out: torch.Tensor, greedy_done: bool = False) -> None:
    """logits [S, V] -> one token id per row, written into out[:S] (int64, logits' device) with
    no host sync. Greedy rows take the argmax; the others draw from the batched sampler
    (helix/runtime/sampler.py) with noise keyed by (seed, counter): pass the position of the
    token being sampled as its counter. greedy_done: out already holds the argmax."""
    if not greedy_done:
        torch.argmax(logits, -1, out=out[:logits.shape[0]])
    if all(p.greedy for p in params):
        return
    host = row_params(params, seeds, counters)
    pin = logits.is_cuda
    dev = {k: (v.pin_memory() if pin else v).to(logits.device, non_blocking=pin)
           for k, v in host.items()}
    sample_rows(logits, dev["temperature"], dev["top_k"], dev["top_p"], dev["seed"],
                dev["counter"], out)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           counters: list[int]) -> list[int]:
    """logits [S, V] -> one token id per row (a host list)."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    sample_into(logits, params, seeds, counters, out)
    return out.tolist()
