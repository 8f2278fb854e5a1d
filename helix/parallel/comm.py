"""One communication interface for every layer: all_to_all, all_reduce, all_gather, broadcast.

Layers call `comm.<op>(tensor, axis)` with a named axis ("world", "kvp"); the backend maps
the axis to a process group. `LocalComm` is the single-rank identity; `TorchComm` runs
torch.distributed (gloo on CPU, NCCL on GPU) with a timeout on every group.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from helix.kv.quant import as_bytes as _as_bytes   # fp8: gloo and older NCCL lack the type
from helix.parallel.mesh import Mesh

class Comm:
    """Interface. `axis` names a group of the mesh; sizes come from the layout."""

    mesh: Mesh

    def size(self, axis: str) -> int:
        lay = self.mesh.layout
        return {"world": lay.world_size, "kvp": lay.kvp}[axis]

    def all_reduce(self, x: torch.Tensor, axis: str = "world") -> torch.Tensor:
        raise NotImplementedError

    def all_to_all(self, x: torch.Tensor, axis: str = "kvp") -> torch.Tensor:
        """x [n, ...] with chunk j going to rank j of the axis; returns [n, ...], chunk i from
        rank i."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, axis: str = "world") -> torch.Tensor:
        """Returns [n, *x.shape]: the x of every rank of the axis, in axis order."""
        raise NotImplementedError

    def ring_shift(self, x: torch.Tensor, axis: str = "kvp") -> torch.Tensor:
        """Send x to the next rank of the axis, return what the previous rank sent (same shape)."""
        raise NotImplementedError

    def broadcast_object(self, obj, src: int = 0):
        """Control plane: rank `src`'s python object on every rank."""
        raise NotImplementedError

    def gather_object(self, obj) -> list:
        """Control plane: every rank's object, in rank order, on every rank."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Make collectives blocked on a dead peer fail now (called from another thread)."""

    def close(self, graceful: bool = True) -> None:
        pass


class LocalComm(Comm):
    """World of one: every collective is the identity."""

    def __init__(self, mesh: Mesh):
        assert mesh.world == 1, "LocalComm is for a world of one rank"
        self.mesh = mesh

    def all_reduce(self, x, axis="world"):
        return x

    def all_to_all(self, x, axis="kvp"):
        return x

    def all_gather(self, x, axis="world"):
        return x.unsqueeze(0)

    def ring_shift(self, x, axis="kvp"):
        return x

    def broadcast_object(self, obj, src=0):
        return obj

    def gather_object(self, obj):
        return [obj]

    def barrier(self):
        pass


class TorchComm(Comm):
    """torch.distributed behind the interface. Requires the default group to be initialised."""

    def __init__(self, mesh: Mesh, timeout_s: float = 300.0):
        self.mesh = mesh
        timeout = datetime.timedelta(seconds=timeout_s)
        lay = mesh.layout
        self.groups = {"world": None}
        # new_group must be called by every rank for every group, in the same order
        for g in range(lay.tpa):
            ranks = mesh.kvp_group_ranks(g)
            pg = dist.new_group(ranks, timeout=timeout)
            if mesh.rank in ranks:
                self.groups["kvp"] = pg
        # control plane on gloo, so object broadcasts never touch the GPU stream
        self.ctrl = (dist.new_group(backend="gloo", timeout=timeout)
                     if dist.get_backend() != "gloo" else None)

    def all_reduce(self, x, axis="world"):
        if self.size(axis) > 1:
            dist.all_reduce(x, group=self.groups[axis])
        return x

    def all_to_all(self, x, axis="kvp"):
        if self.size(axis) == 1:
            return x
        out = torch.empty_like(x)
        dist.all_to_all_single(_as_bytes(out), _as_bytes(x.contiguous()),
                               group=self.groups[axis])
        return out

    def all_gather(self, x, axis="world"):
        n = self.size(axis)
        if n == 1:
            return x.unsqueeze(0)
        x = x.contiguous().view(1, *x.shape) if x.dim() == 0 else x.contiguous()
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(_as_bytes(out), _as_bytes(x), group=self.groups[axis])
        return out.view(n, *x.shape)

    def ring_shift(self, x, axis="kvp"):
        n = self.size(axis)
        if n == 1:
            return x
        ranks = self.mesh.kvp_group_ranks(self.mesh.tpa_rank)
        i = ranks.index(self.mesh.rank)
        x = x.contiguous()
        out = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, _as_bytes(x), ranks[(i + 1) % n], self.groups[axis]),
               dist.P2POp(dist.irecv, _as_bytes(out), ranks[(i - 1) % n], self.groups[axis])]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return out

    def broadcast_object(self, obj, src=0):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.ctrl)
        return box[0]

    def gather_object(self, obj):
        out = [None] * self.mesh.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def barrier(self):
        dist.barrier(group=self.ctrl)

    def abort(self):
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None or not dist.is_initialized():
            return
        try:                # NCCL: abort the communicators; gloo fails on a dead peer by itself
            if dist.get_backend() == "nccl":
                abort()
        except Exception:
            pass

    def close(self, graceful: bool = True):
        """Destroy the process groups. Not graceful (peers gone or mid-collective): NCCL groups
        are aborted rather than destroyed, which could wait on the peers."""
        if not dist.is_initialized():
            return
        if not graceful and dist.get_backend() == "nccl":
            self.abort()
        dist.destroy_process_group()
