"""Named parallel axes over one set of ranks: the attention view (kvp, tpa) and the FFN view
(ep, tpf). Pure index arithmetic; the process groups live in `comm`."""

from __future__ import annotations

from dataclasses import dataclass

from helix.config import Layout


@dataclass(frozen=True)
class Mesh:
    layout: Layout
    rank: int

    @property
    def world(self) -> int:
        return self.layout.world_size

    # attention view: rank = kvp_rank * tpa + tpa_rank
    @property
    def kvp_rank(self) -> int:
        return self.rank // self.layout.tpa

    @property
    def tpa_rank(self) -> int:
        return self.rank % self.layout.tpa

    # FFN view: rank = ep_rank * tpf + tpf_rank
    @property
    def ep_rank(self) -> int:
        return self.rank // self.layout.tpf

    @property
    def tpf_rank(self) -> int:
        return self.rank % self.layout.tpf

    def kvp_group_ranks(self, tpa_rank: int) -> list[int]:
        """Ranks sharing one head slice, one per KVP rank (the all-to-all group)."""
        return [k * self.layout.tpa + tpa_rank for k in range(self.layout.kvp)]
