"""Every live sequence's local pages as one host int32 table, a row per sequence, kept up to
date as pages are added: a step's block tables are then one row gather (`rows`), not a tensor per
sequence. Rows and columns double when they run out; a freed row is zeroed and reused."""

from __future__ import annotations

import torch


class PageTable:
    def __init__(self, rows: int = 64, cols: int = 64):
        self.table = torch.zeros((rows, cols), dtype=torch.int32)
        self.row: dict[int, int] = {}          # seq id -> its row
        self.width: dict[int, int] = {}        # seq id -> pages written into its row
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def set(self, seq_id: int, pages: list[int]) -> None:
        """The sequence's row holds `pages` (appended pages written, a shorter list zeroes the
        tail)."""
        row = self.row.get(seq_id)
        if row is None:
            row = self.row[seq_id] = self._take_row()
            self.width[seq_id] = 0
        have, n = self.width[seq_id], len(pages)
        if n > self.table.shape[1]:
            self._grow(cols=n)
        if n > have:
            self.table[row, have:n] = torch.tensor(pages[have:], dtype=torch.int32)
        elif n < have:
            self.table[row, n:have] = 0
        self.width[seq_id] = n

    def drop(self, seq_id: int) -> None:
        row = self.row.pop(seq_id, None)
        if row is not None:
            self.table[row, :self.width.pop(seq_id)] = 0
            self._free.append(row)

    def rows(self, seq_ids: list[int]) -> torch.Tensor:
        """[len(seq_ids), widest of them (>= 1)] int32: their pages, zero padded."""
        width = max([self.width.get(s, 0) for s in seq_ids] + [1])
        idx = torch.tensor([self.row[s] if s in self.row else self._zero_row() for s in seq_ids],
                           dtype=torch.int64)
        return self.table[:, :width].index_select(0, idx)

    def _zero_row(self) -> int:
        """A row index that holds zeros (a sequence with no pages on this rank yet)."""
        if not self._free:
            self._grow(rows=self.table.shape[0] * 2)
        return self._free[-1]

    def _take_row(self) -> int:
        if not self._free:
            self._grow(rows=self.table.shape[0] * 2)
        return self._free.pop()

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        r0, c0 = self.table.shape
        r, c = max(r0, rows), max(c0, 1 << max(0, cols - 1).bit_length())
        table = torch.zeros((r, c), dtype=torch.int32)
        table[:r0, :c0] = self.table
        self.table = table
        self._free = list(range(r - 1, r0 - 1, -1)) + self._free
