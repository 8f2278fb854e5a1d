"""Log-probabilities of generated tokens: what a request with `SamplingParams(logprobs=k)` gets
next to each token (evaluations, RL, confidence), computed on the device from the step's logits
with no host sync and read back with the tokens.

A token's log-probability is under the model's own distribution: log_softmax of its logits in
fp32, before temperature, top-k and top-p (what a sampled row was drawn from is a filtered
version of it; the model's distribution is the one an evaluation scores). The k alternatives
are the k most likely tokens under it, most likely first. A forced
token (teacher forcing, `forced_tokens`) gets the log-probability of the forced id: the
log-likelihood of a given continuation.

    token_logprobs(logits [n, V], tokens [n], k) -> (lp [n], top_lp [n, k], top_ids [n, k])
    score_prompts(plan, head, h, residual, device)   a prefill step's prompt scores, queued
    from_host(lp, top_lp, top_ids)                   -> [TokenLogprob], once read back

A prompt's scores (`SamplingParams.prompt_logprobs`): the row of position p of a prefill chunk
scores prompt[p + 1] (a chunk's last row scores the next chunk's first token; the prompt's last
row is the sampled row, whose token has its own logprobs). Rows go through the LM head
PROMPT_ROWS at a time (their fp32 logits), only positions not scored before: a preempted
request's recompute does not score twice (`Request.prompt_scored`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helix.kv.manager import upload

MAX_LOGPROBS = 20            # alternatives a request may ask for (OpenAI's top_logprobs bound)
PROMPT_ROWS = 256            # prompt rows scored through the LM head at once (fp32 logits:
                             # 128 MB at a 128K vocabulary, twice with the log-softmax)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its step's most likely alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] (any float dtype), tokens [n] int64 -> the tokens' log-probabilities [n]
    fp32 and the k most likely entries of each row (log-probabilities [n, k] fp32, ids [n, k]
    int64). Capturable: no host sync."""
    ls = torch.log_softmax(logits.float(), dim=-1)
    lp = ls.gather(1, tokens[:, None].long())[:, 0]
    if k == 0:
        return lp, ls.new_empty(len(lp), 0), tokens.new_empty(len(lp), 0, dtype=torch.int64)
    top_lp, top_ids = torch.topk(ls, k, dim=-1, sorted=True)
    return lp, top_lp, top_ids


def from_host(lp: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor
              ) -> list[TokenLogprob]:
    """Host tensors (lp [n], top_lp [n, k], top_ids [n, k]) -> one TokenLogprob per row."""
    return [TokenLogprob(a, tuple(zip(i, b)))
            for a, b, i in zip(lp.tolist(), top_lp.tolist(), top_ids.tolist())]


def score_prompts(plan, head, h, residual, device) -> list | None:
    """A prefill step's prompt rows of requests that ask (plan: the scheduler's StepPlan, its
    decode rows first; head(h, residual, rows) -> logits) -> [(request, host (lp, top_lp,
    top_ids))] with their copies queued (the step's readback event covers them), or None."""
    out, row = [], len(plan.decode)
    for c in plan.prefill:
        r, n, k = c.req, len(c.ids), c.req.params.prompt_logprobs
        first, end = max(c.start, r.prompt_scored - 1), min(c.start + n, len(r.prompt) - 1)
        if k is not None and first < end:              # positions first .. end - 1 score
            out.append((r, _score_rows(head, h, residual, row + first - c.start,
                                       r.prompt[first + 1:end + 1], k, device)))
            r.prompt_scored = end + 1
        row += n
    return out or None


def _score_rows(head, h, residual, row: int, targets: list[int], k: int, device) -> list:
    """Step rows row, row + 1, ... scored against `targets` -> host (lp, top_lp, top_ids)."""
    parts = []
    for i in range(0, len(targets), PROMPT_ROWS):
        rows = torch.arange(row + i, row + min(i + PROMPT_ROWS, len(targets)))
        want = torch.tensor(targets[i:i + PROMPT_ROWS], dtype=torch.long)
        parts.append(token_logprobs(head(h, residual, upload(rows, device)),
                                    upload(want, device), k))
    cuda, host = torch.device(device).type == "cuda", []
    for t in (torch.cat(x) for x in zip(*parts)):
        host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda))
        host[-1].copy_(t, non_blocking=cuda)
    return host
