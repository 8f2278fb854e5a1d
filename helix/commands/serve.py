"""`helix serve`: the OpenAI-compatible HTTP server.

    helix serve MODEL [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
                      [--max-in-flight N] [--kv-dir DIR] [--api-key KEY]
                      [layout and runtime flags]

Routes: /v1/completions, /v1/chat/completions (SSE with "stream": true), /v1/models, /tokenize,
/detokenize, /health, /metrics. SIGINT / SIGTERM end every stream, stop the engine and its ranks,
and exit with one line (130 / 143, as every helix command).
"""

from __future__ import annotations

import logging
import os

from helix.commands.options import add_layout_args, add_runtime_args, configs
from helix.errors import HelixError
from helix.serving.tools import PARSERS

log = logging.getLogger("helix")


def add_parser(subparsers):
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", metavar="MODEL", help="checkpoint directory, preset name or YAML")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: MODEL as given)")
    p.add_argument("--max-in-flight", type=int, default=0,
                   help="requests accepted at once, running and queued; one more gets 429 "
                        "(0: 4 x --max-batch, at least 64)")
    p.add_argument("--kv-dir", default=None,
                   help="directory whose safetensors files requests may import as their "
                        "prompt's KV (field kv_file); default: no KV imports")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="the model's own tool-call syntax, for tool_choice auto (hermes: "
                        "<tool_call>{...}</tool_call>, as Qwen and Hermes models write it)")
    p.add_argument("--api-key", default=os.environ.get("HELIX_API_KEY"),
                   help="clients of the /v1 routes must send 'Authorization: Bearer KEY' "
                        "(default: $HELIX_API_KEY; none: open)")
    add_layout_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run)
    return p


def _imports() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise HelixError(f"helix serve needs {e.name}: pip install 'helix-decode[serve]'") from None


def run(args) -> int:
    from helix.runtime.launch import torchrun_world
    if torchrun_world() is not None:
        raise HelixError("helix serve starts its ranks itself: run it without torchrun (one "
                         "node)")
    _imports()
    from helix.serving.async_engine import AsyncLLM
    from helix.serving.server import HTTPServer, listen
    from helix.serving.tokenizer import load_tokenizer
    if args.max_in_flight < 0:
        raise HelixError(f"--max-in-flight must be >= 0, got {args.max_in_flight}")
    if args.kv_dir is not None and not os.path.isdir(args.kv_dir):
        raise HelixError(f"--kv-dir {args.kv_dir} is not a directory")
    layout, runtime = configs(args)
    tokenizer = load_tokenizer(args.model)
    sock = listen(args.host, args.port)             # a taken port fails before the model loads
    try:
        engine = AsyncLLM(args.model, layout, runtime, tokenizer,
                          max_in_flight=args.max_in_flight or None)
        try:
            server = HTTPServer(engine, args.served_model_name or args.model, sock, args.kv_dir,
                                args.access_log, args.api_key, args.tool_call_parser)
            text = "text and token ids" if tokenizer else "token ids only (no tokenizer)"
            log.info(f"serving {args.model} on {server.url} ({layout.world_size} rank(s), "
                     f"{text})")
            server.run()
        finally:
            engine.close()
    finally:
        sock.close()
    return 0
