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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20            # alternatives a request may ask for (OpenAI's top_logprobs bound)


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
