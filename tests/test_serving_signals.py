"""`helix serve` as a user runs it (a subprocess, two CPU ranks): SIGINT and SIGTERM while a
client streams end the server with one line and no traceback, the stream ends, and the engine
process and its worker rank are gone."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from proc_helpers import alive, descendants

pytest.importorskip("uvicorn")


@pytest.mark.parametrize("sig,code,line", [(signal.SIGINT, 130, "helix: interrupted"),
                                           (signal.SIGTERM, 143, "helix: terminated")])
def test_signal_stops_the_server_and_every_rank(sig, code, line):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "helix.cli", "serve", "tiny-llama", "--kvp",
                             "2", "--port", "0", "--device", "cpu", "--max-context", "2048",
                             "--page-size", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        err = []
        while True:                                  # "helix: serving ... on http://h:p (...)"
            ln = proc.stderr.readline()
            assert ln, "".join(err)
            err.append(ln)
            m = re.search(r"on http://([\d.]+):(\d+)", ln)
            if m:
                break
        family = descendants(proc.pid)
        body = json.dumps({"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 1500,
                           "stream": True, "ignore_eos": True}).encode()
        s = socket.create_connection((m.group(1), int(m.group(2))))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:               # streaming
            got += s.recv(65536)
        proc.send_signal(sig)
        t0 = time.time()
        s.settimeout(15)
        while True:                                   # the stream ends (an error event, EOF)
            chunk = s.recv(65536)
            got += chunk
            if not chunk or b"[DONE]" in got:
                break
        s.close()
        _, rest = proc.communicate(timeout=30)
        assert time.time() - t0 < 15
    finally:
        proc.kill()
    assert b"shutting down" in got
    assert proc.returncode == code
    lines = [ln for ln in ("".join(err) + rest).strip().splitlines()
             if not ln.startswith(("helix: KV pool", "helix: serving", "helix: warm-up"))]
    assert lines == [line], lines
    time.sleep(0.5)
    assert len(family) >= 2 and not any(alive(p) for p in family)
