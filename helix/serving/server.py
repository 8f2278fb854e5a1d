"""Running the HTTP API: a listening socket, uvicorn on it, and a stop that ends every stream at
once (a signal, or `stop()` from another thread), so shutdown never waits on a long generation.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time

import uvicorn

from helix.errors import HelixError
from helix.serving.app import OpenAIServer
from helix.serving.async_engine import AsyncLLM

GRACE_S = 5.0        # after a stop, connections still open are cancelled after this long


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: a free one), or a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise HelixError(f"port {port} on {host} is in use: pick another --port") from None
        raise HelixError(f"cannot listen on {host}:{port}: {e.strerror}: check --host") from None
    sock.listen(2048)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn whose exit (signal or should_exit) first ends the engine's streams."""

    def __init__(self, config, engine: AsyncLLM):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        loop = self.engine.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.engine.stop)


class HTTPServer:
    """The API on a socket. run() blocks (the main thread: SIGINT / SIGTERM stop it);
    start() runs it in a thread (tests, benchmarks) until stop()."""

    def __init__(self, engine: AsyncLLM, name: str, sock: socket.socket,
                 kv_dir: str | None = None, access_log: bool = False,
                 api_key: str | None = None, tool_parser: str | None = None):
        self.engine, self.sock = engine, sock
        self.host, self.port = sock.getsockname()[:2]
        app = OpenAIServer(engine, name, kv_dir, api_key, tool_parser).app()
        config = uvicorn.Config(app, log_level="warning", access_log=access_log,
                                timeout_graceful_shutdown=GRACE_S, lifespan="on")
        self.server = _Uvicorn(config, engine)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout_s: float = 30.0) -> "HTTPServer":
        self.thread = threading.Thread(target=self.run, name="helix-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise HelixError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def call(self, coro, timeout_s: float | None = None):
        """Run a coroutine (e.g. engine.stats()) on the server's event loop from another
        thread; returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.engine.loop).result(timeout_s)

    def stop(self) -> None:
        """End every stream, stop serving, join the thread (the engine stays: close it)."""
        loop = self.engine.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.engine.stop)
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(GRACE_S + 5)
