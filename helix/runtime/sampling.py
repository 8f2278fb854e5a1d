"""Sampling parameters of a request, validated when they are made: greedy, temperature, top-k,
top-p, seeded per request, stop ids, teacher forcing, log-probabilities, penalties and logit
bias (helix/runtime/penalties.py), a grammar (helix/runtime/grammar.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from helix.errors import RequestError
from helix.runtime.grammar import check_spec
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


def _bias(v) -> tuple[tuple[int, float], ...]:
    """logit_bias {token id: value} (ids as ints or decimal strings, as JSON sends them), or
    (id, value) pairs -> sorted pairs."""
    items = v.items() if isinstance(v, dict) else v
    try:
        pairs = [(k, b) for k, b in items]
    except (TypeError, ValueError):
        raise RequestError(f"logit_bias must map token ids to values, got {v!r}: e.g. "
                           f"logit_bias={{50256: -100}}") from None
    out = {}
    for k, b in pairs:
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        k = _int("logit_bias key", k, 0)
        b = _float("logit_bias value", b)
        if not -100 <= b <= 100:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {b}")
        out[k] = b
    return tuple(sorted(out.items()))


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
    prompt_logprobs: int | None = None       # k: each prompt token's log-probability given
                                             # the tokens before it, and k alternatives
                                             # (0-20; None: none; position 0 has none)
    repetition_penalty: float = 1.0          # > 0; 1: off. Tokens of the prompt or output
    frequency_penalty: float = 0.0           # [-2, 2]: minus f x the token's output count
    presence_penalty: float = 0.0            # [-2, 2]: minus p if it occurs in the output
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, -100..100) added to its logit
                                             # (a dict is taken too). helix/runtime/penalties.py
    min_tokens: int = 0                      # no eos / stop id before this many tokens
    priority: int = 0                        # lower runs first (scheduling="priority" only; a
                                             # scheduling field that travels with the request)
    grammar: tuple[str, str] | None = None   # structured output: (kind, text), e.g.
                                             # ("json_schema", '{"type": "object"}');
                                             # helix/runtime/grammar.py
    extras: bool = field(default=False, init=False, repr=False, compare=False)
                                             # any of logprobs / prompt_logprobs / penalties /
                                             # logit_bias / min_tokens / grammar set (set, not
                                             # given)

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
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, MAX_LOGPROBS + 1)
        r = _float("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise RequestError(f"repetition_penalty must be > 0 (1: none), got {r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = _float(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {v}")
            object.__setattr__(self, name, v)
        _int("priority", self.priority, -2**31, 2**31)
        if _int("min_tokens", self.min_tokens, 0) > self.max_new_tokens:
            raise RequestError(f"min_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                               f"got {self.min_tokens}")
        object.__setattr__(self, "repetition_penalty", r)
        object.__setattr__(self, "logit_bias", _bias(self.logit_bias))
        object.__setattr__(self, "grammar", check_spec(self.grammar))
        object.__setattr__(self, "extras", self.logprobs is not None or
                           self.prompt_logprobs is not None or self.processed(0))
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "stop_token_ids", _ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "forced_tokens", _ids("forced_tokens", self.forced_tokens))
        if self.grammar is not None and self.forced_tokens:
            raise RequestError("grammar and forced_tokens exclude each other: give one")
        if self.grammar is not None and self.min_tokens:
            raise RequestError("grammar and min_tokens exclude each other (the grammar decides "
                               "where the output ends): give one")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processed(self, produced: int) -> bool:
        """Whether its logits are processed before its next token is chosen (penalties.py),
        `produced` tokens into its output."""
        return bool(self.repetition_penalty != 1 or self.frequency_penalty or
                    self.presence_penalty or self.logit_bias or produced < self.min_tokens
                    or self.grammar is not None)

    def check_vocab(self, vocab: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("forced_tokens", self.forced_tokens),
                          ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = [t for t in ids if t >= vocab]
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
