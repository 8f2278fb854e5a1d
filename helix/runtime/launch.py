"""Process start-up: one process per rank. The API/CLI spawns local workers itself (rank 0 is the
calling process); under torchrun (RANK/WORLD_SIZE set, multi-node included) every rank is already
running and ranks > 0 enter the worker loop.

Local workers start from a fork server (torch imported once) and take the driver's environment.
A worker ignores SIGINT (the driver, which a terminal's Ctrl-C also reaches, shuts it down) and
dies with its parent, the fork server (PR_SET_PDEATHSIG), which exits with the driver: no worker
outlives a killed driver."""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helix.config import Layout, RuntimeConfig
from helix.errors import HelixError

PR_SET_PDEATHSIG = 1


def torchrun_world() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (RANK and WORLD_SIZE set)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_state(pid: int) -> str:
    """The one-letter state of a process (R, S, T = stopped, Z, ...), '?' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def rank_device(runtime: RuntimeConfig, local_rank: int) -> torch.device:
    if runtime.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(rank: int, world: int, runtime: RuntimeConfig, device: torch.device,
                     store=None) -> None:
    """The default process group (NCCL on GPUs, gloo on CPU) with the run's timeout; store: the
    rendezvous of a locally spawned world (torchrun sets its own)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = dict(backend=backend, rank=rank, world_size=world,
              timeout=datetime.timedelta(seconds=runtime.timeout_s))
    if store is not None:
        kw["store"] = store
    if device.type == "cuda":
        kw["device_id"] = device
    dist.init_process_group(**kw)


def rendezvous(addr: str, port: int, rank: int, world: int, timeout_s: float, dead=None):
    """The TCP store of a locally spawned world. Rank 0 hosts it and waits until every worker
    has checked in, polling dead() -> a message naming a worker that exited (None while all
    live), so a worker that dies while starting ends the start at once, not after the timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank:
        store = dist.TCPStore(addr, port, world, False, timeout=timeout)
        store.set(f"helix-ready-{rank}", "1")
        return store
    store = dist.TCPStore(addr, port, world, True, timeout=timeout, wait_for_workers=False)
    keys = [f"helix-ready-{r}" for r in range(1, world)]
    start = time.monotonic()
    while not store.check(keys):
        why = dead() if dead is not None else None
        if why:
            raise HelixError(f"{why} while starting (its error is above)")
        if time.monotonic() - start > timeout_s:
            raise HelixError(f"workers did not start within {timeout_s:.0f} s: raise --timeout "
                             f"or check the machine")
        time.sleep(0.05)
    return store


def worker_context():
    """The multiprocessing context that starts local workers: a fork server that has imported
    torch and the runtime once (a 4-rank world then starts in ~0.5 s instead of ~4 s; it never
    touches CUDA, so forked workers initialise their own), or spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["helix.runtime.launch", "helix.runtime.worker"])
    return ctx


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):       # not Linux: the driver's close() still kills us
        pass


def worker_main(rank: int, world: int, model_ref: str, layout: Layout, runtime: RuntimeConfig,
                addr: str, port: int, threads: int, env: dict[str, str]) -> None:
    """Entry point of a spawned local worker (ranks 1..N-1). env: the driver's environment when
    it started the world (a fork server's own is older)."""
    os.environ.clear()
    os.environ.update(env)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    from helix.runtime.worker import serve
    try:
        device = rank_device(runtime, rank)
        store = rendezvous(addr, port, rank, world, runtime.timeout_s)
        init_distributed(rank, world, runtime, device, store)
        code = serve(model_ref, layout, runtime, device, world)
    except Exception as e:  # a worker's failure must end the run, not hang it: report and exit
        report_failure(rank, e)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report_failure(rank: int, e: BaseException) -> None:
    """One line on stderr (the traceback too with HELIX_DEBUG=1)."""
    if os.environ.get("HELIX_DEBUG"):
        traceback.print_exception(e)
    first = str(e).splitlines()[0] if str(e) else ""
    print(f"helix: rank {rank} failed: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
