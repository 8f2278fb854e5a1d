"""A request's state: its prompt, what it has generated, and why it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from helix.runtime.sampling import SamplingParams


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_len: int                              # prompt + generation cap (max context)
    prefix: int = 0                           # positions of arbitrary KV before the prompt
                                              # (benchmarking long contexts without prefill)
    output: list[int] = field(default_factory=list)   # tokens read back from the device
    finish_reason: str | None = None          # length | stop | abort
    pending: int = 0                          # tokens sampled on the device, not read back yet
                                              # (overlapped steps: at most 2, transiently)
    pending_row: int = -1                     # row of the newest pending token in the engine's
                                              # token buffer (valid until the next step)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Positions fed or sampled so far, pending tokens included."""
        return self.prefix + len(self.prompt) + len(self.output) + self.pending

    @property
    def exhausted(self) -> bool:
        """Its last token is already sampled (pending): scheduling it again would overrun."""
        return (len(self.output) + self.pending >= self.params.max_new_tokens
                or self.num_tokens >= self.max_len)

    def next_input(self) -> tuple[int, list[int], int]:
        """(start position, token ids, src row) to feed this step: the prompt first, then the
        last token. src row >= 0: the token is still on the device, in that row of the token
        buffer (ids holds a placeholder); -1: ids are the tokens. A pending token that the
        sampling params force is known here already."""
        if not self.output and not self.pending:
            return self.prefix, list(self.prompt), -1
        if not self.pending:
            return self.num_tokens - 1, [self.output[-1]], -1
        k, forced = len(self.output) + self.pending - 1, self.params.forced_tokens
        if k < len(forced):
            return self.num_tokens - 1, [forced[k]], -1
        return self.num_tokens - 1, [0], self.pending_row
