"""One rank's engine: scheduler + KV + model + sampler. Every rank runs `step(commands)` with the
same commands; rank 0 (the driver, see llm.py) is the only one that talks to the user."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from helix.attention.backend import get_backend
from helix.config import Layout, ModelConfig, RuntimeConfig
from helix.kv.manager import KVManager, upload
from helix.layers.fused_ops import select_tokens
from helix.runtime.decode_graphs import DecodeGraphs
from helix.runtime.nvtx import nvtx_range
from helix.loader import build_and_load
from helix.parallel.comm import Comm
from helix.runtime.request import Request
from helix.runtime.sampling import SamplingParams, row_params, sample_into
from helix.runtime.scheduler import Scheduler


@dataclass
class _Launched:
    """A step queued on the device whose tokens are not read back yet."""
    batch: list[Request]          # its rows, in order
    host: torch.Tensor            # host buffer the tokens are copied into (pinned on cuda)
    event: torch.cuda.Event | None  # recorded after that copy (None on cpu: already done)
    num_tokens: int               # tokens fed to the model


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
        self.backend = get_backend(runtime.resolved_backend, runtime.device)
        self.seeds: dict[int, int] = {}       # request id -> sampling seed
        self.kv_tokens_released = 0
        # sampled tokens stay on the device (the next step gathers them) and are read back
        # through two alternating host buffers: with overlap, step N + 1's copy must not land
        # in the buffer step N's tokens are still being read from
        rows = max(runtime.max_batch, max(runtime.graph_buckets, default=0))
        self.tok_buf = torch.zeros(rows, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self.host_tokens = [torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self.overlap = runtime.resolved_overlap
        self.inflight: _Launched | None = None
        self.last_logits: torch.Tensor | None = None
        self.graphs = None
        if runtime.cuda_graphs:
            max_pages = self.scheduler.sharding.max_pages(self.max_context)
            self.graphs = DecodeGraphs(self, runtime.graph_buckets, runtime.graph_breaks, max_pages)
            self.graphs.capture()

    # -- commands (identical on every rank) --------------------------------------------------
    def apply(self, commands: list[tuple]) -> None:
        for cmd in commands:
            if cmd[0] == "add":
                _, req_id, prompt, params, max_len, prefix = cmd
                req = Request(req_id, list(prompt), params, max_len, prefix)
                self.seeds[req_id] = (params.seed if params.seed is not None
                                      else self.runtime.seed * 1000003 + req_id)
                self.scheduler.add(req)
            elif cmd[0] == "abort":
                self.scheduler.abort(cmd[1])

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.cfg.eos_token_ids))

    @torch.inference_mode()
    def step(self, commands: list[tuple]) -> StepOutput:
        """Queue this step on the device, then read back the tokens of the step before it
        (overlap) or of this one (no overlap). With overlap the host prepares step N + 1 while
        the device runs step N: a request's token is reported one call later, and a request
        that stops on a sampled stop id runs one extra (discarded) row."""
        t0 = time.perf_counter()
        self.apply(commands)
        finished = {r.id: r.finish_reason for r in self._retire()}  # aborted before running
        batch = [r for r in self.scheduler.schedule() if not r.exhausted]
        launched = self._launch(batch) if batch else None
        tokens = self._resolve(self.inflight) if self.inflight is not None else {}
        self.inflight = launched
        if launched is not None and not self.overlap:
            tokens.update(self._resolve(launched))
            self.inflight = None
        finished.update({r.id: r.finish_reason for r in self._retire()})
        return StepOutput(tokens, finished, launched.num_tokens if launched else 0,
                          time.perf_counter() - t0)

    def _launch(self, batch: list[Request]) -> _Launched:
        """Queue the model and the sampler for `batch`; no host sync."""
        for r in batch:
            if r.prefix and r.id not in self.kv.lengths:       # synthetic KV: no prefill
                self.kv.assume_prefix(r.id, r.prefix)
        feeds = [r.next_input() for r in batch]
        plan = [(r.id, start, len(toks)) for r, (start, toks, _) in zip(batch, feeds)]
        ids = [t for _, toks, _ in feeds for t in toks]
        src = [s if len(toks) == 1 else -1 for _, toks, s in feeds for _ in toks]
        n = len(batch)
        params = [r.params for r in batch]
        seeds = [self.seeds[r.id] for r in batch]
        counters = [r.num_tokens for r in batch]         # the position of the token sampled
        if self.graphs is not None and len(ids) == n:   # decode only: replay a graph
            with nvtx_range("helix.prepare"):
                meta = self.kv.prepare(plan, "cpu")
                rows = None if all(p.greedy for p in params) else row_params(params, seeds,
                                                                            counters)
            with nvtx_range(f"helix.decode_graph[{n}]"):
                logits = self.graphs.run(torch.tensor(ids, dtype=torch.long),
                                         torch.tensor(src, dtype=torch.long), meta, rows)
        else:
            with nvtx_range("helix.prepare"):
                meta = self.kv.prepare(plan, self.device)
                ids_t = upload(torch.tensor(ids, dtype=torch.long), self.device)
                if any(s >= 0 for s in src):            # tokens still on the device
                    src_t = upload(torch.tensor(src, dtype=torch.long), self.device)
                    ids_t = select_tokens(src_t, ids_t, self.tok_buf)
            with nvtx_range(f"helix.forward_eager[{len(ids)} tokens]"):
                last = meta.cu_q[1:].long() - 1
                logits = self.model(ids_t, meta.q_pos, meta, self.caches, self.backend, last)
            with nvtx_range("helix.sample"):
                sample_into(logits, params, seeds, counters, self.tok_buf)
        with nvtx_range("helix.readback"):
            host = self.host_tokens[self._flip]
            self._flip ^= 1
            host[:n].copy_(self.tok_buf[:n], non_blocking=True)
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
        for i, r in enumerate(batch):
            r.pending += 1
            r.pending_row = i
        self.last_logits = logits
        return _Launched(batch, host, event, len(ids))

    def _resolve(self, step: _Launched) -> dict[int, int]:
        """Wait for a queued step's tokens; append them and apply stop and length rules.
        Rows of requests that ended meanwhile (a stop id one step earlier, an abort) are
        dropped."""
        if step.event is not None:
            step.event.synchronize()
        out = {}
        for r, tok in zip(step.batch, step.host[:len(step.batch)].tolist()):
            r.pending -= 1
            if r.finished:
                continue
            forced = r.params.forced_tokens
            if len(r.output) < len(forced):
                tok = forced[len(r.output)]
            r.output.append(tok)
            out[r.id] = tok
            if tok in self._stop_ids(r.params):
                r.finish_reason = "stop"
            elif (len(r.output) >= r.params.max_new_tokens
                  or r.num_tokens - r.pending >= r.max_len):
                r.finish_reason = "length"
        return out

    def _retire(self) -> list[Request]:
        done = self.scheduler.retire()
        for r in done:
            self.kv_tokens_released += self.kv.local_tokens(r.id)
            self.kv.free(r.id)
            self.seeds.pop(r.id, None)
        return done

    def close(self) -> None:
        """Free the graphs (before any process group is destroyed)."""
        if self.inflight is not None:           # its tokens are never reported: just finish it
            if self.inflight.event is not None:
                self.inflight.event.synchronize()
            self.inflight = None
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    def kv_tokens(self) -> int:
        """KV positions this rank has stored for the run's requests (layer 0), live or finished."""
        return self.kv_tokens_released + sum(self.kv.local_tokens(s) for s in self.kv.lengths)
