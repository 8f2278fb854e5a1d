"""Logits processing of rows that ask for it: logit_bias, then the repetition, frequency and
presence penalties (vLLM's rules, in vLLM's order), and min_tokens (a row's stop ids at -inf
until it has produced that many tokens), before temperature, top-k and top-p.

    x = logits + bias                                  (logit_bias: per token id, -100..100)
    seen = the token is in the prompt or the output so far
    x = x / r where x > 0, x * r where x <= 0, for seen tokens   (repetition_penalty r, 1: off)
    x = x - f * count - p * (count > 0)   count: the token's occurrences in the output so far
                                        (frequency_penalty f, presence_penalty p, in [-2, 2])

The row's token is then the argmax of x (greedy) or a draw from x's filtered softmax (the same
Gumbel noise as an unprocessed row: the draw depends on the seed and the position only).
Rows that set none of these are not touched, and a step without such rows does nothing more.

The history a row needs: its output tokens the host knows, plus the one the device sampled in
the step before and the host has not read back yet (overlapped steps: that row's input token);
the prompt's tokens as a vocabulary mask and the logit_bias as a dense row, made once per
request (a long prompt or a large bias is not uploaded every step). Host tensors go up
asynchronously (`upload`): a step with such rows does not wait for the one before it.
"""

from __future__ import annotations

import torch

from helix.kv.manager import upload


def output_counts(known: list[list[int]], pending: torch.Tensor, vocab: int) -> torch.Tensor:
    """Occurrences of each token in each row's output [m, V] fp32: known[i] (host) and
    pending[i] (device int64, -1: none)."""
    m, width = len(known), max((len(k) for k in known), default=0) + 1
    hist = torch.full((m, width), vocab, dtype=torch.long)
    for i, k in enumerate(known):
        hist[i, :len(k)] = torch.tensor(k, dtype=torch.long)
    hist = upload(hist, pending.device)
    hist[:, -1] = torch.where(pending >= 0, pending, vocab)
    counts = torch.zeros(m, vocab + 1, dtype=torch.float32, device=pending.device)
    counts.scatter_add_(1, hist, torch.ones_like(hist, dtype=torch.float32))
    return counts[:, :vocab]


def request_rows(prompt: list[int], params, vocab: int, device) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """A processed request's per-vocabulary rows, made once: its prompt's tokens [V] bool (for a
    repetition penalty; none without one) and its logit_bias [V] fp32."""
    seen = torch.zeros(vocab, dtype=torch.bool)
    if params.repetition_penalty != 1:
        seen[torch.tensor(prompt, dtype=torch.long)] = True
    bias = torch.zeros(vocab, dtype=torch.float32)
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        bias[torch.tensor(ids, dtype=torch.long)] = torch.tensor(values, dtype=torch.float32)
    return upload(seen, device), upload(bias, device)


def apply(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
          bias: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
          presence: torch.Tensor, suppress: list[tuple[int, ...]]) -> torch.Tensor:
    """logits [m, V] -> processed fp32 logits [m, V]. counts: output_counts; prompt_seen [m, V]
    bool and bias [m, V] fp32 (request_rows); repetition / frequency / presence [m] fp32 on
    logits' device; suppress: per row the ids it must not produce (min_tokens: its stop ids),
    set to -inf last."""
    x = logits.float() + bias
    r = repetition[:, None]
    seen = (prompt_seen | (counts > 0)) & (r != 1)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
    rows = [i for i, ids in enumerate(suppress) for _ in ids]
    if rows:
        ids = [t for s in suppress for t in s]
        x[upload(torch.tensor(rows), x.device), upload(torch.tensor(ids), x.device)] = -torch.inf
    return x
