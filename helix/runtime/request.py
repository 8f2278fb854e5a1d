"""A request's state: its prompt, what it has generated, how much of it the KV cache holds, and
why it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from helix.runtime.sampling import SamplingParams


@dataclass(eq=False)       # identity: the scheduler's `in` tests must not compare fields
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_len: int                              # prompt + generation cap (max context)
    prefix: int = 0                           # positions of arbitrary KV before the prompt
                                              # (benchmarking long contexts without prefill)
    output: list[int] = field(default_factory=list)   # tokens read back from the device
    finish_reason: str | None = None          # length | stop | abort | error
    error: str | None = None                  # the message of a failed request
    pending: int = 0                          # tokens sampled on the device, not read back yet
                                              # (overlapped steps: at most 2, transiently)
    pending_row: int = -1                     # row of the newest pending token in the sampler's
                                              # token buffer (valid until the next step)
    computed: int = 0                         # positions whose KV is written (or queued to be)
    admitted: int = -1                        # admission order (preemption takes the newest)
    preemptions: int = 0                      # times its KV was dropped to make room
    skipped: int = 0                          # times a later request was admitted before it
    imported_kv: object = None                # KV of the prompt from a prefill server, if any
    prompt_scored: int = 1                    # prompt positions whose log-probability is
                                              # computed (or queued), when it asks for them
    cached: int = 0                           # prompt positions its first admission found in
                                              # the prefix cache (not prefilled)
    imported: bool = False                    # its prompt's KV came from a prefill server

    def __post_init__(self):
        self.computed = self.prefix            # a synthetic prefix counts as written

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Positions fed or sampled so far, pending tokens included."""
        return self.prefix + len(self.prompt) + len(self.output) + self.pending

    @property
    def known(self) -> int:
        """Positions whose token the host knows (prefix, prompt, output read back)."""
        return self.prefix + len(self.prompt) + len(self.output)

    @property
    def prefill_end(self) -> int:
        """Positions that must be in the KV cache before it decodes: all it knows, but for a
        request that has generated (a preempted one, recomputing) the last token, which its next
        decode row feeds."""
        return self.known - (1 if self.output else 0)

    @property
    def prefilling(self) -> bool:
        """Its KV cache lacks positions it knows (a new or preempted request, or a prompt in
        chunks): the next rows it runs are a prefill chunk, not a decode row."""
        return self.computed < self.prefill_end

    @property
    def exhausted(self) -> bool:
        """Its last token is already sampled (pending): scheduling it again would overrun."""
        return (len(self.output) + self.pending >= self.params.max_new_tokens
                or self.num_tokens >= self.max_len)

    @property
    def shares_kv(self) -> bool:
        """Its KV may come from, and go into, the prefix cache: KV computed here for its own
        tokens (not a synthetic prefix, not an import)."""
        return not self.prefix and not self.imported

    @property
    def cache_limit(self) -> int:
        """The most leading positions a prefix-cache hit may cover: all it prefills, but for a
        new request's last prompt token, whose row yields its first generated token."""
        return self.prefill_end - (0 if self.output else 1)

    def tokens(self, a: int, b: int) -> list[int]:
        """The tokens at positions [a, b) (a >= prefix; prompt and output, not copied whole)."""
        a, b, n = a - self.prefix, b - self.prefix, len(self.prompt)
        if b <= n:
            return self.prompt[a:b]
        if a >= n:
            return self.output[a - n:b - n]
        return self.prompt[a:] + self.output[:b - n]

    def chunk(self, n: int) -> tuple[int, list[int], bool]:
        """(start, ids, samples) of the next prefill chunk of at most n tokens; samples: the chunk
        ends a new request's prompt, so its last row yields the first generated token."""
        start = self.computed
        end = min(start + n, self.prefill_end)
        return start, self.tokens(start, end), (
            end == self.prefill_end and not self.output)

    def decode_input(self) -> tuple[int, int, int]:
        """(position, token id, src row) of the next decode row. src row >= 0: the token is still
        on the device, in that row of the sampler's token buffer (the id is a placeholder); -1:
        the id is the token. A pending token that the sampling params force is known already."""
        pos = self.num_tokens - 1
        if not self.pending:
            return pos, self.output[-1], -1
        k, forced = len(self.output) + self.pending - 1, self.params.forced_tokens
        if k < len(forced):
            return pos, forced[k], -1
        return pos, 0, self.pending_row

    def attach_kv(self, kv, length: int) -> None:
        """Positions [0, length) of its prompt arrive as KV from a prefill server (written into
        its pages when its first chunk is planned) instead of being prefilled."""
        self.imported_kv, self.computed, self.imported = kv, length, True

    def reset_kv(self) -> None:
        """Its KV was dropped (preempted): everything it knows is prefilled again on resume (an
        import included: it was written once, its positions are recomputed)."""
        self.computed = self.prefix
        self.imported_kv = None
        self.preemptions += 1
