"""A streaming iterator over a synchronous `LLM`: each step's new tokens (and text) per request.

    ids = [llm.add_request(p, params) for p in prompts]
    for d in stream(llm, ids, tokenizer):
        print(d.text, end="", flush=True)       # d.request_id, d.token_ids, d.finish_reason

The caller's thread drives the steps (LLM.step is synchronous); servers use helix.serving's
AsyncLLM instead, which runs the step loop on its own and serves many callers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class Delta:
    """What one request gained in one step."""

    request_id: int
    token_ids: list[int]          # new tokens (one per step; none in the step it fails)
    text: str = ""                # their text ("" without a tokenizer, or while a character
                                  # split across tokens is incomplete)
    finish_reason: str | None = None   # set in the request's last delta
    error: str | None = None      # message of a request that failed (finish reason "error")
    logprobs: list | None = None  # the tokens' TokenLogprob, when the request asked for them


def stream(llm, request_ids: list[int], tokenizer=None,
           on_step: Callable | None = None) -> Iterator[Delta]:
    """Step `llm` until every request in `request_ids` has finished, yielding their deltas in
    step order. Other requests of the LLM advance too (they share the steps). on_step(out) sees
    every StepOutput (timing)."""
    detok = {r: tokenizer.detokenizer() for r in request_ids} if tokenizer else {}
    left = {r for r in request_ids if r not in llm.finish_reasons}
    for r in request_ids:                      # finished before we started: one final delta
        if r not in left:
            yield Delta(r, list(llm.outputs[r]), detok[r].add(llm.outputs[r]) if detok else "",
                        llm.finish_reasons[r], llm.errors.get(r), llm.logprobs.get(r))
    while left:
        out = llm.step()
        if on_step is not None:
            on_step(out)
        for r in [r for r in request_ids if r in left]:
            tok = out.tokens.get(r)
            why = out.finished.get(r)
            if tok is None and why is None:
                continue
            ids = [] if tok is None else [tok] + (out.more or {}).get(r, [])
            text = detok[r].add(ids) if detok and ids else ""
            if why is not None:
                left.discard(r)
            lp = (out.logprobs or {}).get(r)
            lps = [] if lp is None else [lp] + (out.more_logprobs or {}).get(r, [])
            yield Delta(r, ids, text, why, (out.errors or {}).get(r) if why else None,
                        None if r not in llm.logprobs else lps)
