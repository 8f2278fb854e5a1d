"""One rank's engine: scheduler + KV + model + sampler. Every rank runs `step(commands)` with the
same commands; rank 0 (the driver, see llm.py) is the only one that talks to the user."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from helix.attention.backend import get_backend
from helix.config import Layout, ModelConfig, RuntimeConfig
from helix.kv.manager import KVManager
from helix.kv.ownership import local_len
from helix.runtime.decode_graphs import DecodeGraphs
from helix.runtime.nvtx import nvtx_range
from helix.loader import build_and_load
from helix.parallel.comm import Comm
from helix.runtime.request import Request
from helix.runtime.sampling import SamplingParams, sample
from helix.runtime.scheduler import Scheduler


@dataclass
class StepOutput:
    tokens: dict[int, int]        # request id -> token generated this step
    finished: dict[int, str]      # request id -> finish reason, for requests that ended
    num_tokens: int               # tokens fed to the model this step
    seconds: float                # wall time of the step on this rank


class Engine:
    def __init__(self, model_ref: str, cfg: ModelConfig, ckpt: str | None, layout: Layout,
                 runtime: RuntimeConfig, comm: Comm, device: torch.device):
        self.cfg, self.layout, self.runtime, self.comm = cfg, layout, runtime, comm
        self.device = device
        self.max_context = runtime.resolved_max_context(cfg)
        dtype = runtime.torch_dtype
        self.model = build_and_load(model_ref, comm, dtype, device, self.max_context, runtime.seed,
                                    cfg=cfg, ckpt=ckpt)
        num_pages = runtime.resolved_num_pages(cfg, layout)
        self.caches = [[torch.zeros(s, dtype=dtype, device=device) for s in shapes]
                       for shapes in self.model.kv_cache_shapes(num_pages, runtime.page_size)]
        mesh = comm.mesh
        self.kv = KVManager(num_pages, runtime.page_size, mesh.kvp_rank, layout.kvp,
                            layout.kv_interleave)
        self.scheduler = Scheduler(num_pages, runtime.page_size, layout.kvp, layout.kv_interleave,
                                   runtime.max_batch)
        self.backend = get_backend(runtime.attention_backend, runtime.device)
        self.generators: dict[int, torch.Generator] = {}
        self.kv_tokens_released = 0
        self.graphs = None
        if runtime.cuda_graphs:
            max_pages = -(-local_len(self.max_context, 0, layout.kvp, layout.kv_interleave)
                          // runtime.page_size) + 1
            self.graphs = DecodeGraphs(self, runtime.graph_buckets, runtime.graph_breaks, max_pages)
            self.graphs.capture()

    # -- commands (identical on every rank) --------------------------------------------------
    def apply(self, commands: list[tuple]) -> None:
        for cmd in commands:
            if cmd[0] == "add":
                _, req_id, prompt, params, max_len, prefix = cmd
                req = Request(req_id, list(prompt), params, max_len, prefix)
                if not params.greedy:
                    seed = params.seed if params.seed is not None else self.runtime.seed * 1000003 + req_id
                    self.generators[req_id] = torch.Generator(device=self.device).manual_seed(seed)
                self.scheduler.add(req)
            elif cmd[0] == "abort":
                self.scheduler.abort(cmd[1])

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.cfg.eos_token_ids))

    @torch.inference_mode()
    def step(self, commands: list[tuple]) -> StepOutput:
        t0 = time.perf_counter()
        self.apply(commands)
        finished = {r.id: r.finish_reason for r in self._retire()}  # aborted before running
        batch = self.scheduler.schedule()
        if not batch:
            return StepOutput({}, finished, 0, time.perf_counter() - t0)
        for r in batch:
            if r.prefix and r.id not in self.kv.lengths:       # synthetic KV: no prefill
                self.kv.assume_prefix(r.id, r.prefix)
        feeds = [r.next_input() for r in batch]
        plan = [(r.id, start, len(toks)) for r, (start, toks) in zip(batch, feeds)]
        ids = [t for _, toks in feeds for t in toks]
        if self.graphs is not None and len(ids) == len(batch):   # decode only: replay a graph
            with nvtx_range("helix.prepare"):
                meta = self.kv.prepare(plan, "cpu")
            with nvtx_range(f"helix.decode_graph[{len(batch)}]"):
                logits = self.graphs.run(torch.tensor(ids, dtype=torch.long), meta)
        else:
            with nvtx_range("helix.prepare"):
                meta = self.kv.prepare(plan, self.device)
                ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
            with nvtx_range(f"helix.forward_eager[{len(ids)} tokens]"):
                last = meta.cu_q[1:].long() - 1
                logits = self.model(ids_t, meta.q_pos, meta, self.caches, self.backend, last)
        with nvtx_range("helix.sample"):
            tokens = sample(logits, [r.params for r in batch],
                            [self.generators.get(r.id) for r in batch])
        out = {}
        for r, tok in zip(batch, tokens):
            forced = r.params.forced_tokens
            if len(r.output) < len(forced):
                tok = forced[len(r.output)]
            r.output.append(tok)
            out[r.id] = tok
            if tok in self._stop_ids(r.params):
                r.finish_reason = "stop"
            elif len(r.output) >= r.params.max_new_tokens or r.num_tokens >= r.max_len:
                r.finish_reason = "length"
        finished.update({r.id: r.finish_reason for r in self._retire()})
        self.last_logits = logits
        return StepOutput(out, finished, len(ids), time.perf_counter() - t0)

    def _retire(self) -> list[Request]:
        done = self.scheduler.retire()
        for r in done:
            self.kv_tokens_released += self.kv.local_tokens(r.id)
            self.kv.free(r.id)
            self.generators.pop(r.id, None)
        return done

    def close(self) -> None:
        """Free the graphs (before any process group is destroyed)."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    def kv_tokens(self) -> int:
        """KV positions this rank has stored for the run's requests (layer 0), live or finished."""
        return self.kv_tokens_released + sum(self.kv.local_tokens(s) for s in self.kv.lengths)
