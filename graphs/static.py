"""Static input buffers: the tensors a captured graph reads, allocated once, never reallocated.

A CUDA graph bakes in the addresses of everything it reads. Each step's inputs are therefore
copied *into* these buffers (stale or reallocated addresses are the top cause of silently wrong
output under graphs). Every buffer is row-indexed: `[max_rows, *row_shape]`; a bucket of b rows
reads the view `[:b]`. Rows past a step's real count hold the buffer's pad value (e.g. slot -1:
no KV write; length 0: empty attention), so padded rows compute harmlessly and are ignored.
"""

from __future__ import annotations

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
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.device = torch.device(device)
        self._specs: dict[str, BufferSpec] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._ptrs: dict[str, int] = {}

    # -- allocation ---------------------------------------------------------------------------
    def add(self, name: str, row_shape: tuple[int, ...] = (), dtype: torch.dtype = torch.int64,
            pad: float | int | bool = 0) -> torch.Tensor:
        """Allocate buffer `name` as `[max_rows, *row_shape]`, filled with `pad`; returns it."""
        if name in self._tensors:
            raise ValueError(f"static buffer {name!r} already exists")
        spec = BufferSpec(tuple(int(s) for s in row_shape), dtype, pad)
        t = torch.full((self.max_rows, *spec.row_shape), pad, dtype=dtype, device=self.device)
        self._specs[name], self._tensors[name], self._ptrs[name] = spec, t, t.data_ptr()
        return t

    def resized(self, rows: int) -> StaticBuffers:
        """A new, separate set with the same names, shapes and pads but `rows` rows.

        Used for the eager fallback above the largest bucket: those steps are not replayed, so
        fresh allocations are fine there.
        """
        other = StaticBuffers(rows, self.device)
        for name, spec in self._specs.items():
            other.add(name, spec.row_shape, spec.dtype, spec.pad)
        return other

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
    def copy_in(self, name: str, src: torch.Tensor, pad_value: float | int | bool | None = None,
                *, bucket: int | None = None, non_blocking: bool = False) -> torch.Tensor:
        """Copy `src` `[n, *s]` into rows `[:n]`, pad the rest of rows `[:bucket]`; returns the view.

        `s` may be smaller than the buffer's row shape in any dim (e.g. a block table with fewer
        pages than the max): the part of each row outside `src` gets the pad too. `pad_value`
        overrides the buffer's pad for this call; `bucket` defaults to all rows. Rows past the
        bucket are left alone: that bucket's graph never reads them. Never reallocates.
        """
        if name not in self._tensors:
            raise KeyError(f"no static buffer {name!r} (have {list(self._tensors)})")
        buf = self._tensors[name]
        bucket = self.max_rows if bucket is None else bucket
        self._check_rows(bucket)
        pad = self._specs[name].pad if pad_value is None else pad_value
        if src.dim() != buf.dim():
            raise ValueError(f"{name}: input has shape {tuple(src.shape)}, buffer rows are "
                             f"{tuple(buf.shape[1:])} (need the same number of dims)")
        n = src.shape[0]
        if n > bucket or any(a > b for a, b in zip(src.shape[1:], buf.shape[1:])):
            raise ValueError(f"{name}: input {tuple(src.shape)} does not fit in "
                             f"[{bucket}, {', '.join(map(str, buf.shape[1:]))}]")
        view = buf[:bucket]
        if src.shape[1:] == buf.shape[1:]:
            view[:n].copy_(src, non_blocking=non_blocking)
            if n < bucket:
                view[n:].fill_(pad)
        else:  # narrower rows: pad everything, then write the corner
            view.fill_(pad)
            view[tuple(slice(0, s) for s in src.shape)].copy_(src, non_blocking=non_blocking)
        return view

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
