"""The loop of ranks > 0: receive rank 0's commands each step, run the same step, repeat."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helix.config import Layout, RuntimeConfig
from helix.errors import HelixError
from helix.loader import read_model_config
from helix.parallel.comm import TorchComm
from helix.parallel.mesh import Mesh
from helix.runtime.engine import Engine
from helix.runtime.launch import report_failure


def make_engine(model_ref: str, layout: Layout, runtime: RuntimeConfig, device: torch.device,
                ranks_here: int) -> Engine:
    cfg, ckpt = read_model_config(model_ref, runtime.layers)
    comm = TorchComm(Mesh(layout, dist.get_rank()), runtime.timeout_s)
    return Engine(model_ref, cfg, ckpt, layout, runtime, comm, device, ranks_here)


def serve(model_ref: str, layout: Layout, runtime: RuntimeConfig, device: torch.device,
          ranks_here: int) -> int:
    """Run rank 0's commands until it says shutdown; returns the process exit code."""
    rank = dist.get_rank()
    engine = make_engine(model_ref, layout, runtime, device, ranks_here)
    comm = engine.comm
    try:
        comm.barrier()  # tells rank 0 this rank is built
        while True:
            msg = comm.broadcast_object(None)
            if msg[0] == "step":
                engine.step(msg[1])
            elif msg[0] == "kv_tokens":
                comm.gather_object(engine.kv_tokens())
            elif msg[0] == "stats":
                comm.gather_object(engine.stats())
            elif msg[0] == "prefill_tokens":
                comm.gather_object(engine.prefill_tokens)
            elif msg[0] == "export_kv":
                comm.gather_object(engine.export_kv(*msg[1:]))
            elif msg[0] == "shutdown":
                break
    except (HelixError, RuntimeError) as e:   # the driver stopped, or this rank's step failed
        report_failure(rank, e)
        engine.close()
        return 1
    engine.close()  # graphs first: destroying NCCL groups under live graphs hung at exit
    comm.close(graceful=True)
    return 0
