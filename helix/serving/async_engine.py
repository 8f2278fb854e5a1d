"""AsyncLLM: the asyncio face of the engine, for servers. Many coroutines submit requests and
iterate their outputs; one engine process (helix/serving/engine_loop.py) owns the LLM and runs
its step loop.

    engine = AsyncLLM("path/to/checkpoint", Layout(kvp=2), RuntimeConfig(...))
    stream = await engine.submit(prompt_ids, SamplingParams(max_new_tokens=32))
    async for out in stream:            # out.token_ids, out.text: what came since the last one
                                        # (out.logprobs too when params.logprobs is set)
        ...                             # out.finish_reason on the last; stream.metrics then
    engine.close()

Backpressure: at most `max_in_flight` requests are accepted at once (running + queued in the
engine + on their way); one more is refused at once with OverloadedError (HTTP 429). A request
that the KV pool could never hold is refused (CapacityError); one that cannot fit now waits in the
engine's queue. A dead engine (a rank died) makes every call raise EngineDeadError naming the
cause, and `health()` say it.

Outputs coalesce: a consumer that falls behind gets every token it missed in its next output,
so a slow client costs the engine nothing and the server's work scales with what it can send.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field

from helix.config import Layout, RuntimeConfig
from helix.errors import CapacityError, EngineDeadError, HelixError, RequestError
from helix.loader import read_model_config
from helix.runtime.logprobs import TokenLogprob
from helix.serving.engine_loop import engine_main, quiet_gc
from helix.serving.metrics import Metrics, RequestMetrics
from helix.serving.stop import StopStrings


class OverloadedError(HelixError):
    """The server holds as many requests as it accepts: retry later (HTTP 429)."""


@dataclass
class StreamOutput:
    """What a request gained since the consumer's last output."""

    token_ids: list[int]
    text: str = ""                   # "" without a tokenizer
    finish_reason: str | None = None   # length | stop | abort | error, on the last output
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None   # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # the prompt's, on the first
                                     # output of a request that asked (None for position 0)
    cached_tokens: int = 0           # prompt positions read from the prefix cache, on the last
                                     # output


@dataclass
class _State:
    tokens: list[int] = field(default_factory=list)   # arrived, not yet consumed
    logprobs: list[TokenLogprob] = field(default_factory=list)   # theirs, when asked
    finish: str | None = None
    error: str | None = None
    cached: int = 0


class RequestStream:
    """One request's outputs as an async iterator; `abort()` ends it (its pages are freed)."""

    def __init__(self, engine: "AsyncLLM", key: int, prompt_len: int, detok, stop=None,
                 logprobs: bool = False, prompt_logprobs: bool = False):
        self.engine, self.key = engine, key
        self.asks_logprobs = logprobs         # outputs carry their tokens' (not kept here:
                                              # result() gathers them)
        self.prompt_logprobs = [None] if prompt_logprobs else None   # arrived so far
        self._prompt_given = False
        self.stop = StopStrings(stop) if stop else None
        self.cut = False                      # ended by a stop string, not by the engine
        self.state = _State()
        self.event = asyncio.Event()
        self.accepted = asyncio.get_running_loop().create_future()
        self.detok = detok
        self.metrics = RequestMetrics(prompt_tokens=prompt_len, arrival=time.perf_counter())
        self.token_ids: list[int] = []        # every token consumed so far
        self.text = ""
        self.done = False

    # engine side (called on the event loop by the dispatcher)
    def _push_token(self, token: int, logprob: TokenLogprob | None = None) -> None:
        if self.metrics.first_token is None:
            self.metrics.first_token = time.perf_counter()
        self.state.tokens.append(token)
        if logprob is not None:
            self.state.logprobs.append(logprob)
        self.event.set()

    def _push_prompt_logprobs(self, logprobs: list[TokenLogprob]) -> None:
        self.prompt_logprobs += logprobs

    def _finish(self, finish: str, error: str | None, cached: int = 0) -> None:
        self.state.finish, self.state.error, self.state.cached = finish, error, cached
        self.metrics.finished = time.perf_counter()
        self.event.set()

    # consumer side
    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamOutput:
        if self.done:
            raise StopAsyncIteration
        while not self.state.tokens and self.state.finish is None:
            self.event.clear()
            await self.event.wait()
        tokens, self.state.tokens = self.state.tokens, []
        logprobs = None
        if self.asks_logprobs:
            logprobs, self.state.logprobs = self.state.logprobs, []
        finish = self.state.finish
        text = self.detok.add(tokens) if self.detok is not None and tokens else ""
        self.token_ids += tokens
        if self.stop is not None:
            text, stopped = self.stop.feed(text, final=finish is not None)
            if stopped and finish != "error":
                self.cut = finish is None              # the engine still runs it: end it there
                finish = self.state.finish = "stop"
                self.metrics.finished = self.metrics.finished or time.perf_counter()
        self.text += text
        if finish is not None:
            self.done = True
            self.metrics.generated_tokens = len(self.token_ids)
            self.engine._finished(self, finish)
        prompt = None
        if self.prompt_logprobs is not None and not self._prompt_given:
            prompt, self._prompt_given = self.prompt_logprobs, True
        return StreamOutput(tokens, text, finish, self.state.error if finish else None,
                            logprobs, prompt, self.state.cached if finish else 0)

    async def result(self) -> StreamOutput:
        """Run to the end: every token and the whole text in one output."""
        logprobs = [] if self.asks_logprobs else None
        async for out in self:
            if logprobs is not None:
                logprobs += out.logprobs
        return StreamOutput(self.token_ids, self.text, self.state.finish, self.state.error,
                            logprobs, self.prompt_logprobs, self.state.cached)

    def abort(self) -> None:
        """End the request now (a client that went away); no-op once finished."""
        if not self.done:
            self.done = True
            self.engine._abort(self)


