"""The engine side of AsyncLLM: one process that owns the `LLM` (rank 0, the driver; it spawns the
other ranks) and runs its step loop, talking to the server over a pipe.

Why a process and not a thread of the server: a decode step is ~1 ms on a GPU, and the host's
share of it is Python (schedule, prepare, launch). In one process the HTTP side (parsing, JSON,
socket writes for every client) would hold the GIL while a step waits to be launched; in its own
process the step loop never waits for the server.

Messages (tuples, pickled by multiprocessing's Connection):

  server -> engine   ("add", key, prompt_ids, SamplingParams, kv | None)
                     ("abort", key)        ("stats",)        ("direct", key, prompts, params)
                     ("reset_cache", key)
                     ("shutdown",)
  engine -> server   ("ready", info) | ("failed", message)          once, at start
                     ("added", key) | ("rejected", key, kind, message)   kind: request | capacity
                     ("out", keys, tokens, [(key, finish_reason, error, cached)],
                      (seconds, fed tokens, idle), logprobs, prompt_logprobs)
                                                    once per step with news: tokens[i] is
                                                    the new token of request keys[i]; idle:
                                                    the loop's own seconds since the last
                                                    step ended (0 after a wait for work);
                                                    logprobs: None when no request of the
                                                    step asked, else logprobs[i] is keys[i]'s
                                                    TokenLogprob (None where not asked);
                                                    prompt_logprobs: None, or key -> the
                                                    prompt positions scored this step;
                                                    cached: prompt positions the request
                                                    took from the prefix cache
                     ("stats", LLM.stats() + steps)                  every STATS_INTERVAL_S, and
                                                                     on ("stats",)
                     ("direct", key, result)   ("dead", message)   ("closed",)

Keys are the server's request ids; the LLM's own ids never leave this process. A finished request
is released from the LLM at once (a server runs for weeks). A request whose grammar is not
compiled yet waits here (parked) while it compiles in the background (LLM.prepare_grammar),
and is added when it is ready: the other requests' steps go on meanwhile.
"""

from __future__ import annotations

import atexit
import gc
import logging
import signal
import sys
import time

from helix.errors import CapacityError, EngineDeadError, HelixError, RequestError
from helix.serving.warmup import warm_up

STATS_INTERVAL_S = 1.0      # engine stats pushed at least this often (also a liveness probe)
PARKED_POLL_S = 0.002       # how often an idle loop looks at the grammars compiling


