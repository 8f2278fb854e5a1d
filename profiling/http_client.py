"""A dependency-free asyncio HTTP/1.1 client for the serving benchmarks (bench_serve.py,
soak_serve.py): POST a JSON body to `helix serve`, read the JSON reply or the server-sent events
of a stream, with the arrival time of every event. Standard library only, so a bench machine
without httpx / openai runs it (uvloop's event loop where installed: `run`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from dataclasses import dataclass, field


def run(coro):
    """asyncio.run on uvloop's loop when it is installed, with the cyclic garbage collector off
    meanwhile (a client reading ~30K events a second must not be the bottleneck it measures,
    nor pause to scan the events it keeps), else the standard loop."""
    gc.disable()
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coro)
        return uvloop.run(coro)
    finally:
        gc.enable()


@dataclass
class Reply:
    status: int
    sent: float                                  # perf_counter when the request was written
    body: dict | None = None                     # the JSON reply (non-streaming, or an error)
    events: list[tuple[float, dict]] = field(default_factory=list)   # (arrival, event)
    done: float | None = None                    # when the reply ended

    @property
    def token_ids(self) -> list[int]:
        if self.body is not None and "choices" in self.body:
            return self.body["choices"][0].get("token_ids", [])
        return [t for _, e in self.events for c in e.get("choices", ())
                for t in c.get("token_ids", ())]

    @property
    def text(self) -> str:
        if self.body is not None and "choices" in self.body:
            c = self.body["choices"][0]
            return c["message"]["content"] if "message" in c else c["text"]
        out = []
        for _, e in self.events:
            for c in e.get("choices", ()):
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        return "".join(out)

    @property
    def error(self) -> str | None:
        if self.body is not None and "error" in self.body:
            return self.body["error"]["message"]
        for _, e in self.events:
            if "error" in e:
                return e["error"]["message"]
        return None


async def _read_chunked(reader: asyncio.StreamReader):
    """Yields the chunks of a chunked transfer-encoded body."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def post(host: str, port: int, path: str, body: dict, abort_after: int | None = None
               ) -> Reply:
    """POST `body`; a streaming reply is read event by event. abort_after: close the connection
    after that many events (a client that goes away mid-stream)."""
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n" % (path.encode(),
                                                                        host.encode(), len(data))
                 + data)
    reply = Reply(0, time.perf_counter())
    try:
        await writer.drain()
        status = await reader.readline()
        reply.status = int(status.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        chunks = (_read_chunked(reader) if headers.get("transfer-encoding") == "chunked"
                  else None)
        if not headers.get("content-type", "").startswith("text/event-stream"):
            raw = (b"".join([c async for c in chunks]) if chunks is not None else
                   await reader.readexactly(int(headers.get("content-length", 0))))
            reply.body = json.loads(raw) if raw else None
            return reply
        buf = b""
        async for chunk in chunks if chunks is not None else _until_eof(reader):
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = event[len(b"data: "):]
                if payload == b"[DONE]":
                    return reply
                reply.events.append((time.perf_counter(), json.loads(payload)))
                if abort_after is not None and len(reply.events) >= abort_after:
                    return reply
        return reply
    finally:
        reply.done = time.perf_counter()
        writer.close()


async def _until_eof(reader: asyncio.StreamReader):
    while data := await reader.read(65536):
        yield data


async def get(host: str, port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET %s HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n"
                 % (path.encode(), host.encode()))
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size.split(b";")[0], 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return int(head.split()[1]), body.decode()
