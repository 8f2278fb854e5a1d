"""Static input buffers: the tensors a captured graph reads, allocated once, never reallocated.

A CUDA graph bakes in the addresses of everything it reads. Each step's inputs are therefore
written into a host mirror (`HostStaging`) and copied *into* these buffers (stale or reallocated
addresses are the top cause of silently wrong output under graphs). Every buffer is row-indexed:
`[max_rows, *row_shape]`; a bucket of b rows reads the view `[:b]`. Rows past a step's real
count hold the buffer's pad value (e.g. slot -1: no KV write; length 0: empty attention), so
padded rows compute harmlessly and are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferSpec:
    """How one static buffer is shaped: `[rows, *row_shape]` of `dtype`, padded with `pad`."""
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pad: float | int | bool


class StaticBuffers:
    """Named row-indexed tensors `[max_rows, *row_shape]` on one device, at fixed addresses.

    Each buffer's address is recorded when it is allocated; `check_addresses()` raises if any
    has changed (e.g. someone called `resize_` or `set_` on it), which would leave captured graphs
    reading freed memory.
    """

    def __init__(self, max_rows: int, device: torch.device | str = "cpu"):
        """Empty; `packed` fills it."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.device = torch.device(device)
        self._specs: dict[str, BufferSpec] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._ptrs: dict[str, int] = {}
        # packed(): dtype -> (flat arena, [(name, element offset, elements per row)] in order)
        self.arenas: dict[torch.dtype, tuple[torch.Tensor, list[tuple[str, int, int]]]] = {}

    @classmethod
    def packed(cls, max_rows: int, device: torch.device | str,
               specs: dict[str, tuple[tuple[int, ...], torch.dtype, float | int | bool]]
               ) -> StaticBuffers:
        """Buffers `name -> (row_shape, dtype, pad)` laid out back to back, in the given order,
        in ONE flat tensor per dtype (an arena). Each buffer is still a contiguous
        `[max_rows, *row_shape]` view at a fixed address; a `HostStaging` mirror then uploads
        every input of a step with one host-to-device copy per dtype. Put the widest buffer
        last in its dtype: an upload of b rows copies the earlier regions whole but only b rows
        of the last one."""
        self = cls(max_rows, device)
        groups: dict[torch.dtype, list[tuple[str, BufferSpec]]] = {}
        for name, (row_shape, dtype, pad) in specs.items():
            spec = BufferSpec(tuple(int(s) for s in row_shape), dtype, pad)
            groups.setdefault(dtype, []).append((name, spec))
        for dtype, members in groups.items():
            widths = [math.prod(spec.row_shape) for _, spec in members]
            arena = torch.empty(max_rows * sum(widths), dtype=dtype, device=self.device)
            layout, off = [], 0
            for (name, spec), w in zip(members, widths):
                t = arena[off:off + max_rows * w].view(max_rows, *spec.row_shape)
                t.fill_(spec.pad)
                self._specs[name], self._tensors[name], self._ptrs[name] = spec, t, t.data_ptr()
                layout.append((name, off, w))
                off += max_rows * w
            self.arenas[dtype] = (arena, layout)
        return self

    # -- access -------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        """The whole buffer `[max_rows, *row_shape]`."""
        return self._tensors[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def spec(self, name: str) -> BufferSpec:
        return self._specs[name]

    def view(self, name: str, bucket: int) -> torch.Tensor:
        """Rows `[:bucket]` of buffer `name`: `[bucket, *row_shape]`, same storage."""
        self._check_rows(bucket)
        return self._tensors[name][:bucket]

    # -- writing ------------------------------------------------------------------------------
    def fill_pads(self) -> None:
        """Every buffer, every row, back to its pad value (safe inputs for warmup and capture)."""
        for name, t in self._tensors.items():
            t.fill_(self._specs[name].pad)

    # -- address stability --------------------------------------------------------------------
    def data_ptrs(self) -> dict[str, int]:
        """Current address of each buffer."""
        return {name: t.data_ptr() for name, t in self._tensors.items()}

    def check_addresses(self) -> None:
        """Raise RuntimeError naming any buffer whose address moved since allocation."""
        moved = [n for n, t in self._tensors.items() if t.data_ptr() != self._ptrs[n]]
        if moved:
            raise RuntimeError(f"static buffers reallocated: {moved}; captured graphs would read "
                               "stale memory (write with copy_in, never assign or resize)")

    def _check_rows(self, bucket: int) -> None:
        if not 0 < bucket <= self.max_rows:
            raise ValueError(f"bucket {bucket} outside 1..{self.max_rows}")


class HostStaging:
    """A host mirror of a `StaticBuffers.packed` set (pinned when the buffers are on CUDA): a
    step writes its rows on the host with `put`, then `upload(bucket)` issues ONE copy per
    dtype arena instead of a copy (and a pad fill) per buffer.

    With non_blocking uploads the copy reads the mirror when the stream reaches it, so the
    caller must not `put` into a mirror whose last upload may still be pending: alternate two
    mirrors and make sure the step that used one has finished before writing it again.
    """

    def __init__(self, bufs: StaticBuffers):
        if not bufs.arenas:
            raise ValueError("HostStaging needs StaticBuffers.packed(...) buffers")
        self.bufs = bufs
        pin = bufs.device.type == "cuda"
        self.arenas = {dt: torch.empty(a.numel(), dtype=dt, pin_memory=pin)
                       for dt, (a, _) in bufs.arenas.items()}
        self._views: dict[str, torch.Tensor] = {}
        for dt, (_, layout) in bufs.arenas.items():
            for name, off, w in layout:
                spec = bufs.spec(name)
                view = self.arenas[dt][off:off + bufs.max_rows * w].view(bufs.max_rows,
                                                                           *spec.row_shape)
                view.fill_(spec.pad)
                self._views[name] = view

    def __getitem__(self, name: str) -> torch.Tensor:
        """The host mirror of buffer `name`, `[max_rows, *row_shape]`."""
        return self._views[name]

    def put(self, name: str, src: torch.Tensor, bucket: int, pad_tail: bool = True) -> None:
        """Host rows `[:n] = src` (`src` may be narrower than a row: `pad_tail` pads the rest of
        each row; False leaves those columns stale, for readers bounded by another input, e.g.
        block-table columns past a sequence's length) and rows `[n:bucket]` = the pad."""
        view, pad = self._views[name], self.bufs.spec(name).pad
        n = src.shape[0]
        if n > bucket or bucket > self.bufs.max_rows or src.dim() != view.dim() or any(
                a > b for a, b in zip(src.shape[1:], view.shape[1:])):
            raise ValueError(f"{name}: input {tuple(src.shape)} does not fit "
                             f"[{bucket}, {', '.join(map(str, view.shape[1:]))}]")
        view[tuple(slice(0, s) for s in src.shape)].copy_(src)
        if pad_tail and src.shape[1:] != view.shape[1:]:
            for d, s in enumerate(src.shape[1:], start=1):
                if s < view.shape[d]:
                    view[:n].narrow(d, s, view.shape[d] - s).fill_(pad)
        if n < bucket:
            view[n:bucket].fill_(pad)

    def upload(self, bucket: int, non_blocking: bool = True) -> None:
        """Copy rows `[:bucket]` of every buffer to the device: one copy per dtype arena (the
        arena's earlier buffers whole, its last buffer up to row `bucket`)."""
        for dt, (dev, layout) in self.bufs.arenas.items():
            _, off, w = layout[-1]
            end = off + bucket * w
            dev[:end].copy_(self.arenas[dt][:end], non_blocking=non_blocking)
