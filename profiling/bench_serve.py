"""Tokens/s through `helix serve` against the engine's own, for the same requests in the same run.

One engine (its own process, as `helix serve` runs it) and the HTTP server (uvicorn in a thread
of this process). Each round: (1) the engine alone runs the C requests straight through its step
loop (AsyncLLM.run_direct: no HTTP, no asyncio), then (2) C concurrent streaming clients send
the same requests (greedy, ignore_eos, fixed max_tokens) through HTTP from other processes (a
standard-library asyncio client, profiling/http_client.py; the streams spread over
--client-procs processes, since one Python client reads ~20 us an event and is most of a core
at 32 x 1,000 events a second), and record every event's arrival. Reported per round and as medians:
delivered tokens/s (tokens the clients received / wall time from the first request sent to the
last token received) against the engine's tokens/s (`ratio`, target >= 0.9), TTFT and time per
output token percentiles as the clients see them, tokens per SSE event (> 1: the server
coalesced), the engine's mean step time alone and while serving (LLM.step wall time, from the
engine's own reports), the engine loop's time between steps, the CPU share of the server and
client processes, and whether the HTTP tokens equal the direct run's.

    python profiling/bench_serve.py --out profiling/results/bench_serve.json    # one H200
    python profiling/bench_serve.py --smoke                                     # CPU, tiny

Needs starlette and uvicorn (+ h11, click, anyio, sniffio, idna); httptools and uvloop make
uvicorn faster when present. No openai / httpx / transformers (a preset has no tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix import Layout, RuntimeConfig, SamplingParams  # noqa: E402
from profiling import http_client  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kvp", type=int, default=1)
    p.add_argument("--tpa", type=int, default=1)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--client-procs", type=lambda v: [int(x) for x in v.split(",")],
                   default=[4], help="client processes the streams are spread over; a comma "
                   "list runs each round once per value (a Python client reads ~20 us an "
                   "event: one process at 32 x 1,000 events/s is most of a core)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-llama, 4 clients, 8 tokens, 1 round, one client process in a "
                   "thread")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.layers, args.device, args.dtype = "tiny-llama", 0, "cpu", "float32"
        args.clients, args.prompt_len, args.max_tokens, args.rounds = 4, 8, 8, 1
        args.max_context = 64
    return args


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """n distinct prompts of `length` ids (deterministic)."""
    return [[(97 * i + 31 * j + 7) % (vocab - 3) + 3 for j in range(length)] for i in range(n)]


def pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, int(p * len(s)))]
    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": statistics.fmean(s),
            "max": s[-1]}


def run_clients(host: str, port: int, model: str, prompts, max_tokens: int,
                start=None) -> dict:
    """Every prompt as one streaming request at once (after `start`, a barrier shared with the
    other client processes); per request: send time, event arrivals, tokens; and this
    process's CPU seconds against its wall seconds."""
    async def one(p):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        r = await http_client.post(host, port, "/v1/completions", body)
        return {"status": r.status, "sent": r.sent, "done": r.done, "error": r.error,
                "times": [t for t, e in r.events if e.get("choices")],
                "counts": [len(e["choices"][0].get("token_ids", ())) for _, e in r.events
                           if e.get("choices")],
                "token_ids": r.token_ids}

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))
    if start is not None:
        start.wait()
    wall, cpu = time.perf_counter(), time.process_time()
    reqs = http_client.run(main())
    return {"reqs": reqs, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


def _client_process(q, i, *args):
    q.put((i, run_clients(*args)))


def clients_elsewhere(host, port, model, prompts, max_tokens, procs: int, in_thread: bool
                      ) -> tuple[list[dict], list[float]]:
    """run_clients in `procs` other processes, prompt i in process i % procs, all starting
    together (their Python does not compete with the server's, nor with each other's), or in a
    thread (smoke). Returns the requests in prompt order and each process's CPU / wall."""
    if in_thread:
        box = []
        t = threading.Thread(target=lambda: box.append(run_clients(host, port, model, prompts,
                                                                   max_tokens)))
        t.start()
        t.join()
        return box[0]["reqs"], [box[0]["cpu_s"] / box[0]["wall_s"]]
    ctx = mp.get_context("spawn")
    q, start = ctx.Queue(), ctx.Barrier(procs)
    group = [prompts[i::procs] for i in range(procs)]
    ps = [ctx.Process(target=_client_process, args=(q, i, host, port, model, group[i],
                                                    max_tokens, start))
          for i in range(procs)]
    for p in ps:
        p.start()
    got = dict(q.get() for _ in ps)
    for p in ps:
        p.join()
    reqs: list = [None] * len(prompts)
    for i in range(procs):
        reqs[i::procs] = got[i]["reqs"]
    return reqs, [got[i]["cpu_s"] / got[i]["wall_s"] for i in range(procs)]


def summarize_http(reqs: list[dict]) -> dict:
    t0 = min(r["sent"] for r in reqs)
    t1 = max(r["times"][-1] for r in reqs if r["times"])
    tokens = sum(sum(r["counts"]) for r in reqs)
    ttft = [r["times"][0] - r["sent"] for r in reqs if r["times"]]
    tpot, gaps = [], []
    for r in reqs:
        n = sum(r["counts"])
        if n > 1:
            tpot.append((r["times"][-1] - r["times"][0]) / (n - 1))
        gaps += [b - a for a, b in zip(r["times"], r["times"][1:])]
    events = sum(len(r["times"]) for r in reqs)
    return {"tokens": tokens, "seconds": t1 - t0, "tokens_per_s": tokens / (t1 - t0),
            "errors": [r["error"] for r in reqs if r["error"] or r["status"] != 200],
            "ttft_s": pct(ttft), "tpot_s": pct(tpot), "event_gap_s": pct(gaps),
            "tokens_per_event": tokens / max(1, events)}


def http_round(server, engine, args, prompts, procs: int, direct: dict) -> tuple[dict, bool]:
    """The same requests through HTTP; with the engine's own view of that run (steps, step
    time, its loop's time between steps, device wait, slowest step) and the CPU share of the
    server process (uvicorn's thread, the pipe reader) and of each client process."""
    m = engine.metrics
    before = (m.steps, m.step_seconds, m.idle_seconds)
    m.slowest = (0.0, 0, 0)
    wait0 = server.call(engine.stats())["device_wait_s"]
    wall, cpu = time.perf_counter(), time.process_time()
    reqs, client_cpu = clients_elsewhere(server.host, server.port, args.model, prompts,
                                         args.max_tokens, procs, args.smoke and procs == 1)
    server_cpu = (time.process_time() - cpu) / (time.perf_counter() - wall)
    http = summarize_http(reqs)
    steps = m.steps - before[0]
    http["engine_steps"] = steps
    http["engine_step_ms"] = 1e3 * (m.step_seconds - before[1]) / max(1, steps)
    http["engine_idle_ms"] = 1e3 * (m.idle_seconds - before[2]) / max(1, steps)
    http["slowest_step"] = {"ms": 1e3 * m.slowest[0], "tokens": m.slowest[1],
                            "step": m.slowest[2] - before[0]}
    # of which waiting for the device (the rest: host work in the step)
    http["device_wait_ms"] = 1e3 * (server.call(engine.stats())["device_wait_s"]
                                    - wait0) / max(1, steps)
    http["server_cpu"], http["client_cpu"] = server_cpu, client_cpu
    return http, [r["token_ids"] for r in reqs] == direct["outputs"]


def main(argv=None) -> dict:
    args = parse(argv)
    from helix.serving.async_engine import AsyncLLM
    from helix.serving.server import HTTPServer, listen
    layout = Layout(kvp=args.kvp, tpa=args.tpa)
    runtime = RuntimeConfig(device=args.device, dtype=args.dtype, layers=args.layers,
                            max_context=args.max_context, max_batch=max(64, args.clients),
                            page_size=16)
    t_start = time.perf_counter()
    engine = AsyncLLM(args.model, layout, runtime, max_in_flight=4 * args.clients)
    server = HTTPServer(engine, args.model, listen("127.0.0.1", 0)).start()
    startup_s = time.perf_counter() - t_start
    prompts = make_prompts(args.clients, args.prompt_len, engine.info["vocab_size"])
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    rounds = []
    try:
        server.call(engine.run_direct(prompts[:2], SamplingParams(max_new_tokens=8,
                                                                 ignore_eos=True)))  # warm-up
        for i in range(args.rounds):
            direct = server.call(engine.run_direct(prompts, params))
            d_tps = direct["tokens"] / direct["seconds"]
            direct["step_ms"] = 1e3 * direct["seconds"] / max(1, direct["steps"])
            direct["device_wait_ms"] = 1e3 * direct["device_wait_s"] / max(1, direct["steps"])
            rec = {"direct": {k: direct[k] for k in ("tokens", "seconds", "steps",
                                                     "first_token_s", "step_ms",
                                                     "device_wait_ms")},
                   "direct_tokens_per_s": d_tps}
            for procs in args.client_procs:
                http, same = http_round(server, engine, args, prompts, procs, direct)
                rec[f"http_{procs}"] = http
                rec.setdefault("ratio", http["tokens_per_s"] / d_tps)   # the first value's
                rec[f"ratio_{procs}"] = http["tokens_per_s"] / d_tps
                rec[f"same_tokens_{procs}"] = same
                print(f"round {i}, {procs} client processes: engine {d_tps:,.0f} tok/s, "
                      f"through HTTP {http['tokens_per_s']:,.0f} tok/s "
                      f"({http['tokens_per_s'] / d_tps:.1%}), TTFT p50 "
                      f"{http['ttft_s']['p50'] * 1e3:.1f} ms, TPOT p50 "
                      f"{http['tpot_s']['p50'] * 1e3:.3f} ms, {http['tokens_per_event']:.2f} "
                      f"tokens per event; engine step {direct['step_ms']:.3f} ms alone (device "
                      f"wait {direct['device_wait_ms']:.3f}), {http['engine_step_ms']:.3f} ms "
                      f"serving (device wait {http['device_wait_ms']:.3f}, loop between steps "
                      f"{http['engine_idle_ms']:.3f}), slowest step "
                      f"{http['slowest_step']['ms']:.1f} ms ({http['slowest_step']['tokens']} "
                      f"tokens, step {http['slowest_step']['step']}); CPU busy: server "
                      f"{http['server_cpu']:.0%}, clients "
                      f"{max(http['client_cpu']):.0%} (busiest); same tokens {same}",
                      flush=True)
            rounds.append(rec)
        stats = server.call(engine.stats())
    finally:
        server.stop()
        engine.close()
    result = {"config": vars(args), "layout": layout.as_dict(), "startup_s": startup_s,
              "rounds": rounds, "ratio_median": statistics.median(r["ratio"] for r in rounds),
              "pages_used_after": stats["kv_pages_used"]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    r = rounds[len(rounds) // 2]
    r = {**r, "http": r[f"http_{args.client_procs[0]}"]}
    print(f"summary: {args.clients} streaming clients, {args.model} ({args.layers or 'all'} "
          f"layers) on {args.device}: HTTP delivered {result['ratio_median']:.1%} of the "
          f"engine's tokens/s (median of {len(rounds)} rounds; target >= 90 %); TTFT p50/p99 "
          f"{r['http']['ttft_s']['p50'] * 1e3:.1f}/{r['http']['ttft_s']['p99'] * 1e3:.1f} ms, "
          f"TPOT p50/p99 {r['http']['tpot_s']['p50'] * 1e3:.3f}/"
          f"{r['http']['tpot_s']['p99'] * 1e3:.3f} ms; tokens equal to the direct run: "
          f"{all(x[f'same_tokens_{args.client_procs[0]}'] for x in rounds)}")
    return result


if __name__ == "__main__":
    main()
