"""`GET /metrics` of `stagewise serve`: Prometheus' text format, with vLLM's metric names.

A server's operator watches it the way they watch vLLM or SGLang: a Prometheus scrape, or `curl`.
The names are vLLM's (`vllm:time_to_first_token_seconds` here is
`stagewise:time_to_first_token_seconds`), so a dashboard built for one reads the other.

Everything is counted on the event loop, where each request's chunks arrive, so nothing needs a
lock and the engine's worker does no extra work: a request costs a clock read when it is handed
to the engine, one when its first token reaches the loop, and one at its end. The gauges are
read when scraped: the requests in flight from here, the KV pool from the engine (wherever it
runs). The times are the server's, from the request's hand-over to the engine, so they include
queueing and the prefill, as vLLM's do, but not the HTTP parsing before or the write after.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass

PREFIX = "stagewise:"

# vLLM's buckets (seconds), so that the histograms line up with its dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Counts of observations per bucket (upper bounds), their sum and their number."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le=bound holds value == bound
        self.sum += value

    def lines(self) -> list[str]:
        name = PREFIX + self.name
        out, seen = [f"# HELP {name} {self.doc}", f"# TYPE {name} histogram"], 0
        for bound, count in zip([*map(repr, self.bounds), "+Inf"], self.counts):
            seen += count  # Prometheus' buckets are cumulative
            out.append(f'{name}_bucket{{le="{bound}"}} {seen}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {seen}"]


@dataclass
class Tracked:
    """One request, from its hand-over to the engine to its end."""

    start: float
    first_token: float | None = None
    ended: bool = False


class ServeMetrics:
    """The server's counters and histograms; every method runs on the event loop."""

    def __init__(self) -> None:
        self.in_flight = 0  # requests handed to the engine that have not ended
        self.running = 0  # of those, the ones whose first token has arrived
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self.failed = 0
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request, in seconds.", TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End to end request latency in seconds.", E2E_BUCKETS)

    def start(self) -> Tracked:
        self.in_flight += 1
        return Tracked(time.perf_counter())

    def first_token(self, tracked: Tracked) -> None:
        tracked.first_token = time.perf_counter()
        self.running += 1
        self.ttft.observe(tracked.first_token - tracked.start)

    def end(self, tracked: Tracked, reason: str | None, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """The request is over: `reason` stop / length / abort (its client left), None: it failed."""
        if tracked.ended:
            return
        tracked.ended, now = True, time.perf_counter()
        self.in_flight -= 1
        if tracked.first_token is not None:
            self.running -= 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        if reason is None:
            self.failed += 1
            return
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if reason != "abort":
            self.e2e.observe(now - tracked.start)
            if tracked.first_token is not None and completion_tokens > 1:
                self.tpot.observe((now - tracked.first_token) / (completion_tokens - 1))

    def render(self, engine: dict) -> str:
        """The text a scrape gets (Prometheus exposition format 0.0.4); `engine` is what the engine
        said of itself (`common.serve.engine_process.engine_stats`: its KV pool, its prefix cache)."""
        lines: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {doc}", f"# TYPE {PREFIX}{name} {kind}"])
            lines.extend(f"{PREFIX}{name}{labels} {value}" for labels, value in samples)

        metric("num_requests_running", "gauge", "Requests in flight that have their first token.",
               [("", self.running)])
        metric("num_requests_waiting", "gauge", "Requests in flight still waiting for their first token "
               "(queued or being prefilled).", [("", self.in_flight - self.running)])
        kv = engine.get("kv_blocks")
        if kv:
            used = (kv["total"] - kv["free"]) / kv["total"]
            metric("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = 100%).", [("", used)])
        if "prefix_cache_hits" in engine:  # stages 05+: requests (05-09: the whole prompt; 10+: a block or more)
            hits = engine["prefix_cache_hits"]
            metric("prefix_cache_hit_requests_total", "counter", "Requests whose prompt reused cached KV.", [("", hits)])
            metric("prefix_cache_query_requests_total", "counter", "Requests looked up in the prefix cache.",
                   [("", hits + engine["prefix_cache_misses"])])
        if "prefix_cache_hit_tokens" in engine:  # stages 10+: tokens, as vLLM counts them
            metric("prefix_cache_hits_total", "counter", "Prompt tokens whose KV came from the prefix cache.",
                   [("", engine["prefix_cache_hit_tokens"])])
            metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                   [("", engine["prefix_cache_query_tokens"])])
        if "num_preemptions" in engine:  # stages 13+: KV blocks on demand, preemption by recompute
            metric("num_preemptions_total", "counter", "Requests preempted when the KV pool ran dry.",
                   [("", engine["num_preemptions"])])
            metric("recomputed_tokens_total", "counter", "Tokens prefilled again after a preemption.",
                   [("", engine["recomputed_tokens"])])
            metric("kv_cache_usage_mean_perc", "gauge", "Mean fraction of KV-cache blocks in use over the "
                   "engine's steps so far (1 = 100%).", [("", engine["kv_usage_mean"])])
            metric("kv_cache_usage_peak_perc", "gauge", "Largest fraction of KV-cache blocks in use at once.",
                   [("", engine["kv_usage_peak"])])
        metric("prompt_tokens_total", "counter", "Prompt tokens of the requests that finished "
               "(an aborted one's prompt length never reaches the server).", [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated for the requests that ended, "
               "aborted ones included.", [("", self.generation_tokens)])
        metric("request_success_total", "counter", "Requests that ended, by finish reason (abort: the client left).",
               [(f'{{finished_reason="{r}"}}', n) for r, n in self.finished.items()])
        metric("request_failure_total", "counter", "Requests handed to the engine that ended in an error.",
               [("", self.failed)])
        for h in (self.ttft, self.tpot, self.e2e):
            lines.extend(h.lines())
        return "\n".join(lines) + "\n"
