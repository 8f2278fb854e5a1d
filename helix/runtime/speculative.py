"""Speculative decoding by n-gram lookup (RuntimeConfig.speculative_tokens; vLLM's "ngram",
a.k.a. prompt lookup): a request's next tokens are guessed from its own tokens, where the
longest suffix of up to `ngram` tokens occurred before, the tokens that followed it then; one
step feeds the last token and the guesses (a chunk, attended causally like a prompt's), every
row of it chooses a token as a decode row would, and each guess is kept while the token chosen
at the row before equals it, then that row's token is added. The tokens are exactly the ones
one-token steps give: a row's choice is the argmax, or a draw that is a function of its logits,
the request's seed and the position (Gumbel noise hashed from them, sampling_ops.py), and each
kept row's logits follow the same tokens as they would one step at a time (exactly in fp32; in
bf16 a chunk's kernels round differently from the decode kernel's, so a near-tie may differ).
Sampled requests (temperature, top-k, top-p) speculate too, with the same tokens as without; a
step emits 1 to k + 1 of them for the KV read of one.

Long contexts where the output quotes or edits its input (summaries, code changes, retrieval
answers, structured extraction) repeat n-grams of the prompt. A step at long context is
bound by reading the KV, which the prefill kernel reads once for a sequence's few query rows,
so rows that verify guesses should cost little more than the one row they ride with
(profiling/bench_speculative.py measures both ends: every guess kept, every guess rejected).

Drafting runs in the replicated scheduler (the same guesses on every rank), from an index per
request of where each n-gram (n = 1 .. ngram) last ended, extended as tokens arrive by at most
INDEX_BUDGET positions a draft (a 128K-token prompt is indexed over its first 32 decode steps,
~0.2 s of host time in all on this project's CPU machine, not in one step that would stall
every request's next token; meanwhile its drafts search the part indexed): a draft is then
O(ngram + k). The index holds a dict entry per position and n (tens of MB of host memory for
a 128K-token request)."""

from __future__ import annotations

from helix.runtime.request import Request

INDEX_BUDGET = 4096          # positions a draft may add to a request's index


def speculates(r: Request) -> bool:
    """Whether a request's steps may verify guesses: any but one with forced tokens. A row's
    penalties, bias and min_tokens count the guesses before it as output, its grammar's mask
    is the one after them (Engine._launch, _grammar_masks), its logprobs are read per row."""
    return not r.params.forced_tokens


class NgramIndex:
    """Where each n-gram of a sequence (n = 1 .. ngram) last ended, over positions before its
    last one (the last n-gram is the one looked up). The sequence is read through
    get(a, b) -> its tokens [a, b) (no copy of a long prompt per step)."""

    def __init__(self, ngram: int):
        self.ngram = ngram
        self.last: list[dict[tuple, int]] = [{} for _ in range(ngram + 1)]
        self.done = 0                # n-grams ending at positions < done are indexed

    def extend(self, get, length: int, budget: int | None = None) -> None:
        """Index the n-grams ending before position length - 1 not indexed yet (at most
        `budget` positions of them, the earliest)."""
        end = length - 1 if budget is None else min(length - 1, self.done + budget)
        if self.done >= end:
            return
        lo = max(0, self.done - self.ngram + 1)
        seg = get(lo, end)
        for p in range(self.done, end):
            i = p - lo
            for n in range(1, min(self.ngram, p + 1) + 1):
                self.last[n][tuple(seg[i - n + 1:i + 1])] = p
        self.done = end

    def draft(self, get, length: int, k: int, budget: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix (at
        most ngram long) that occurred before (among the positions indexed, after indexing at
        most `budget` more); [] when none did."""
        self.extend(get, length, budget)
        tail = get(max(0, length - self.ngram), length)
        for n in range(len(tail), 0, -1):
            end = self.last[n].get(tuple(tail[-n:]))
            if end is not None:
                return get(end + 1, min(end + 1 + k, length))
        return []


class Drafter:
    """The n-gram drafts of the running requests (one index each, dropped when they end)."""

    def __init__(self, k: int, ngram: int):
        self.k, self.ngram = k, ngram
        self.index: dict[int, NgramIndex] = {}

    def draft(self, r: Request) -> list[int]:
        """Guesses for r's next tokens: at most k, and no more than it may still generate
        besides the token the step adds itself (max_new_tokens, max_len); none while a token
        of it is still on the device."""
        room = min(self.k, r.params.max_new_tokens - len(r.output) - 1,
                   r.max_len - r.num_tokens - 1)
        if room <= 0 or r.pending or not r.output or not speculates(r):
            return []
        return self.guess(r, room)

    def guess(self, r: Request, room: int) -> list[int]:
        """At most `room` guesses for r (its n-gram lookup; benchmarks substitute others)."""
        index = self.index.get(r.id)
        if index is None:
            index = self.index[r.id] = NgramIndex(self.ngram)
        return index.draft(lambda a, b: r.tokens(r.prefix + a, r.prefix + b),
                           len(r.prompt) + len(r.output), room, INDEX_BUDGET)

    def drop(self, req_id: int) -> None:
        self.index.pop(req_id, None)
