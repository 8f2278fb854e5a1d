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
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None          # length | stop | abort

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return self.prefix + len(self.prompt) + len(self.output)

    def next_input(self) -> tuple[int, list[int]]:
        """(start position, token ids) to feed this step: the prompt first, then the last token."""
        if not self.output:
            return self.prefix, list(self.prompt)
        return self.num_tokens - 1, [self.output[-1]]
