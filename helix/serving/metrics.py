"""Request and engine metrics, and their Prometheus text exposition (format 0.0.4).

Per request: time to first token (arrival at the server -> first token back from the engine),
time per output token (first -> last token, over the tokens after the first), tokens. Engine:
running and queued requests, KV pages used / free per rank (LLM.stats(), pushed by the engine
about once a second), steps, tokens fed, step time, the engine loop's time between steps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class RequestMetrics:
    prompt_tokens: int
    arrival: float                          # perf_counter seconds
    first_token: float | None = None
    finished: float | None = None
    generated_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def time_per_token(self) -> float | None:
        """Seconds per token after the first (None with fewer than two tokens)."""
        if self.first_token is None or self.finished is None or self.generated_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.generated_tokens - 1)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for b, c in zip((*self.buckets, float("inf")), self.counts):
            total += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self, world: int):
        self.world = world
        self.requests: dict[str, int] = {}          # finish reason -> count
        self.rejections: dict[str, int] = {}        # invalid | capacity | overloaded -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.fed_tokens = 0
        self.idle_seconds = 0.0                     # the engine loop's time between busy steps
        self.slowest = (0.0, 0, 0)                  # (seconds, tokens fed, step number): the
                                                    # slowest step since the last reset
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.engine: dict = {}                      # the engine's last stats

    def step(self, seconds: float, fed: int, idle: float = 0.0) -> None:
        self.steps += 1
        self.step_seconds += seconds
        self.idle_seconds += idle
        self.fed_tokens += fed
        if seconds > self.slowest[0]:
            self.slowest = (seconds, fed, self.steps)

    def finished(self, m: RequestMetrics, reason: str) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.prompt_tokens += m.prompt_tokens
        self.generated_tokens += m.generated_tokens
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.time_per_token is not None:
            self.tpot.observe(m.time_per_token)

    def rejected(self, why: str) -> None:
        self.rejections[why] = self.rejections.get(why, 0) + 1

    def render(self, in_flight: int, up: bool) -> str:
        """The Prometheus text exposition."""
        e = self.engine
        out: list[str] = []

        def metric(name, kind, doc, samples):
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        metric("helix_up", "gauge", "1 while the engine serves", [f"helix_up {int(up)}"])
        metric("helix_requests_in_flight", "gauge", "requests accepted and not finished",
               [f"helix_requests_in_flight {in_flight}"])
        metric("helix_requests_running", "gauge", "requests in the engine's batch",
               [f"helix_requests_running {e.get('running', 0)}"])
        metric("helix_requests_queued", "gauge", "requests waiting for KV pages or a batch slot",
               [f"helix_requests_queued {e.get('queued', 0)}"])
        for name, key, doc in (("helix_kv_pages_used", "kv_pages_used", "KV pages in use"),
                               ("helix_kv_pages_free", "kv_pages_free", "KV pages free")):
            vals = e.get(key) or [0] * self.world
            metric(name, "gauge", f"{doc}, per rank",
                   [f'{name}{{rank="{r}"}} {v}' for r, v in enumerate(vals)])
        metric("helix_kv_pages_total", "gauge", "KV pages per rank",
               [f"helix_kv_pages_total {e.get('num_pages', 0)}"])
        metric("helix_kv_pages_cached", "gauge",
               "KV pages of prefix-cache blocks no request holds (counted free), per rank",
               [f"helix_kv_pages_cached {e.get('kv_pages_cached', 0)}"])
        for name, key, doc in (
                ("helix_prefix_cache_queries_total", "prefix_cache_queries",
                 "prompt tokens looked up in the prefix cache"),
                ("helix_prefix_cache_hits_total", "prefix_cache_hits",
                 "prompt tokens found in the prefix cache (not prefilled)"),
                ("helix_prefix_cache_host_hits_total", "prefix_cache_host_hits",
                 "of those, prompt tokens loaded back from host memory"),
                ("helix_preemptions_total", "preemptions",
                 "requests preempted for KV pages (recomputed when re-admitted)"),
                ("helix_speculative_draft_tokens_total", "speculative_draft_tokens",
                 "tokens guessed by n-gram lookup and verified (speculative decoding)"),
                ("helix_speculative_accepted_tokens_total", "speculative_accepted_tokens",
                 "of those, guesses the model agreed with (kept)")):
            metric(name, "counter", doc, [f"{name} {e.get(key, 0)}"])
        metric("helix_requests_total", "counter", "finished requests by finish reason",
               [f'helix_requests_total{{finish_reason="{k}"}} {v}'
                for k, v in sorted(self.requests.items())] or ["helix_requests_total 0"])
        metric("helix_requests_rejected_total", "counter", "refused requests by reason",
               [f'helix_requests_rejected_total{{reason="{k}"}} {v}'
                for k, v in sorted(self.rejections.items())] or
               ["helix_requests_rejected_total 0"])
        metric("helix_prompt_tokens_total", "counter", "prompt tokens of finished requests",
               [f"helix_prompt_tokens_total {self.prompt_tokens}"])
        metric("helix_generation_tokens_total", "counter", "tokens generated (finished requests)",
               [f"helix_generation_tokens_total {self.generated_tokens}"])
        metric("helix_engine_steps_total", "counter", "engine steps that produced tokens",
               [f"helix_engine_steps_total {self.steps}"])
        metric("helix_engine_step_seconds_total", "counter", "wall time of those steps",
               [f"helix_engine_step_seconds_total {self.step_seconds:.6f}"])
        metric("helix_engine_loop_seconds_total", "counter",
               "the engine loop's own time between consecutive busy steps (messages, polling)",
               [f"helix_engine_loop_seconds_total {self.idle_seconds:.6f}"])
        metric("helix_time_to_first_token_seconds", "histogram",
               "arrival to first token, per request", self.ttft.lines(
                   "helix_time_to_first_token_seconds"))
        metric("helix_time_per_output_token_seconds", "histogram",
               "seconds per token after the first, per request", self.tpot.lines(
                   "helix_time_per_output_token_seconds"))
        return "\n".join(out) + "\n"
