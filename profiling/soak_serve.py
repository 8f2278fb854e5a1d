"""A soak through `helix serve` on CPU ranks: thousands of decode steps with requests of random
lengths joining and leaving, checked for leaks and drift.

Clients (asyncio, profiling/http_client.py) keep --clients requests in flight: random prompt
lengths (text or token ids), random max_tokens, streaming or not, greedy or seeded sampling;
some disconnect mid-stream, some are bad requests (must get 400). A fixed greedy probe runs
every --probe-every seconds and its text must never change. Every 2 s the resident memory of
the server, the engine and its worker ranks is sampled with the engine's step count. Ends after
--steps engine steps; then every page must be free again on every rank (LLM.stats()).

    python profiling/soak_serve.py --steps 5000 --out profiling/results/soak_serve.json

--model defaults to a tiny Llama checkpoint with a word-level tokenizer, built into a temporary
directory from the tests' fixtures (tests/hf_fixtures.py, tests/serving_fixtures.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from helix import Layout, RuntimeConfig  # noqa: E402
from profiling import http_client  # noqa: E402

PROBE = "the cat and the dog run fast ."


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: a tiny checkpoint with a tokenizer")
    p.add_argument("--kvp", type=int, default=2)
    p.add_argument("--steps", type=int, default=5000, help="engine steps to run")
    p.add_argument("--clients", type=int, default=10, help="requests kept in flight")
    p.add_argument("--num-pages", type=int, default=40,
                   help="KV pages per rank: small, so requests queue and get preempted")
    p.add_argument("--probe-every", type=float, default=10.0, help="seconds between probes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    return p.parse_args(argv)


def tiny_checkpoint(root: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import hf_fixtures
    import serving_fixtures
    src, _ = hf_fixtures.make_checkpoint(root, "llama")
    return serving_fixtures.checkpoint_with_tokenizer(src, os.path.join(root, "llama-tok"))


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


class Soak:
    def __init__(self, args, server, engine, words: list[str] | None):
        self.args, self.server, self.engine, self.words = args, server, engine, words
        self.rng = random.Random(args.seed)
        self.host, self.port = server.host, server.port
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.probes: list[str] = []
        self.memory: list[dict] = []
        self.steps = 0
        self.stop = False

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def body(self) -> dict:
        r = self.rng
        n = r.randint(1, 48)
        prompt = (" ".join(r.choice(self.words) for _ in range(n)) if self.words and r.random() < .5
                  else [r.randrange(3, 120) for _ in range(n)])
        b = {"model": "soak", "prompt": prompt, "max_tokens": r.randint(1, 48),
             "stream": r.random() < 0.5, "ignore_eos": True}
        if r.random() < 0.3:
            b.update(temperature=0.9, top_p=0.9, seed=r.randrange(1 << 30))
        else:
            b["temperature"] = 0
        return b

    async def client(self) -> None:
        r = self.rng
        while not self.stop:
            if r.random() < 0.03:                                    # a bad request
                reply = await http_client.post(self.host, self.port, "/v1/completions",
                                               {"model": "soak", "prompt": [1, 2],
                                                "max_tokens": 0})
                self.count("bad_request_400" if reply.status == 400 else "bad_request_other")
                continue
            body = self.body()
            leave = r.randint(1, 3) if body["stream"] and r.random() < 0.05 else None
            reply = await http_client.post(self.host, self.port, "/v1/completions", body, leave)
            if leave is not None:
                self.count("disconnected")
            elif reply.status != 200 or reply.error:
                self.count(f"status_{reply.status}")
                self.failures.append(f"{reply.status}: {reply.error}")
            elif len(reply.token_ids) != body["max_tokens"]:
                self.failures.append(f"{len(reply.token_ids)} tokens for max_tokens "
                                     f"{body['max_tokens']}")
            else:
                self.count("ok_stream" if body["stream"] else "ok")

    async def probe(self) -> None:
        while not self.stop:
            reply = await http_client.post(self.host, self.port, "/v1/completions",
                                           {"model": "soak", "prompt": PROBE, "max_tokens": 24,
                                            "temperature": 0, "ignore_eos": True})
            self.probes.append(reply.text if reply.status == 200 else f"<{reply.status}>")
            await asyncio.sleep(self.args.probe_every)

    async def monitor(self) -> None:
        t0 = time.perf_counter()
        while not self.stop:
            stats = await self.engine.stats()
            self.steps = stats["steps"]
            engine_pid = self.engine._proc.pid
            self.memory.append({"t": time.perf_counter() - t0, "steps": self.steps,
                                "server_mb": rss_mb(os.getpid()),
                                "engine_mb": rss_mb(engine_pid),
                                "workers_mb": [rss_mb(p) for p in children(engine_pid)],
                                "kv_pages_used": stats["kv_pages_used"],
                                "running": stats["running"], "queued": stats["queued"]})
            if len(self.memory) % 15 == 0:
                print(f"  {self.steps} steps, {sum(self.counts.values())} requests, "
                      f"{len(self.failures)} failures", flush=True)
            if self.steps >= self.args.steps:
                self.stop = True
            await asyncio.sleep(2.0)

    async def run(self) -> None:
        await asyncio.gather(self.monitor(), self.probe(),
                             *(self.client() for _ in range(self.args.clients)))


def trend(memory: list[dict], key: str) -> dict:
    """First / last RSS and the slope (MB per 1000 steps) after the first fifth (warm-up)."""
    rows = memory[len(memory) // 5:]
    ys = [sum(m[key]) if isinstance(m[key], list) else m[key] for m in rows]
    return {"first_mb": round(ys[0], 1), "last_mb": round(ys[-1], 1),
            "max_mb": round(max(ys), 1),
            "mb_per_1000_steps": round(1000 * slope([m["steps"] for m in rows], ys), 3)}


def main(argv=None) -> dict:
    args = parse(argv)
    from helix.serving.async_engine import AsyncLLM
    from helix.serving.server import HTTPServer, listen
    model = args.model or tiny_checkpoint(tempfile.mkdtemp(prefix="helix-soak-"))
    runtime = RuntimeConfig(page_size=4, max_context=160, max_batch=16, num_pages=args.num_pages,
                            max_prefill_tokens=64)
    from helix.serving.tokenizer import load_tokenizer
    tok = load_tokenizer(model)
    engine = AsyncLLM(model, Layout(kvp=args.kvp), runtime, tok)
    server = HTTPServer(engine, "soak", listen("127.0.0.1", 0)).start()
    words = sorted(tok.hf.get_vocab(), key=tok.hf.get_vocab().get)[2:] if tok else None
    soak = Soak(args, server, engine, words)
    t0 = time.perf_counter()
    try:
        server.call(soak.run())
        deadline = time.time() + 30
        while True:                                   # every request answered: nothing held
            final = server.call(engine.stats())
            if (final["running"], final["queued"], engine.in_flight) == (0, 0, 0) and \
                    not any(final["kv_pages_used"]) or time.time() > deadline:
                break
            time.sleep(0.2)
        metrics = engine.metrics
        seconds = time.perf_counter() - t0
    finally:
        server.stop()
        engine.close()
    result = {
        "config": vars(args), "model": model, "seconds": round(seconds, 1),
        "engine_steps": final["steps"], "requests": soak.counts,
        "finish_reasons": metrics.requests, "generated_tokens": metrics.generated_tokens,
        "failures": soak.failures[:20], "num_failures": len(soak.failures),
        "kv_pages_used_after": final["kv_pages_used"],
        "kv_pages_free_after": final["kv_pages_free"], "num_pages": final["num_pages"],
        "probe_runs": len(soak.probes), "probe_text": soak.probes[0] if soak.probes else None,
        "probe_unchanged": len(set(soak.probes)) == 1,
        "memory": {k: trend(soak.memory, k) for k in ("server_mb", "engine_mb", "workers_mb")},
        "samples": soak.memory,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    mem = result["memory"]
    print(f"soak: {final['steps']} engine steps in {seconds:.0f} s, "
          f"{sum(soak.counts.values())} requests ({soak.counts}), {metrics.generated_tokens} "
          f"tokens; failures {len(soak.failures)}; KV pages used after "
          f"{final['kv_pages_used']} of {final['num_pages']} per rank; probe text unchanged "
          f"over {len(soak.probes)} runs: {result['probe_unchanged']}; RSS MB (first -> last, "
          f"per 1000 steps): server {mem['server_mb']['first_mb']} -> "
          f"{mem['server_mb']['last_mb']} ({mem['server_mb']['mb_per_1000_steps']:+}), engine "
          f"{mem['engine_mb']['first_mb']} -> {mem['engine_mb']['last_mb']} "
          f"({mem['engine_mb']['mb_per_1000_steps']:+}), workers "
          f"{mem['workers_mb']['first_mb']} -> {mem['workers_mb']['last_mb']} "
          f"({mem['workers_mb']['mb_per_1000_steps']:+})")
    return result


if __name__ == "__main__":
    main()
