"""The user-facing runtime (rank 0, the driver): add requests, step, abort, generate.

    with LLM("tiny-llama", Layout(kvp=2, tpa=1)) as llm:
        rid = llm.add_request([5, 17, 42], SamplingParams(max_new_tokens=8))
        while llm.has_unfinished():
            out = llm.step()            # every running request advances by one token
        print(llm.outputs[rid])         # llm.logprobs[rid] too, if its params asked for them

Requests may join and leave between steps. With a world of N > 1 ranks, LLM spawns N - 1 local
workers itself (or, under torchrun, ranks > 0 serve inside the constructor and exit after
close()). Each step rank 0 broadcasts the step's commands; every rank then runs the same step.

Every request field is checked in add_request (one-line RequestError / CapacityError naming the
field and the fix); a request that fails inside a step ends with finish reason "error" (its
message in `errors`) and the others go on. A dead or hung rank, or a failure the engine cannot
confine, raises EngineDeadError once; the LLM then refuses work. close() always completes: it
kills workers that do not leave in time. step() is not re-entrant: a call while another thread
is inside step() is refused.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import sys
import threading
import time

import torch

from helix.config import Layout, RuntimeConfig
from helix.errors import CapacityError, ConfigError, EngineDeadError, HelixError, RequestError
from helix.loader import read_model_config
from helix.parallel.comm import LocalComm
from helix.parallel.mesh import Mesh
from helix.runtime.engine import Engine, StepOutput
from helix.runtime.grammar import check_spec
from helix.runtime.launch import (free_port, init_distributed, process_state, rank_device,
                                  rendezvous, torchrun_world, worker_context, worker_main)
from helix.runtime.logprobs import TokenLogprob
from helix.runtime.sampling import SamplingParams
from helix.runtime.worker import make_engine, serve

log = logging.getLogger("helix")

_open_multi_rank: list["LLM"] = []        # the multi-rank LLM open in this process (at most one)


class LLM:
    def __init__(self, model: str, layout: Layout | None = None,
                 runtime: RuntimeConfig | None = None):
        layout = Layout() if layout is None else layout
        runtime = RuntimeConfig() if runtime is None else runtime
        if not isinstance(layout, Layout) or not isinstance(runtime, RuntimeConfig):
            raise ConfigError("LLM(model, layout, runtime) takes a helix.Layout and a "
                              "helix.RuntimeConfig")
        self._closed, self._dead, self._broken = True, None, False   # until started
        self._procs: list = []
        cfg, ckpt = read_model_config(model, runtime.layers)   # bad model: fails before any
                                                               # process starts
        layout.validate(cfg)                          # bad layout: likewise
        world = layout.world_size
        launched = torchrun_world()
        if launched is not None and launched != world:
            raise ConfigError(f"torchrun started {launched} ranks but the layout needs {world}: "
                              f"set --nproc-per-node / --nnodes to {world}, or change the layout")
        if runtime.device == "cuda":
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if have < (1 if launched else world):
                raise ConfigError(f"layout needs {world} GPUs, {have} visible: use --device cpu or "
                                  f"a smaller layout")
        self.max_context = runtime.resolved_max_context(cfg)
        if self.max_context > cfg.max_position:
            raise ConfigError(f"max_context {self.max_context} exceeds the model's "
                              f"{cfg.max_position} positions: lower --max-context")
        if world > 1 and _open_multi_rank:
            raise HelixError("another multi-rank LLM is open in this process: close() it first "
                             "(one process holds one torch.distributed world)")
        self.cfg, self.layout, self.runtime = cfg, layout, runtime
        self._ids = itertools.count()
        self._pending: list[tuple] = []
        self._step_lock = threading.Lock()
        self.outputs: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}   # requests with params.logprobs set:
                                                            # one per output token
        self.prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}   # params.prompt_logprobs
                                                    # set: one per prompt token (None first)
        self.finish_reasons: dict[int, str] = {}
        self.errors: dict[int, str] = {}
        self.cached_tokens: dict[int, int] = {}   # request id -> prompt positions taken from
                                                  # the prefix cache (only requests with a hit)
        self._multi = world > 1
        self._closed = False
        if world == 1:
            self.engine = Engine(model, cfg, ckpt, layout, runtime, LocalComm(Mesh(layout, 0)),
                                 rank_device(runtime, 0), ranks_here=1)
        else:
            _open_multi_rank.append(self)
            try:
                if launched:
                    self._start_torchrun(model, layout, runtime)
                else:
                    self._start_local(model, layout, runtime)
            except BaseException:
                self._closed = True
                _open_multi_rank.remove(self)
                raise
        log.info(self.engine.pool.describe(runtime.page_size, self.max_context, layout.kvp,
                                           str(runtime.torch_kv_dtype).removeprefix("torch.")))

    # -- start-up ------------------------------------------------------------------------------
    def _start_torchrun(self, model, layout, runtime):
        rank = int(os.environ["RANK"])
        device = rank_device(runtime, int(os.environ.get("LOCAL_RANK", rank)))
        init_distributed(rank, layout.world_size, runtime, device)
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
        if rank != 0:
            code = serve(model, layout, runtime, device, ranks_here)
            sys.exit(code)
        self.engine = make_engine(model, layout, runtime, device, ranks_here)
        self.engine.comm.barrier()

    def _start_local(self, model, layout, runtime):
        world, port = layout.world_size, free_port()
        threads = max(1, (os.cpu_count() or 1) // world) if runtime.device == "cpu" else 4
        ctx = worker_context()
        env = dict(os.environ)
        for r in range(1, world):
            p = ctx.Process(target=worker_main, daemon=True,
                            args=(r, world, model, layout, runtime, "127.0.0.1", port, threads,
                                  env))
            p.start()
            self._procs.append(p)
        self._saved_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        threading.Thread(target=self._watch_workers, daemon=True).start()
        try:
            device = rank_device(runtime, 0)
            store = rendezvous("127.0.0.1", port, 0, world, runtime.timeout_s,
                               dead=lambda: "; ".join(self._dead_workers()))
            init_distributed(0, world, runtime, device, store)
            self.engine = self._guarded(make_engine, model, layout, runtime, device, world)
            self._guarded(self.engine.comm.barrier)
        except BaseException:
            self._kill_workers()
            self._teardown_distributed(graceful=False)
            torch.set_num_threads(self._saved_threads)
            raise

    def _watch_workers(self):
        """A worker that dies makes the driver's next (or current) collective fail at once
        instead of hanging: its process groups are aborted; the driver reports the rank."""
        while not self._closed and self._dead is None:
            dead = self._dead_workers()
            if dead:
                comm = getattr(getattr(self, "engine", None), "comm", None)
                if comm is not None:
                    comm.abort()
                return
            time.sleep(0.1)

    def _dead_workers(self) -> list[str]:
        """'rank r exited with code c' / 'rank r is stopped' for every worker not running."""
        out = []
        for r, p in enumerate(self._procs, start=1):
            if p.exitcode is not None:
                out.append(f"rank {r} exited with code {p.exitcode}")
            elif process_state(p.pid) == "T":
                out.append(f"rank {r} is stopped (SIGSTOP)")
        return out

    def _guarded(self, fn, *args):
        """Run a driver-side collective (or a step); a failure because a worker died, hung or
        stopped, or one the engine could not confine, becomes EngineDeadError naming the cause.
        The LLM then refuses work."""
        try:
            return fn(*args)
        except (EngineDeadError, RuntimeError) as e:
            if not self._multi and not isinstance(e, EngineDeadError):
                raise
            dead = []
            if self._multi:
                time.sleep(0.3)                  # let a dead worker's exit code land
                dead = self._dead_workers()
            if dead:                             # the root cause, whatever rank 0 saw
                why = f"{'; '.join(dead)} (its error is above)"
            elif isinstance(e, EngineDeadError):
                why = str(e)
            else:
                why = f"a collective failed: {str(e).splitlines()[0]}"
            raise self._fail(why) from None

    def _fail(self, why: str) -> EngineDeadError:
        self._dead = why
        self._broken = True
        for rid in self.outputs:
            if rid not in self.finish_reasons:
                self.finish_reasons[rid] = "error"
                self.errors[rid] = why
        self._kill_workers()
        return EngineDeadError(f"the engine stopped: {why}; the run is over, start a new LLM")

    def _kill_workers(self):
        for p in self._procs:
            if p.is_alive():
                p.kill()

    # -- requests ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise HelixError("this LLM is closed: create a new one")
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped earlier: {self._dead}; start a new LLM")

    def add_request(self, prompt_ids, params: SamplingParams | None = None,
                    synthetic_prefix: int = 0, kv=None) -> int:
        """Queue a request; it joins the batch at the next step. Returns its id.
        synthetic_prefix: positions of arbitrary KV placed before the prompt, with no prefill
        (long-context decode benchmarks: the KV is read at full cost, its values are noise).
        kv: the KV of the prompt's positions 0..T-1 from a prefill server (a dict or a
        safetensors file, format in helix/kv/transfer.py); those positions are not prefilled,
        each rank keeps the ones it owns."""
        self._check_open()
        checked = self._check_request(prompt_ids, params, synthetic_prefix)
        if checked[1].prompt_logprobs is not None and (synthetic_prefix or kv is not None):
            raise RequestError("prompt_logprobs needs the whole prompt prefilled here: drop "
                               "synthetic_prefix / kv, or prompt_logprobs")
        imported = None if kv is None else self._check_kv(kv, checked[0], synthetic_prefix)
        rid = self._queue(*checked)
        if imported is not None:
            self._pending.append(("kv", rid, imported))
        return rid

    def _check_kv(self, kv, prompt: list[int], prefix: int):
        from helix.kv.transfer import check_kv
        if prefix:
            raise RequestError("kv and synthetic_prefix exclude each other: give one")
        imported = check_kv(kv, self.cfg)
        if imported.length > len(prompt):
            raise RequestError(f"kv covers {imported.length} positions, the prompt has "
                               f"{len(prompt)} tokens: give the KV of the prompt's positions "
                               f"0..T-1, T <= {len(prompt)}")
        return imported

    def export_kv(self, request_id: int, length: int | None = None) -> dict:
        """The KV of a running request's positions [0, length) (default: all it has written),
        gathered from every rank, in helix/kv/transfer.py's format: what a decode server
        takes as add_request(..., kv=). Export after its prefill, before it finishes."""
        from helix.kv.transfer import assemble
        self._check_open()
        if request_id not in self.outputs:
            raise RequestError(f"no request {request_id!r}")
        held = self.engine.kv.lengths.get(request_id, 0)    # global length, the same on all ranks
        if not held:
            raise RequestError(f"request {request_id} holds no KV now (waiting, preempted or "
                               f"finished): export it while it runs, after its prefill")
        length = held if length is None else length
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= held:
            raise RequestError(f"length must be an integer in [1, {held}], got {length!r}")
        parts = self._gather("export_kv", lambda: self.engine.export_kv(request_id, length),
                             request_id, length)
        return assemble(parts, self.cfg, length)

    @property
    def longest_request(self) -> int:
        """The most positions (prompt + generated) one request can hold: the maximum context,
        or less where the KV pool holds less."""
        sched, lo, hi = self.engine.scheduler, 1, self.max_context
        while lo < hi:                                  # the largest length whose pages fit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sched.pages_for(mid) <= sched.num_pages else (lo, mid - 1)
        return lo

    def _check_request(self, prompt_ids, params, prefix: int = 0
                       ) -> tuple[list[int], SamplingParams, int, int]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a helix.SamplingParams, got "
                               f"{type(params).__name__}")
        params.check_vocab(self.cfg.vocab_size)
        if params.priority and self.runtime.scheduling != "priority":
            raise RequestError(f"priority {params.priority} needs priority scheduling: start "
                               f"with --scheduling priority (RuntimeConfig(scheduling="
                               f"'priority')), or leave priority at 0")
        if params.grammar is not None:          # compiled here first: a bad one is refused now
            self.engine.grammars.compile(params.grammar)
        prompt = self._check_prompt(prompt_ids, prefix)
        max_len = min(prefix + len(prompt) + params.max_new_tokens, self.max_context)
        sched = self.engine.scheduler
        need = sched.pages_for(max_len)
        if need > sched.num_pages:
            raise CapacityError(f"request needs {need} KV pages per rank ({max_len} positions), "
                                f"the pool has {sched.num_pages}: lower --max-new-tokens or the "
                                f"prompt, add KVP ranks, or raise --memory-utilization")
        return prompt, params, max_len, prefix

    def _queue(self, prompt: list[int], params: SamplingParams, max_len: int, prefix: int) -> int:
        rid = next(self._ids)
        self._pending.append(("add", rid, prompt, params, max_len, prefix))
        self.outputs[rid] = []
        if params.logprobs is not None:
            self.logprobs[rid] = []
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[rid] = [None]
        return rid

    def _check_prompt(self, prompt_ids, prefix: int = 0) -> list[int]:
        try:
            given = list(prompt_ids)
        except TypeError:
            raise RequestError(f"prompt ids must be a list of integers, got "
                               f"{type(prompt_ids).__name__}") from None
        if not given:
            raise RequestError("empty prompt: give at least one token id")
        prompt = []
        for t in given:                      # ints (numpy / torch integers too), not 1.5 or "7"
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise RequestError(f"prompt ids must be integers, got {t!r}")
            prompt.append(operator.index(t))
        out = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if out:
            raise RequestError(f"token id {out[0]} is outside the vocabulary "
                               f"[0, {self.cfg.vocab_size})")
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise RequestError(f"synthetic_prefix must be a non-negative integer, got {prefix!r}")
        if prefix + len(prompt) >= self.max_context:
            raise RequestError(f"prompt of {prefix + len(prompt)} tokens does not fit the maximum "
                               f"context of {self.max_context}: shorten it or raise --max-context")
        return prompt

    def abort(self, request_id: int) -> None:
        """End a request at the next step (finish reason "abort"); its pages are freed."""
        self._check_open()
        if request_id not in self.outputs:
            raise RequestError(f"no request {request_id!r}")
        self._pending.append(("abort", request_id))

    def release(self, request_id: int) -> None:
        """Forget a finished request (its outputs, log-probabilities, finish reason, error): a
        long-running server calls this for every request it has answered, or these dicts would
        only grow."""
        if request_id in self.outputs and request_id not in self.finish_reasons:
            raise RequestError(f"request {request_id} has not finished: abort() it first")
        for d in (self.outputs, self.logprobs, self.prompt_logprobs, self.finish_reasons,
                  self.errors, self.cached_tokens):
            d.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or any(r not in self.finish_reasons for r in self.outputs)

    def step(self) -> StepOutput:
        """Advance every running request by one token (new requests run their prompt, in
        chunks of at most max_prefill_tokens)."""
        if not self._step_lock.acquire(blocking=False):
            raise HelixError("step() is already running in another thread: an LLM is driven by "
                             "one thread (use helix.serving's AsyncLLM to serve many callers)")
        try:
            self._check_open()
            commands, self._pending = self._pending, []
            self._broken = True                  # until the step completes on every rank
            if self._multi:
                self._guarded(self.engine.comm.broadcast_object, ("step", commands))
            out = self._guarded(self.engine.step, commands)
            self._broken = False
        finally:
            self._step_lock.release()
        for rid, tok in out.tokens.items():
            self.outputs[rid].append(tok)
        for rid, toks in (out.more or {}).items():
            self.outputs[rid] += toks
        for rid, lp in (out.logprobs or {}).items():
            self.logprobs[rid].append(lp)
        for rid, lps in (out.more_logprobs or {}).items():
            self.logprobs[rid] += lps
        for rid, lps in (out.prompt_logprobs or {}).items():
            self.prompt_logprobs[rid] += lps
        self.finish_reasons.update(out.finished)
        self.errors.update(out.errors or {})
        self.cached_tokens.update(out.cached or {})
        return out

    def prepare_grammar(self, grammar) -> None:
        """Start compiling a grammar (SamplingParams.grammar) in the background, here and on
        every rank (told with the next step): a request that uses it, added once
        `grammar_ready`, does not hold the steps up while it compiles."""
        self._check_open()
        spec = check_spec(grammar)
        self.engine.grammars.prepare(spec)
        if self._multi:
            self._pending.append(("grammar", spec))

    def grammar_ready(self, grammar) -> bool:
        """Whether adding a request with this grammar would not wait for its compile."""
        return self.engine.grammars.ready(check_spec(grammar))

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache's idle blocks (their pages return to the pool) at the next
        step; blocks a running request holds stay. For benchmarks that must prefill every prompt,
        or after the weights' meaning changed."""
        self._check_open()
        self._pending.append(("reset_cache",))

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[list[int]]:
        """Run the prompts as one batch to completion; returns the generated ids per prompt."""
        self._check_open()
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):  # zip would silently drop prompts
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params: "
                               f"give one SamplingParams, or one per prompt")
        checked = [self._check_request(p, sp) for p, sp in zip(prompts, params)]  # all or none
        ids = [self._queue(*c) for c in checked]
        while any(i not in self.finish_reasons for i in ids):
            self.step()
        return [self.outputs[i] for i in ids]

    def _gather(self, what: str, local, *args) -> list:
        """A control-plane query answered by every rank."""
        if not self._multi:
            return [local()]
        self._guarded(self.engine.comm.broadcast_object, (what, *args))
        return self._guarded(self.engine.comm.gather_object, local())

    def kv_tokens_per_rank(self) -> list[int]:
        """KV positions (layer 0) each rank stored for this run's requests."""
        self._check_open()
        return self._gather("kv_tokens", self.engine.kv_tokens)

    def prefill_tokens_per_rank(self) -> list[int]:
        """Prompt tokens each rank projected (context-parallel prefill: the positions it owns)."""
        self._check_open()
        return self._gather("prefill_tokens", lambda: self.engine.prefill_tokens)

    def stats(self) -> dict:
        """Running and queued requests, KV pages per rank (used, free, total), pages of idle
        prefix-cache blocks (counted free) and the cache's prompt positions looked up and found
        (first admissions); rank 0's steps
        launched and the host seconds it spent waiting for the device's tokens (the rest of a
        step's wall time is host work); speculative decoding's guesses verified and kept."""
        self._check_open()
        per_rank = self._gather("stats", self.engine.stats)
        s = per_rank[0]
        return {"running": s["running"], "queued": s["queued"], "num_pages": s["num_pages"],
                "kv_pages_used": [r["kv_pages_used"] for r in per_rank],
                "kv_pages_free": [r["kv_pages_free"] for r in per_rank],
                "kv_pages_cached": s["pages_cached"], "preemptions": s["preemptions"],
                "prefix_cache_queries": s["prefix_cache_queries"],
                "prefix_cache_hits": s["prefix_cache_hits"],
                "prefix_cache_host_hits": s["prefix_cache_host_hits"],
                "host_blocks_cached": s["host_blocks_cached"],
                "engine_steps": s["steps"], "device_wait_s": s["device_wait_s"],
                "speculative_draft_tokens": s["speculative_draft_tokens"],
                "speculative_accepted_tokens": s["speculative_accepted_tokens"]}

    # -- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine and its workers down. Always completes: workers that do not leave in
        time (or a run interrupted mid-step) are killed."""
        if self._closed:
            return
        self._closed = True
        graceful = self._multi and not self._broken and self._dead is None
        try:
            if graceful:
                self.engine.comm.broadcast_object(("shutdown",))
        except Exception:
            graceful = False
        if self._multi and not graceful:     # before the groups go: a worker whose peer
            self._kill_workers()              # vanished mid-collective would report it
        try:
            self.engine.close()
        except Exception:
            pass
        if self._multi:
            self._teardown_distributed(graceful)
            for p in self._procs:
                p.join(timeout=5 if graceful else 0.5)
            self._kill_workers()
            for p in self._procs:
                p.join(timeout=5)
            if hasattr(self, "_saved_threads"):
                torch.set_num_threads(self._saved_threads)
            if self in _open_multi_rank:
                _open_multi_rank.remove(self)

    def _teardown_distributed(self, graceful: bool) -> None:
        comm = getattr(getattr(self, "engine", None), "comm", None)
        try:
            if comm is not None:
                comm.close(graceful)
            else:
                import torch.distributed as dist
                if dist.is_initialized():
                    dist.destroy_process_group()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed and self._multi:
                self.close()
        except Exception:
            pass
