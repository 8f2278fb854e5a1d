"""The OpenAI-compatible HTTP API over an AsyncLLM (Starlette): /v1/completions and
/v1/chat/completions (JSON, or server-sent events with "stream": true), /v1/models, vLLM's
/tokenize and /detokenize, /health, /metrics (Prometheus text).

A request that asks for log-probabilities gets them in each choice's (or chunk's) "logprobs", in
the endpoint's OpenAI shape: {tokens, token_logprobs, top_logprobs, text_offset} for
completions, {content: [{token, logprob, bytes, top_logprobs}]} for chat. Token strings are the
tokenizer's text of each id alone, "token_id:<id>" for a model without a tokenizer; -inf (and
NaN) are sent as -9999.0, as JSON has no infinity.

With n > 1 the n choices are n engine requests of the same prompt (each prefills it: there is no
KV sharing between requests), run side by side; a seeded request's choice i draws with seed + i.
A completions batch (prompt: a list of prompts) has n choices per prompt, prompt by prompt.
Streamed chunks name their choice ("index"); a choice that fails ends the others.

With an API key (`helix serve --api-key`, or HELIX_API_KEY), every /v1 route asks for
"Authorization: Bearer <key>" (401 without it); /health and /metrics stay open (probes,
scrapers).

Errors are OpenAI-shaped, {"error": {"message", "type", "param", "code"}}: 400 for a bad field
(named in "param"), 404 for an unknown model, 429 when the server holds as many requests as it
accepts, 503 when the engine is dead (the message names the rank) or shutting down. A client
that disconnects (streaming or not) aborts its request, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from helix.errors import CapacityError, EngineDeadError, RequestError
from helix.serving.async_engine import AsyncLLM, OverloadedError
from helix.serving.protocol import FieldError, parse_chat, parse_completion, token_ids_field
from helix.serving.tools import call_id

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


# first word of an LLM.add_request error -> the request field it is about
ENGINE_FIELDS = {"prompt": "prompt", "kv": "kv_file", "stop_token_ids": "stop_token_ids",
                 "token": "prompt", "logit_bias": "logit_bias"}


def error(status: int, message: str, kind: str, param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _refusal(e: Exception) -> JSONResponse:
    """The response for an exception raised while taking a request."""
    if isinstance(e, FieldError):
        return error(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, CapacityError):           # "request needs N pages ...: <CLI advice>"
        fact = str(e).split(":")[0]
        return error(400, f"{fact}: lower max_tokens or shorten the prompt",
                     "invalid_request_error", "max_tokens")
    if isinstance(e, RequestError):             # the LLM's own checks: name the request field
        word = str(e).split(" ", 1)[0]
        return error(400, str(e), "invalid_request_error", ENGINE_FIELDS.get(word))
    if isinstance(e, OverloadedError):
        return error(429, str(e), "overloaded_error", code="overloaded")
    if isinstance(e, EngineDeadError):
        return error(503, str(e), "engine_dead", code="engine_dead")
    raise e


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the request body is read already)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class EventStream(Response):
    """Server-sent events from an async iterator of bytes; a client that disconnects cancels
    the iteration and aborts the request."""

    def __init__(self, events, stream):
        self.events, self.stream = events, stream
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def pump():
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        sender = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sender, watcher):
                t.cancel()
            self.stream.abort()                       # no-op when it finished
        if sender.done() and not sender.cancelled():
            exc = sender.exception()
            if exc is not None and not isinstance(exc, OSError):   # OSError: the client left
                raise exc


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class OpenAIServer:
    """The routes; one per served model name."""

    def __init__(self, engine: AsyncLLM, name: str, kv_dir: str | None = None,
                 api_key: str | None = None, tool_parser: str | None = None):
        self.engine, self.name, self.kv_dir = engine, name, kv_dir
        self.tool_parser = tool_parser            # tool_choice auto's call syntax (tools.py)
        self.api_key = None if not api_key else ("Bearer " + api_key).encode()
        self.created = int(time.time())
        self.vocab = engine.info["vocab_size"]

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.bind()                   # engine messages reach this loop from now on
            yield

        return Starlette(lifespan=lifespan, routes=[
            Route("/v1/completions", self._authorized(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._authorized(self.chat), methods=["POST"]),
            Route("/v1/models", self._authorized(self.models), methods=["GET"]),
            Route("/tokenize", self._authorized(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._authorized(self.detokenize), methods=["POST"]),
            Route("/reset_prefix_cache", self._authorized(self.reset_prefix_cache),
                  methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])

    def _authorized(self, route):
        """The route, behind the API key when the server has one."""
        if self.api_key is None:
            return route

        async def checked(request: Request) -> Response:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.api_key):
                return error(401, "a valid API key is needed: send the header 'Authorization: "
                                  "Bearer <key>' with the server's --api-key",
                             "invalid_request_error", code="invalid_api_key")
            return await route(request)
        return checked

    # -- plain routes -------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created, "owned_by": "helix",
            "max_model_len": self.engine.info["max_context"]}]})

    async def health(self, request: Request) -> Response:
        why = self.engine.health()
        if why is not None:
            return error(503, why, "engine_dead", code="engine_dead")
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        up = self.engine.health() is None
        if up:
            try:
                await asyncio.wait_for(self.engine.stats(), timeout=1.0)
            except (asyncio.TimeoutError, EngineDeadError):
                up = self.engine.health() is None      # stale stats, still rendered
        return PlainTextResponse(self.engine.metrics.render(self.engine.in_flight, up),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's /reset_prefix_cache: idle cached blocks dropped (running requests keep
        theirs); answers with the KV pages free after it, per rank."""
        try:
            return JSONResponse(await self.engine.reset_prefix_cache())
        except EngineDeadError as e:
            return error(503, str(e), "engine_dead", code="engine_dead")

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (through the chat
        template) -> {"tokens", "count", "max_model_len"}."""
        body, bad = await self._body(request)
        if bad is not None:
            return bad
        tok = self.engine.tokenizer
        try:
            if "messages" in body:
                ids = self._parse_chat(body, tok, self.vocab).prompts[0]
            else:
                text = body.get("prompt")
                if not isinstance(text, str):
                    raise FieldError("prompt", "prompt must be a string (or send messages)")
                if tok is None:
                    raise FieldError("prompt", "this model has no tokenizer (a preset): it "
                                               "takes token ids")
                ids = tok.encode(text)
        except RequestError as e:
            return _refusal(e)
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": self.engine.info["max_context"]})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        body, bad = await self._body(request)
        if bad is not None:
            return bad
        try:
            if self.engine.tokenizer is None:
                raise FieldError("tokens", "this model has no tokenizer (a preset)")
            ids = token_ids_field(body.get("tokens"), "tokens", self.vocab)
        except RequestError as e:
            return _refusal(e)
        return JSONResponse({"prompt": self.engine.tokenizer.decode(ids)})

    async def _body(self, request: Request) -> tuple[dict | None, Response | None]:
        """The request's JSON object, or the 400 / 404 response for a bad body or model."""
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            return None, error(400, f"the request body is not valid JSON: {e}",
                               "invalid_request_error")
        if not isinstance(body, dict):
            return None, error(400, "the request body must be a JSON object",
                               "invalid_request_error")
        if body.get("model") not in (None, self.name):
            return None, error(404, f"model {body.get('model')!r} not found: this server "
                                    f"serves {self.name!r}", "invalid_request_error", "model",
                               "model_not_found")
        return body, None

    # -- generation ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, self._parse_chat, chat=True)

    def _parse_chat(self, body, tokenizer, vocab: int, kv_dir: str | None = None):
        return parse_chat(body, tokenizer, vocab, kv_dir, self.tool_parser)

    async def _generate(self, request: Request, parse, chat: bool) -> Response:
        body, bad = await self._body(request)
        if bad is not None:
            return bad
        choices = _Choices([])
        try:
            parsed = parse(body, self.engine.tokenizer, self.vocab, self.kv_dir)
            asked = parsed.choices(self.engine.info["longest_request"])
            if len(asked) > self.engine.max_in_flight:
                raise FieldError("n" if len(parsed.prompts) == 1 else "prompt",
                                 f"{len(asked)} choices are more than this server holds at "
                                 f"once ({self.engine.max_in_flight}): lower n or send fewer "
                                 f"prompts")
            for ids, params in asked:                  # choice i = the i-th request
                choices.streams.append(await self.engine.submit(ids, params, parsed.kv,
                                                                parsed.stop))
        except (RequestError, CapacityError, OverloadedError, EngineDeadError) as e:
            choices.abort()
            return _refusal(e)
        except BaseException:                          # cancelled: the client went away
            choices.abort()
            raise
        echo = None if parsed.echo is None else [
            (ids, text) for ids, text in zip(parsed.prompts, parsed.echo) for _ in range(parsed.n)]
        fmt = _Format(chat, self.name, sum(map(len, parsed.prompts)), self.engine.tokenizer,
                      len(asked), echo, parsed.score_only, parsed.n, parsed.tools)
        if parsed.stream:
            return EventStream(fmt.events(choices, parsed.include_usage), choices)
        return await self._complete(request, choices, fmt)

    async def _complete(self, request: Request, choices: "_Choices", fmt: "_Format") -> Response:
        done = asyncio.ensure_future(asyncio.gather(*(s.result() for s in choices.streams)))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not done.done():                           # the client went away: free its pages
            done.cancel()
            choices.abort()
            return Response(status_code=499)
        outs = done.result()
        failed = next((out for out in outs if out.finish_reason == "error"), None)
        if failed is not None:
            dead = self.engine.health()
            if dead is not None:
                return error(503, failed.error or dead, "engine_dead", code="engine_dead")
            return error(500, failed.error or "the request failed", "server_error")
        return JSONResponse(fmt.whole(outs))


