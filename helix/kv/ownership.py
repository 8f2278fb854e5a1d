"""The KV ownership rule. Position p lives on KVP rank (p // I) % kvp, I = kv_interleave;
its local index there is (p // (kvp*I)) * I + p % I. Works on ints and on integer tensors."""

from __future__ import annotations


def kv_owner(p, kvp: int, interleave: int):
    return (p // interleave) % kvp


def local_index(p, kvp: int, interleave: int):
    return (p // (kvp * interleave)) * interleave + p % interleave


def local_to_global(j, kvp_rank: int, kvp: int, interleave: int):
    """Inverse of local_index on rank `kvp_rank`: global position of local index j."""
    return (j // interleave) * (kvp * interleave) + kvp_rank * interleave + j % interleave


def local_len(length: int, kvp_rank: int, kvp: int, interleave: int) -> int:
    """How many of positions [0, length) rank `kvp_rank` owns. KVP rank 0 always owns the most."""
    cycle = kvp * interleave
    full, rem = divmod(length, cycle)
    return full * interleave + min(max(rem - kvp_rank * interleave, 0), interleave)
