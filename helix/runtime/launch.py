"""Process start-up: one process per rank. The API/CLI spawns local workers itself (rank 0 is the
calling process); under torchrun (RANK/WORLD_SIZE set, multi-node included) every rank is already
running and ranks > 0 enter the worker loop."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist

from helix.config import Layout, RuntimeConfig


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(runtime: RuntimeConfig, local_rank: int) -> torch.device:
    if runtime.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(rank: int, world: int, runtime: RuntimeConfig, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = dict(backend=backend, rank=rank, world_size=world,
              timeout=datetime.timedelta(seconds=runtime.timeout_s))
    if device.type == "cuda":
        kw["device_id"] = device
    dist.init_process_group(**kw)


def worker_main(rank: int, world: int, model_ref: str, layout: Layout, runtime: RuntimeConfig,
                addr: str, port: int, threads: int) -> None:
    """Entry point of a spawned local worker (ranks 1..N-1)."""
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    from helix.runtime.worker import serve
    try:
        device = rank_device(runtime, rank)
        init_distributed(rank, world, runtime, device)
        serve(model_ref, layout, runtime, device)
    except Exception:  # a worker's failure must end the run, not hang it: report and exit non-zero
        traceback.print_exc()
        os._exit(1)
