"""Serving: text in and out (tokenizer.py), a streaming iterator over an LLM (stream.py), the
asyncio engine for servers (async_engine.py, engine_loop.py) and the OpenAI-compatible HTTP API
(app.py, server.py, protocol.py, metrics.py; `helix serve`). The HTTP modules need the `serve`
extra (Starlette, uvicorn) and are not imported here."""

from helix.serving.async_engine import AsyncLLM, OverloadedError, RequestStream, StreamOutput
from helix.serving.stream import Delta, stream
from helix.serving.tokenizer import Tokenizer, load_tokenizer

__all__ = ["AsyncLLM", "Delta", "OverloadedError", "RequestStream", "StreamOutput", "Tokenizer",
           "load_tokenizer", "stream"]
