"""Sampling parameters of a request, validated when they are made: greedy, temperature, top-k,
top-p, seeded per request, stop ids, teacher forcing, log-probabilities."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from helix.errors import RequestError
from helix.runtime.logprobs import MAX_LOGPROBS

SEED_LIMIT = 2**63            # seeds are hashed as signed 64-bit integers
TOP_K_LIMIT = 2**31


def _int(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v >= hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise RequestError(f"{name} must be {bound}, got {v}")
    return v


def _float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _ids(name: str, v) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise RequestError(f"{name} must be a list of token ids, got {v!r}: e.g. {name}=[2]")
    return tuple(_int(f"{name} entry", t, 0) for t in v)


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
    logprobs: int | None = None              # k: each token's log-probability under the model
                                             # and its k most likely alternatives (0-20;
                                             # None: none). helix/runtime/logprobs.py

    def __post_init__(self):
        _int("max_new_tokens", self.max_new_tokens, 1)
        t = _float("temperature", self.temperature)
        if t < 0:
            raise RequestError(f"temperature must be >= 0 (0: greedy), got {t}")
        _int("top_k", self.top_k, 0, TOP_K_LIMIT)
        p = _float("top_p", self.top_p)
        if not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {p}")
        if self.seed is not None:
            _int("seed", self.seed, 0, SEED_LIMIT)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "stop_token_ids", _ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "forced_tokens", _ids("forced_tokens", self.forced_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for name in ("stop_token_ids", "forced_tokens"):
            bad = [t for t in getattr(self, name) if t >= vocab]
            if bad:
                raise RequestError(f"{name} holds {bad[0]}, outside the vocabulary [0, {vocab})")


def row_params(params: list[SamplingParams], seeds: list[int], counters: list[int]
               ) -> dict[str, torch.Tensor]:
    """The sampler's per-row inputs as host tensors: temperature and top_p (fp32), top_k,
    seed and counter (int64)."""
    return {"temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
            "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
            "seed": torch.tensor(seeds, dtype=torch.int64),
            "counter": torch.tensor(counters, dtype=torch.int64)}
