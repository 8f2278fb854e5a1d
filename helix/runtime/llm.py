"""The user-facing runtime (rank 0, the driver): add requests, step, abort, generate.

    llm = LLM("tiny-llama", Layout(kvp=2, tpa=1))
    rid = llm.add_request([5, 17, 42], SamplingParams(max_new_tokens=8))
    while llm.has_unfinished():
        out = llm.step()            # every running request advances by one token
    llm.close()

Requests may join and leave between steps. With a world of N > 1 ranks, LLM spawns N - 1 local
workers itself (or, under torchrun, ranks > 0 serve inside the constructor and exit after
close()). Each step rank 0 broadcasts the step's commands; every rank then runs the same step.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

from helix.config import Layout, RuntimeConfig
from helix.errors import CapacityError, ConfigError, RequestError
from helix.loader import read_model_config
from helix.parallel.comm import LocalComm
from helix.parallel.mesh import Mesh
from helix.runtime.engine import Engine, StepOutput
from helix.runtime.launch import free_port, init_distributed, rank_device, under_torchrun, worker_main
from helix.runtime.sampling import SamplingParams
from helix.runtime.worker import make_engine, serve


class LLM:
    def __init__(self, model: str, layout: Layout | None = None, runtime: RuntimeConfig | None = None):
        layout = layout or Layout()
        runtime = runtime or RuntimeConfig()
        cfg, ckpt = read_model_config(model, runtime.layers)   # bad model: fails before any process starts
        layout.validate(cfg)                          # bad layout: likewise
        world = layout.world_size
        if runtime.device == "cuda":
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if have < (1 if under_torchrun() else world):
                raise ConfigError(f"layout needs {world} GPUs, {have} visible: use --device cpu or "
                                  f"a smaller layout")
        self.max_context = runtime.resolved_max_context(cfg)
        if self.max_context > cfg.max_position:
            raise ConfigError(f"max_context {self.max_context} exceeds the model's "
                              f"{cfg.max_position} positions: lower --max-context")
        self.cfg, self.layout, self.runtime = cfg, layout, runtime
        self._procs: list = []
        self._ids = itertools.count()
        self._pending: list[tuple] = []
        self.outputs: dict[int, list[int]] = {}
        self.finish_reasons: dict[int, str] = {}
        self._closed = False
        if world == 1:
            self.engine = Engine(model, cfg, ckpt, layout, runtime, LocalComm(Mesh(layout, 0)),
                                 rank_device(runtime, 0))
        elif under_torchrun():
            self._start_torchrun(model, layout, runtime)
        else:
            self._start_local(model, layout, runtime)

    # -- start-up ------------------------------------------------------------------------------
    def _start_torchrun(self, model, layout, runtime):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != layout.world_size:
            raise ConfigError(f"torchrun started {world} ranks but the layout needs "
                              f"{layout.world_size}: set --nproc-per-node / --nnodes to match")
        device = rank_device(runtime, int(os.environ.get("LOCAL_RANK", rank)))
        init_distributed(rank, world, runtime, device)
        if rank != 0:
            serve(model, layout, runtime, device)
            sys.exit(0)
        self.engine = make_engine(model, layout, runtime, device)
        self.engine.comm.barrier()

    def _start_local(self, model, layout, runtime):
        world, port = layout.world_size, free_port()
        threads = max(1, (os.cpu_count() or 1) // world) if runtime.device == "cpu" else 4
        ctx = mp.get_context("spawn")
        for r in range(1, world):
            p = ctx.Process(target=worker_main, daemon=True,
                            args=(r, world, model, layout, runtime, "127.0.0.1", port, threads))
            p.start()
            self._procs.append(p)
        threading.Thread(target=self._watch_workers, daemon=True).start()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        self._saved_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            device = rank_device(runtime, 0)
            init_distributed(0, world, runtime, device)
            self.engine = make_engine(model, layout, runtime, device)
            self._guarded(self.engine.comm.barrier)
        except BaseException:
            self._kill_workers()
            raise

    def _watch_workers(self):
        """A worker that dies ends the run with a clear error instead of a hang in a collective."""
        while not self._closed:
            for r, p in enumerate(self._procs, start=1):
                if p.exitcode not in (None, 0) and not self._closed:
                    print(f"helix: rank {r} exited with code {p.exitcode} (its error is above); "
                          f"ending the run", file=sys.stderr, flush=True)
                    self._kill_workers()
                    os._exit(1)
            time.sleep(0.2)

    def _guarded(self, fn, *args):
        """Run a driver-side collective; if it fails because a worker died, say which rank."""
        try:
            return fn(*args)
        except RuntimeError:
            time.sleep(0.5)  # let the dead worker's exit code land
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs, start=1)
                    if p.exitcode not in (None, 0)]
            if dead:
                self._kill_workers()
                raise RuntimeError(f"rank {dead[0][0]} exited with code {dead[0][1]} (its error is "
                                   f"above); the run is over") from None
            raise

    def _kill_workers(self):
        for p in self._procs:
            if p.is_alive():
                p.kill()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None,
                    synthetic_prefix: int = 0) -> int:
        """Queue a request; it joins the batch at the next step. Returns its id.
        synthetic_prefix: positions of arbitrary KV placed before the prompt, with no prefill
        (long-context decode benchmarks: the KV is read at full cost, its values are noise)."""
        return self._queue(*self._check_request(prompt_ids, params, synthetic_prefix))

    def _check_request(self, prompt_ids, params, prefix: int = 0
                       ) -> tuple[list[int], SamplingParams, int, int]:
        params = params or SamplingParams()
        prompt = self._check_prompt(prompt_ids, prefix)
        max_len = min(prefix + len(prompt) + params.max_new_tokens, self.max_context)
        sched = self.engine.scheduler
        if sched.pages_for(max_len) > sched.num_pages:
            raise CapacityError(f"request needs {sched.pages_for(max_len)} KV pages per rank, the "
                                f"pool has {sched.num_pages}: raise --num-pages, lower "
                                f"--max-new-tokens, or add KVP ranks")
        return prompt, params, max_len, prefix

    def _queue(self, prompt: list[int], params: SamplingParams, max_len: int, prefix: int) -> int:
        rid = next(self._ids)
        self._pending.append(("add", rid, prompt, params, max_len, prefix))
        self.outputs[rid] = []
        return rid

    def _check_prompt(self, prompt_ids, prefix: int = 0) -> list[int]:
        try:
            given = list(prompt_ids)
            prompt = [int(t) for t in given]
        except (TypeError, ValueError):
            prompt = None
        if prompt is None or any(p != t for p, t in zip(prompt, given)):  # 1.5 or "7" is not an id
            raise RequestError("prompt ids must be integers")
        if not prompt:
            raise RequestError("empty prompt: give at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if not isinstance(prefix, int) or prefix < 0:
            raise RequestError(f"synthetic_prefix must be a non-negative integer, got {prefix!r}")
        if prefix + len(prompt) >= self.max_context:
            raise RequestError(f"prompt of {prefix + len(prompt)} tokens does not fit the maximum "
                               f"context of {self.max_context}: shorten it or raise --max-context")
        return prompt

    def abort(self, request_id: int) -> None:
        self._pending.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or any(r not in self.finish_reasons for r in self.outputs)

    def step(self) -> StepOutput:
        """Advance every running request by one token (new requests run their prompt)."""
        commands, self._pending = self._pending, []
        if self._procs or under_torchrun():
            self._guarded(self.engine.comm.broadcast_object, ("step", commands))
        out = self.engine.step(commands)
        for rid, tok in out.tokens.items():
            self.outputs[rid].append(tok)
        self.finish_reasons.update(out.finished)
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[list[int]]:
        """Run the prompts as one batch to completion; returns the generated ids per prompt."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):  # zip would silently drop prompts
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params: give one "
                               f"SamplingParams, or one per prompt")
        checked = [self._check_request(p, sp) for p, sp in zip(prompts, params)]  # all or none
        ids = [self._queue(*c) for c in checked]
        while any(i not in self.finish_reasons for i in ids):
            self.step()
        return [self.outputs[i] for i in ids]

    def kv_tokens_per_rank(self) -> list[int]:
        """KV positions (layer 0) each rank stored for this run's requests."""
        if self._procs or under_torchrun():
            self._guarded(self.engine.comm.broadcast_object, ("kv_tokens",))
            return self._guarded(self.engine.comm.gather_object, self.engine.kv_tokens())
        return [self.engine.kv_tokens()]

    # -- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._procs or under_torchrun():
            self.engine.comm.broadcast_object(("shutdown",))
            self.engine.close()
            self.engine.comm.close()
            for p in self._procs:
                p.join(timeout=30)
            self._kill_workers()
            if hasattr(self, "_saved_threads"):
                torch.set_num_threads(self._saved_threads)
        else:
            self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