class EngineLoop:
    def __init__(self, llm, conn):
        self.llm, self.conn = llm, conn
        self.rid: dict[int, int] = {}       # server key -> LLM request id
        self.key: dict[int, int] = {}       # LLM request id -> server key
        self.stopping = False
        self.steps = 0
        self.last_stats = 0.0
        self.last_end: float | None = None   # perf_counter when the previous step ended, None
                                             # when the loop waited for work since
        self.parked: list[tuple] = []        # ("add" arguments) waiting for their grammar

    def run(self) -> None:
        """Serve until ("shutdown",), the server's end of the pipe closing, or a dead engine."""
        try:
            while not self.stopping:
                busy = self.llm.has_unfinished()
                wait = 0 if busy else max(0.0, self.last_stats + STATS_INTERVAL_S
                                          - time.monotonic())
                if self.parked:
                    wait = min(wait, PARKED_POLL_S)
                if not busy:
                    self.last_end = None
                if self.conn.poll(wait):
                    self._drain()
                if self.stopping:
                    break
                if self.parked:
                    self._unpark()
                if self.llm.has_unfinished():
                    self._step()
                if time.monotonic() - self.last_stats >= STATS_INTERVAL_S:
                    self._send_stats()
        except EngineDeadError as e:
            self._send(("dead", str(e)))
        except (EOFError, OSError, BrokenPipeError):   # the server is gone: just stop
            pass

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, BrokenPipeError):
            self.stopping = True

    def _drain(self) -> None:
        while not self.stopping and self.conn.poll():
            msg = self.conn.recv()
            getattr(self, "_on_" + msg[0])(*msg[1:])

    # -- commands ---------------------------------------------------------------------------
    def _on_add(self, key: int, prompt, params, kv) -> None:
        grammar = getattr(params, "grammar", None)
        if grammar is not None and not self._grammar_ready(grammar):
            self.parked.append((key, prompt, params, kv))
            return
        try:
            rid = self.llm.add_request(prompt, params, kv=kv)
        except CapacityError as e:
            self._send(("rejected", key, "capacity", str(e)))
            return
        except RequestError as e:
            self._send(("rejected", key, "request", str(e)))
            return
        self.rid[key], self.key[rid] = rid, key
        self._send(("added", key))

    def _grammar_ready(self, grammar) -> bool:
        """Ready to add without waiting; else its compile is started (here and on every
        rank). A spec that is not one is ready: add_request refuses it."""
        try:
            if self.llm.grammar_ready(grammar):
                return True
            self.llm.prepare_grammar(grammar)
        except RequestError:
            return True
        return False

    def _unpark(self) -> None:
        """Add the parked requests whose grammar has compiled (or failed to), in order."""
        waiting, ready = [], []
        for p in self.parked:
            (ready if self.llm.grammar_ready(p[2].grammar) else waiting).append(p)
        self.parked = waiting
        for p in ready:
            self._on_add(*p)

    def _on_abort(self, key: int) -> None:
        self.parked = [p for p in self.parked if p[0] != key]
        rid = self.rid.get(key)
        if rid is not None and rid not in self.llm.finish_reasons:
            self.llm.abort(rid)

    def _on_stats(self) -> None:
        self._send_stats()

    def _on_shutdown(self) -> None:
        self.stopping = True

    def _on_reset_cache(self, key: int) -> None:
        """Drop the idle cached blocks now (a step applies it; running requests advance by
        it), then answer with the pool's state."""
        self.llm.reset_prefix_cache()
        self._step()
        stats = self.llm.stats()
        self._send(("direct", key, {"kv_pages_free": stats["kv_pages_free"]}))

    def _on_direct(self, key: int, prompts, params) -> None:
        """Run `prompts` straight through the LLM, nothing else running (benchmarks: the
        engine's own tokens/s for the same requests the server is then given)."""
        llm = self.llm
        ids = [llm.add_request(p, params) for p in prompts]
        mine = set(ids)
        t0, steps, tokens = time.perf_counter(), 0, 0
        wait0 = llm.engine.wait_seconds
        first = None
        while any(i not in llm.finish_reasons for i in ids):
            out = llm.step()
            steps += 1
            tokens += sum(1 for i in out.tokens if i in mine)
            tokens += sum(len(t) for i, t in (out.more or {}).items() if i in mine)
            if first is None and out.tokens:
                first = time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        outputs = [llm.outputs[i] for i in ids]
        for i in ids:
            llm.release(i)
        self._send(("direct", key, {"tokens": tokens, "seconds": seconds, "steps": steps,
                                    "first_token_s": first, "outputs": outputs,
                                    "device_wait_s": llm.engine.wait_seconds - wait0}))

    # -- steps ------------------------------------------------------------------------------
    def _step(self) -> None:
        llm = self.llm
        start = time.perf_counter()
        idle = 0.0 if self.last_end is None else start - self.last_end
        out = llm.step()
        self.steps += 1
        keys, tokens, finished, logprobs = [], [], [], []
        asked = out.logprobs or {}
        for rid, tok in out.tokens.items():       # a token per request and step, or more
            key = self.key.get(rid)                 # when it verified guesses (no logprobs)
            if key is not None:
                more = (out.more or {}).get(rid, [])
                more_lps = (out.more_logprobs or {}).get(rid) or [None] * len(more)
                for t, lp in zip([tok] + more, [asked.get(rid)] + more_lps):
                    keys.append(key)
                    tokens.append(t)
                    logprobs.append(lp)
        scored = {self.key[rid]: lps for rid, lps in (out.prompt_logprobs or {}).items()
                  if rid in self.key}
        for rid, why in out.finished.items():
            key = self.key.pop(rid, None)
            if key is None:
                continue
            self.rid.pop(key, None)
            finished.append((key, why, (out.errors or {}).get(rid),
                             llm.cached_tokens.get(rid, 0)))
            llm.release(rid)
        if keys or finished or scored:
            self._send(("out", keys, tokens, finished, (out.seconds, out.num_tokens, idle),
                        logprobs if asked else None, scored or None))
        self.last_end = time.perf_counter()

    def _send_stats(self) -> None:
        self.last_stats = time.monotonic()
        stats = self.llm.stats()
        stats["steps"] = self.steps
        self._send(("stats", stats))


def quiet_gc() -> None:
    """Move everything alive after start-up out of the cyclic collector's reach (gc.freeze): a
    full collection then scans only what serving allocates, not torch's and the model's objects.
    Without it a full collection paused every stream of a 32-client run for ~245 ms on the H200
    machine (profiling/results/serve.md). Undone at exit, so the interpreter's shutdown frees
    them as before (extension modules such as Triton's report instances still alive then)."""
    gc.collect()
    gc.freeze()


atexit.register(gc.unfreeze)      # quiet_gc's undo (a no-op where nothing was frozen)


def engine_main(conn, model: str, layout, runtime, warmup: bool = True) -> None:
    """Entry point of the engine process: build the LLM, warm it up (helix/serving/warmup.py),
    say ready (or why not), serve."""
    from helix.runtime.launch import _die_with_parent
    _die_with_parent()                                  # no engine outlives a killed server
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C reaches us too: the server decides
    log = logging.getLogger("helix")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("helix: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    from helix.runtime.llm import LLM
    try:
        llm = LLM(model, layout, runtime)
    except HelixError as e:
        conn.send(("failed", str(e)))
        return
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        return
    try:
        if warmup:
            try:
                steps, seconds = warm_up(llm)
            except HelixError as e:
                conn.send(("failed", f"the warm-up failed: {e}"))
                return
            log.info(f"warm-up: {steps} steps in {seconds:.1f} s")
        quiet_gc()
        info = {"vocab_size": llm.cfg.vocab_size, "max_context": llm.max_context,
                "world_size": layout.world_size, "num_pages": llm.stats()["num_pages"],
                "longest_request": llm.longest_request}
        conn.send(("ready", info))
        EngineLoop(llm, conn).run()
    finally:
        llm.close()
        try:
            conn.send(("closed",))
        except (OSError, BrokenPipeError):
            pass
