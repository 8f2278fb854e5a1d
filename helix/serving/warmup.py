"""A server's warm-up: before it takes requests, run the kinds of step it will meet, so the
first clients do not pay for kernel compilation. Triton compiles a kernel per specialisation of
its integer arguments (== 1, divisible by 16, other), and a server's steps vary in exactly
those: prompt lengths, decode rows beside a chunk, batch sizes. Measured on one H200 before this
existed (profiling/results/serve.md): the first HTTP round's first step took ~2 s, every request
of the round waiting on it.

The pattern: prompts of lengths 1, 2, 3, 16, 17, ... join one per step while the earlier ones
decode (mixed steps of 0..n decode rows beside a chunk of each length), then 17 join at once
(a prefill of many sequences, decode batches of 16 / 17), then a decode row at each context
length 512, 1K, 2K, ... up to max_context (a synthetic prefix: no prefill) beside a joining
prompt, so every split count the decode kernels pick by context (a power of two) is compiled.
Everything is released afterwards. tests/test_compile_variants.py checks on the CPU that a
random serving pattern then launches no kernel variant the warm-up did not.
"""

from __future__ import annotations

import time

from helix.errors import CapacityError, RequestError
from helix.runtime.sampling import SamplingParams

LENGTHS = (1, 2, 3, 16, 17, 33, 64, 100)
TOGETHER = 17


def warm_up(llm) -> tuple[int, float]:
    """Run the pattern on `llm` (nothing else running); returns (steps, seconds)."""
    t0, steps = time.perf_counter(), 0
    room = llm.max_context - 8
    vocab = llm.cfg.vocab_size
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)

    def prompt(n: int, salt: int) -> list[int]:
        return [(salt * 31 + 7 * j) % (vocab - 1) + 1 for j in range(min(n, room))]

    ids = []

    def add(n: int, salt: int, prefix: int = 0) -> None:
        try:
            ids.append(llm.add_request(prompt(n, salt), params, synthetic_prefix=prefix))
        except (CapacityError, RequestError):   # a pool or context too small for it: skip
            pass

    def drain() -> None:
        nonlocal steps
        while any(r not in llm.finish_reasons for r in ids):
            llm.step()
            steps += 1

    if room < 1:
        return 0, 0.0
    for i, n in enumerate(LENGTHS):
        add(n, i)
        llm.step()
        steps += 1
    for i in range(min(TOGETHER, llm.runtime.max_batch)):
        add(20, 100 + i)
    drain()
    context = 512
    while context + 8 <= room:
        add(1, 200, prefix=context)            # decodes at `context` positions ...
        llm.step()
        steps += 1
        add(5, 201)                            # ... beside a joining prompt
        drain()
        context *= 2
    for r in ids:
        llm.release(r)
    return steps, time.perf_counter() - t0
