"""HOP-B (Helix overlapped pipelined batches): the decode batch split into micro-batches so
that the exchange of micro-batch i (pack, all-to-all over KVP, merge) runs on a communication
stream while the attention of micro-batch i + 1 computes on the compute stream.

Ordering is by CUDA events only: each exchange waits for its micro-batch's attention, and the
compute stream waits for the last exchange before the output projection reads the result (the
join, before any graph segment ends). No host sync, so it captures into the step's graph
(multi-stream capture). On CPU the same loop runs in order on one stream: results are equal to
one micro-batch by construction (attention and merge are per row).

Every tensor handed across streams stays referenced until after the join, so the caching
allocator never gives its memory to the other stream early (record_stream is not needed, and is
unavailable under graph capture).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from helix.tracing import phase

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def micro_batches(requested: int, rows: int, kvp: int) -> int:
    """Micro-batches for a decode step of `rows` rows: none without a KVP exchange to hide;
    requested = 0 (auto): 2 from 8 rows on (each half keeps enough work to cover the other's
    exchange), else 1; never more than rows."""
    if kvp == 1 or rows < 2:
        return 1
    if requested == 0:
        return 2 if rows >= 8 else 1
    return min(requested, rows)


def bounds(rows: int, m: int) -> list[tuple[int, int]]:
    """Rows [0, rows) in m contiguous parts, the first rows % m one row longer (uneven splits)."""
    base, extra = divmod(rows, m)
    out, a = [], 0
    for i in range(m):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def overlapped(attend: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
               exchange: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               rows: int, m: int, device: torch.device) -> torch.Tensor:
    """attend(a, b) -> (o, lse) of rows [a, b) (compute stream); exchange(o, lse) -> merged o
    (communication stream, overlapping the next micro-batch's attend) -> all rows, merged."""
    parts = bounds(rows, m)
    if torch.device(device).type != "cuda":
        outs = []
        for i, (a, b) in enumerate(parts):
            with phase(f"attn.mb{i}"):
                o, lse = attend(a, b)
            outs.append(exchange(o, lse))
        return torch.cat(outs)
    main = torch.cuda.current_stream(device)
    side = comm_stream(device)
    keep, outs = [], []
    for i, (a, b) in enumerate(parts):
        with phase(f"attn.mb{i}"):
            o, lse = attend(a, b)
        side.wait_stream(main)                  # this micro-batch's attention is done
        with torch.cuda.stream(side):
            out = exchange(o, lse)
        keep += [o, lse]
        outs.append(out)
    main.wait_stream(side)                      # join before anything reads the merged rows
    merged = torch.cat(outs)
    del keep
    return merged