class _Choices:
    """The streams of one request's n choices (one engine request each); abort() ends them."""

    def __init__(self, streams: list):
        self.streams = streams

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    async def merged(self):
        """(choice index, output) as they come, from every choice until each has finished."""
        if len(self.streams) == 1:              # one choice: no task per output
            async for out in self.streams[0]:
                yield 0, out
            return
        nexts = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self.streams)}
        try:
            while nexts:
                done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
                for t in sorted(done, key=nexts.get):
                    i = nexts.pop(t)
                    try:
                        out = t.result()
                    except StopAsyncIteration:
                        continue
                    if out.finish_reason is None:
                        nexts[asyncio.ensure_future(anext(self.streams[i]))] = i
                    yield i, out
        finally:
            for t in nexts:
                t.cancel()


LOGPROB_FLOOR = -9999.0        # what -inf (or NaN) is sent as


def _finite(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR        # NaN > floor is False


class _Format:
    """OpenAI response bodies for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, tokenizer=None, n: int = 1,
                 echo: list[tuple[list[int], str]] | None = None, score_only: bool = False,
                 per_prompt: int = 1, tools=None):
        """n: choices; echo: each choice's prompt (ids, text) to put first; score_only: echo
        with max_tokens 0 (the generated token is dropped); per_prompt: choices of each prompt
        (choice i is prompt i // per_prompt's); tools: a chat's ToolRequest (its outputs are
        tool calls when its tool_choice asks for one)."""
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.tokenizer, self.n, self.per_prompt = tokenizer, n, per_prompt
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.cached = 0                       # prompt tokens read from the prefix cache: each
                                              # prompt's first choice's
        self.echo, self.score_only = echo, score_only
        self._echoed: set[int] = set()        # choices whose prompt went out
        self.text_offset = [0] * n            # completions' text_offset of each choice's next
                                              # token
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._chunk_head = _sse(self._head("chat.completion.chunk" if chat else
                                           "text_completion"))[:-3] + b',"choices":['

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def _count_cached(self, i: int, out) -> None:
        if i % self.per_prompt == 0:
            self.cached += out.cached_tokens

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _token(self, t: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{t}"
        return self.tokenizer.token_text(t)

    def _parts(self, i: int, out) -> tuple[str, list[int], list[int], list | None]:
        """(text, generated ids, ids its logprobs name, logprobs) of an output of choice i:
        with echo the prompt comes before its first output, with score_only no generated
        token."""
        text, ids, lps = out.text, out.token_ids, out.logprobs
        if self.score_only:
            text, ids, lps = "", [], None if lps is None else []
        lp_ids = ids
        if self.echo is not None and i not in self._echoed:
            self._echoed.add(i)
            prompt_ids, prompt_text = self.echo[i]
            text, lp_ids = prompt_text + text, prompt_ids + ids
            if lps is not None:
                lps = (out.prompt_logprobs or [None] * len(prompt_ids)) + lps
        return text, ids, lp_ids, lps

    def logprobs(self, ids: list[int], lps, index: int = 0) -> dict | None:
        """The "logprobs" of choice `index` (or its chunk) for these tokens (None when not
        asked; an entry None, an echoed prompt's first token, has none)."""
        if lps is None:
            return None
        if self.chat:
            def entry(t, lp):
                s = self._token(t)
                return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}
            return {"content": [{**entry(t, lp.logprob),
                                 "top_logprobs": [entry(a, v) for a, v in lp.top]}
                                for t, lp in zip(ids, lps)]}
        tokens = [self._token(t) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(self.text_offset[index])
            self.text_offset[index] += len(s)
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else _finite(lp.logprob) for lp in lps],
                "top_logprobs": [None if lp is None else
                                 {self._token(a): _finite(v) for a, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def whole(self, outs: list) -> dict:
        """The response body of the finished choices."""
        choices, generated = [], 0
        for i, out in enumerate(outs):
            text, ids, lp_ids, lps = self._parts(i, out)
            generated += len(ids)
            self._count_cached(i, out)
            choice = {"index": i, "finish_reason": out.finish_reason,
                      "logprobs": self.logprobs(lp_ids, lps, i), "token_ids": ids}
            content, calls = self._split(text, out.finish_reason)
            if calls is not None:
                choice["message"] = {"role": "assistant", "content": content or None,
                                     "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._head(self.object), "choices": choices, "usage": self.usage(generated)}

    def _split(self, text: str, finish: str | None) -> tuple[str, list[dict] | None]:
        """(content, tool calls) of a finished output: the calls a tool_choice asked for (the
        whole output), or those the model made in its own syntax (auto; content: the text
        before them); (text, None) without calls, or when max_tokens cut one short."""
        if self.tools is None or finish == "error":
            return text, None
        if self.tools.parser is not None:
            return self.tools.parser.split(text)
        calls = self.tools.calls(text) if finish == "stop" else None
        return ("", calls) if calls is not None else (text, None)

    def argument_chunk(self, text: str, ids: list[int], finish: str | None, first: bool,
                       index: int) -> bytes:
        """A streamed fragment of a named function's arguments (the first names the call)."""
        call = {"index": 0, "function": {"arguments": text}}
        if first:
            call = {"index": 0, "id": call_id(), "type": "function",
                    "function": {"name": self.tools.name, "arguments": text}}
        return self._sse_choice({"index": index, "logprobs": None, "token_ids": ids,
                                 "finish_reason": "tool_calls" if finish == "stop" else finish,
                                 "delta": {"tool_calls": [call]}})

    def tool_chunk(self, calls: list[dict], ids: list[int], index: int) -> bytes:
        """A streamed choice's tool calls, whole, with its finish."""
        delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return self._sse_choice({"index": index, "finish_reason": "tool_calls",
                                 "logprobs": None, "token_ids": ids, "delta": delta})

    def chunk(self, text: str, ids: list[int], finish: str | None, first: bool = False,
              lp_ids: list[int] = (), logprobs=None, index: int = 0) -> bytes:
        choice = {"index": index, "finish_reason": finish,
                  "logprobs": self.logprobs(list(lp_ids), logprobs, index), "token_ids": ids}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if first
                               else {"content": text} if text or finish is None else {})
        else:
            choice["text"] = text
        return self._sse_choice(choice)

    def _sse_choice(self, choice: dict) -> bytes:
        """= _sse({**head, "choices": [choice]}); the head's JSON is made once per request."""
        return self._chunk_head + json.dumps(choice, separators=(",", ":")).encode() + b"]}\n\n"

    async def events(self, choices: _Choices, include_usage: bool):
        """The SSE body: chunks as tokens arrive (each naming its choice), an error event if a
        choice failed (the others end there), the usage chunk if asked for, then [DONE]."""
        if self.chat:
            for i in range(self.n):
                yield self.chunk("", [], None, first=True, index=i)
        n = 0
        # with tools: each choice's text so far, how much of it went out, its ids not sent yet
        held = [["", 0, []] for _ in range(self.n)]
        async with contextlib.aclosing(choices.merged()) as merged:
            async for i, out in merged:
                text, ids, lp_ids, lps = self._parts(i, out)
                n += len(ids)
                self._count_cached(i, out)
                if self.tools is not None and self.tools.mode == "named" and \
                        out.finish_reason != "error":   # the arguments stream as they come
                    yield self.argument_chunk(text, ids, out.finish_reason, not held[i][1], i)
                    held[i][1] = 1
                    continue
                if self.tools is not None and out.finish_reason != "error":
                    h = held[i]
                    h[0], h[2] = h[0] + text, h[2] + ids
                    if out.finish_reason is None:
                        k = self.tools.parser.safe(h[0]) if self.tools.parser else 0
                        if k > h[1]:
                            yield self.chunk(h[0][h[1]:k], h[2], None, index=i)
                            h[1], h[2] = k, []
                        continue
                    content, calls = self._split(h[0], out.finish_reason)
                    if calls is not None:
                        if len(content) > h[1]:
                            yield self.chunk(content[h[1]:], [], None, index=i)
                        yield self.tool_chunk(calls, h[2], i)
                        continue
                    text, ids = h[0][h[1]:], h[2]
                if out.finish_reason == "error":
                    if ids or text:
                        yield self.chunk(text, ids, None, False, lp_ids, lps, i)
                    yield _sse({"error": {"message": out.error or "the request failed",
                                          "type": "server_error", "param": None, "code": None}})
                    choices.abort()
                    break
                yield self.chunk(text, ids, out.finish_reason, False, lp_ids, lps, i)
        if include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            yield _sse({**self._head(obj), "choices": [], "usage": self.usage(n)})
        yield b"data: [DONE]\n\n"