class AsyncLLM:
    def __init__(self, model: str, layout: Layout | None = None,
                 runtime: RuntimeConfig | None = None, tokenizer=None,
                 max_in_flight: int | None = None, start_timeout_s: float = 600.0,
                 warmup: bool = True):
        """Start the engine process and wait until its LLM is built and warmed up (raises its
        error if it fails). tokenizer: a helix.serving.tokenizer.Tokenizer for text outputs, or
        None. max_in_flight: requests accepted at once (default 4 x max_batch, at least 64).
        warmup: run helix/serving/warmup.py's steps first (kernels compiled before the first
        client)."""
        layout = Layout() if layout is None else layout
        runtime = RuntimeConfig() if runtime is None else runtime
        cfg, _ = read_model_config(model, runtime.layers)   # a bad model or layout: before any
        layout.validate(cfg)                                 # process starts
        self.model, self.layout, self.runtime, self.tokenizer = model, layout, runtime, tokenizer
        self.max_in_flight = max_in_flight or max(64, 4 * runtime.max_batch)
        self.metrics = Metrics(layout.world_size)
        self.dead: str | None = None
        self._keys = itertools.count()
        self._streams: dict[int, RequestStream] = {}
        self._calls: dict[object, asyncio.Future] = {}   # "stats" or a direct run's key
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()
        self._proc = ctx.Process(target=engine_main,
                                 args=(child, model, layout, runtime, warmup),
                                 name="helix-engine")
        self._proc.start()
        child.close()
        try:
            self.info = self._wait_ready(start_timeout_s)
        except BaseException:
            self._proc.kill()
            self._proc.join(5)
            raise
        self._reader = threading.Thread(target=self._read, name="helix-engine-reader",
                                        daemon=True)
        self._reader.start()
        quiet_gc()                                   # this (the server's) process too

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise EngineDeadError(f"the engine process exited with code "
                                      f"{self._proc.exitcode} while starting (its error is above)")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine did not start within {timeout:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:                      # it died before saying why
            self._proc.join(5)
            raise EngineDeadError(f"the engine process exited with code {self._proc.exitcode} "
                                  f"while starting (its error is above)") from None
        if msg[0] == "failed":
            self._proc.join(10)
            raise HelixError(msg[1])
        return msg[1]

    # -- the pipe ---------------------------------------------------------------------------
    def _send(self, msg) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, BrokenPipeError):
            raise EngineDeadError(self.dead or "the engine process is gone") from None

    def _read(self) -> None:
        """Reader thread: engine messages go to the event loop in order, every message that has
        arrived in one call (a busy loop is woken once for several steps)."""
        while True:
            batch = []
            try:
                batch.append(self._conn.recv())
                while batch[-1][0] not in ("closed", "dead") and self._conn.poll():
                    batch.append(self._conn.recv())
            except (EOFError, OSError):
                batch.append(("gone",))
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._dispatch_all, batch)
                except RuntimeError:          # the loop closed meanwhile
                    return
            else:
                for msg in batch:
                    if msg[0] in ("dead", "gone"):
                        self._mark_dead(msg)
            if batch[-1][0] in ("gone", "closed"):
                return

    def _dispatch_all(self, batch: list) -> None:
        for msg in batch:
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        kind = msg[0]
        if kind == "out":
            _, keys, tokens, finished, step, logprobs, scored = msg
            streams = self._streams
            for key, lps in (scored or {}).items():
                s = streams.get(key)
                if s is not None and s.prompt_logprobs is not None:
                    s._push_prompt_logprobs(lps)
            for i, (key, tok) in enumerate(zip(keys, tokens)):
                s = streams.get(key)
                if s is not None:
                    s._push_token(tok, None if logprobs is None else logprobs[i])
            for key, finish, error, cached in finished:
                s = streams.get(key)
                if s is not None:
                    s._finish(finish, error, cached)
            self.metrics.step(*step)
        elif kind == "added":
            s = self._streams.get(msg[1])
            if s is not None and not s.accepted.done():
                s.accepted.set_result(None)
        elif kind == "rejected":
            _, key, why, message = msg
            s = self._streams.pop(key, None)
            if s is not None and not s.accepted.done():
                s.accepted.set_exception((CapacityError if why == "capacity" else
                                          RequestError)(message))
        elif kind == "stats":
            self.metrics.engine = msg[1]
            self._resolve_calls("stats", msg[1])
        elif kind == "direct":
            fut = self._calls.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind in ("dead", "gone", "closed"):
            self._mark_dead(msg)

    def stop(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and end the ones in flight (finish reason "error", `reason`);
        call on the event loop. close() then stops the engine."""
        for key in list(self._streams):
            try:
                self._send(("abort", key))
            except EngineDeadError:
                break
        self._mark_dead(("stop", reason))

    def _mark_dead(self, msg) -> None:
        if self.dead is not None:
            return
        if msg[0] in ("dead", "stop"):
            self.dead = msg[1]
        elif self._closed:
            self.dead = "the engine is shut down"
        else:
            code = self._proc.exitcode
            self.dead = (f"the engine process exited (code {code})" if code is not None
                         else "the engine process closed its pipe")
        for s in list(self._streams.values()):
            if not s.accepted.done():
                s.accepted.set_exception(EngineDeadError(self.dead))
            s._finish("error", self.dead)
        self._streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(self.dead))
        self._calls.clear()

    def _resolve_calls(self, name: str, value) -> None:
        fut = self._calls.pop(name, None)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def bind(self) -> None:
        """Serve the running event loop (the first caller's; a server binds at start-up)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise HelixError("an AsyncLLM serves one event loop: use it from the loop that "
                             "first called it")

    # -- the API ----------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this engine serves (None until bound)."""
        return self._loop

    def health(self) -> str | None:
        """None while the engine serves, else why it does not."""
        if self.dead is None and not self._proc.is_alive():
            self._mark_dead(("gone",))
        return self.dead

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def submit(self, prompt_ids: list[int], params, kv=None,
                     stop: tuple[str, ...] = ()) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it. kv: its
        prompt's KV (helix/kv/transfer.py); stop: strings that end its text (needs the
        tokenizer). Raises RequestError / CapacityError (refused), OverloadedError,
        EngineDeadError."""
        if stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model has none: use "
                               "stop_token_ids")
        self.bind()
        if self.health() is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if len(self._streams) >= self.max_in_flight:
            self.metrics.rejected("overloaded")
            raise OverloadedError(f"the server holds {len(self._streams)} requests, its limit "
                                  f"(max_in_flight): retry later")
        key = next(self._keys)
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        s = RequestStream(self, key, len(prompt_ids), detok, tuple(stop),
                          params is not None and params.logprobs is not None,
                          params is not None and params.prompt_logprobs is not None)
        self._streams[key] = s
        try:
            self._send(("add", key, list(prompt_ids), params, kv))
            await s.accepted
        except asyncio.CancelledError:
            self._abort(s)
            raise
        except (RequestError, CapacityError) as e:
            self.metrics.rejected("capacity" if isinstance(e, CapacityError) else "invalid")
            self._streams.pop(key, None)
            raise
        except EngineDeadError:
            self._streams.pop(key, None)
            raise
        return s

    def _abort(self, s: RequestStream) -> None:
        if self._streams.pop(s.key, None) is not None:
            self.metrics.finished(s.metrics, "abort")
            if self.dead is None:
                try:
                    self._send(("abort", s.key))
                except EngineDeadError:
                    pass

    def _finished(self, s: RequestStream, reason: str) -> None:
        if self._streams.pop(s.key, None) is not None:
            self.metrics.finished(s.metrics, reason)
            if s.cut and self.dead is None:           # a stop string: the engine still runs it
                try:
                    self._send(("abort", s.key))
                except EngineDeadError:
                    pass

    async def stats(self) -> dict:
        """Fresh engine stats: running, queued, KV pages per rank (LLM.stats()), steps."""
        self.bind()
        return await self._call("stats", ("stats",))

    async def reset_prefix_cache(self) -> dict:
        """Drop the prefix cache's idle blocks (LLM.reset_prefix_cache); returns
        {"kv_pages_free": [per rank]} after it."""
        self.bind()
        key = next(self._keys)
        return await self._call(key, ("reset_cache", key))

    async def run_direct(self, prompts: list[list[int]], params) -> dict:
        """The engine's own run of `prompts` (no server in the path): tokens, seconds, steps,
        outputs. Nothing else may run meanwhile (benchmarks)."""
        self.bind()
        key = next(self._keys)
        return await self._call(key, ("direct", key, prompts, params))

    async def _call(self, name, msg):
        if self.health() is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        fut = self._calls.get(name)
        if fut is None:
            fut = self._calls[name] = asyncio.get_running_loop().create_future()
            self._send(msg)
        return await asyncio.shield(fut)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process and its workers (killed if they do not leave in time)."""
        if self._closed:
            return
        self._closed = True
        try:
            with self._send_lock:
                self._conn.send(("shutdown",))
        except (OSError, BrokenPipeError):
            pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
