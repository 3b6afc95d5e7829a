"""`stagewise bench-serve`: the streaming benchmark, over HTTP, against any OpenAI-compatible server.

    stagewise bench-serve --base-url http://127.0.0.1:8000 --model smollm2-135m --num-requests 64

The same workloads as the benches (common/workloads.py) and the same report (common/report.py),
measured where a client stands: each request is one streaming POST (`stream: true`,
`stream_options.include_usage`) on a keep-alive connection, in its own thread, sent on a schedule (a burst, or
`--request-rate` per second, fixed or Poisson, optionally capped by `--max-concurrency`).
Only the standard library speaks HTTP here, so nothing ties it to stagewise: point it at vLLM or
SGLang on a GPU and compare the same report.

What a client can see differs from the in-process stamps: "submitted" is just before the request
is written, a token's time is when its SSE chunk is read, and token counts come from the server's
`usage` (the chunk count when a server sends none). TPOT and ITL are per chunk: one token per
chunk for stagewise (`--stream-interval 1`), vLLM and SGLang.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from common import bench
from common.bench import describe_workload, workload_from_args, write_json
from common.metrics import median_summary, percentiles, summarize
from common.report import format_report
from common.requests import Completion, Request
from common.streaming_bench import _sleep_until

# The benches' workload flags, so a workload replays over HTTP exactly as in-process; the seed
# here also seeds Poisson arrivals.
WORKLOAD_FLAGS: list[tuple[str, dict]] = bench.WORKLOAD_FLAGS + [
    ("--seed", {"type": int, "default": 0, "help": "workload RNG (and Poisson arrivals)"}),
]


RUN_DONE = "=== run done ==="  # printed after each run with --step-stdin


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise bench-serve",
                                description="Benchmark an OpenAI-compatible server with a stagewise workload.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", required=True, help="the model name the server serves")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (raw prompt, as the benches) or /v1/chat/completions")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--tokenizer", default=None, help="for random-token prompts: a model name or HF dir "
                   "(default: --model)")
    g = p.add_argument_group("workload (as in the benches)")
    for flag, kwargs in WORKLOAD_FLAGS:
        g.add_argument(flag, **kwargs)
    g = p.add_argument_group("schedule")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: a burst)")
    g.add_argument("--arrivals", choices=["fixed", "poisson"], default="fixed", help="spacing at --request-rate")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g = p.add_argument_group("method")
    g.add_argument("--warmup-runs", type=int, default=1)
    g.add_argument("--repeat-runs", type=int, default=3)
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="give up on a run after this long")
    g.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON")
    g.add_argument("--step-stdin", action="store_true",
                   help="wait for a line on stdin before each run and print '%s' after it, so another "
                        "process can run its own between ours (serve-overhead)" % RUN_DONE)
    return p


class Target:
    """Where to POST: scheme, host, port and the endpoint's path."""

    def __init__(self, base_url: str, endpoint: str, api_key: str | None) -> None:
        url = urllib.parse.urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise SystemExit(f"--base-url: expected http(s)://host[:port], got {base_url!r}")
        self.https, self.host, self.port = url.scheme == "https", url.hostname, url.port
        prefix = url.path if url.path.endswith("/v1") else url.path + "/v1"
        self.chat = endpoint == "chat"
        self.path = prefix + ("/chat/completions" if self.chat else "/completions")
        self.models_path = prefix + "/models"
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)


def request_body(target: Target, model: str, request: Request) -> bytes:
    """One streaming request: greedy (temperature 0), usage asked for, EOS ignored if the workload says so."""
    body: dict[str, Any] = {"model": model, "max_tokens": request.params.max_new_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if target.chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:  # token ids when the workload only exists as ids (random lengths, shared prefix)
        body["prompt"] = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
    if not request.params.stop_on_eos:
        body["ignore_eos"] = True  # vLLM's and SGLang's extra field too
    return json.dumps(body).encode()


class ConnectionPool:
    """Keep-alive connections, reused across requests as an SDK's pool reuses them: a TCP
    handshake is the network's cost, not the server's TTFT. The warmup run opens them."""

    def __init__(self, target: Target, timeout: float) -> None:
        self.target, self.timeout = target, timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def get(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it was reused (a reused one may have been closed meanwhile)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self.target.connect(self.timeout), False

    def put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def stream_one(target: Target, pool: ConnectionPool, body: bytes) -> Completion:
    """POST one request and read its SSE stream, stamping each chunk that carries text."""
    conn, reused = pool.get()
    try:
        submitted = time.perf_counter()
        try:
            conn.request("POST", target.path, body=body, headers=target.headers)
            resp = conn.getresponse()
        except (ConnectionError, http.client.RemoteDisconnected):
            if not reused:
                raise
            conn.close()  # the server closed an idle keep-alive connection: one fresh try
            conn, reused = pool.target.connect(pool.timeout), False
            submitted = time.perf_counter()
            conn.request("POST", target.path, body=body, headers=target.headers)
            resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500].decode(errors='replace')}")
        stamps: list[float] = []
        texts: list[str] = []
        use: dict = {}
        finish = None
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            use = event.get("usage") or use
            for c in event.get("choices") or []:
                text = (c.get("delta") or {}).get("content") if target.chat else c.get("text")
                if text:
                    stamps.append(now)
                    texts.append(text)
                finish = c.get("finish_reason") or finish
        resp.read()  # the end of the chunked body, so the connection can carry the next request
        if resp.will_close:
            conn.close()
        else:
            pool.put(conn)
    except BaseException:
        conn.close()
        raise
    n_prompt = int(use.get("prompt_tokens") or 0)
    n_out = int(use.get("completion_tokens") or len(stamps))
    return Completion(prompt_token_ids=[0] * n_prompt, token_ids=[0] * n_out, text="".join(texts),
                      finish_reason=finish or "unknown", token_timestamps=stamps, timings={"submitted": submitted})


def arrival_offsets(n: int, rate: float, arrivals: str, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if rate == float("inf"):
        return [0.0] * n
    if arrivals == "fixed":
        return [i / rate for i in range(n)]
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_once(target: Target, pool: ConnectionPool, workers: ThreadPoolExecutor, model: str,
             requests: list[Request], args: argparse.Namespace) -> tuple[dict, list]:
    """Send every request on the schedule, wait for all streams, summarize as the benches do.

    The threads (one per request in flight) and connections outlive a run, so a burst is not
    slowed by starting 64 threads and 64 TCP handshakes."""
    n = len(requests)
    bodies = [request_body(target, model, r) for r in requests]
    # The requests without a planned arrival on the --request-rate schedule; the late ones
    # (--long-prompts) at their own offset. Sent in order of planned time.
    plain = [i for i, r in enumerate(requests) if r.submit_offset_s is None]
    offsets = [r.submit_offset_s or 0.0 for r in requests]
    for i, at in zip(plain, arrival_offsets(len(plain), args.request_rate, args.arrivals, args.seed)):
        offsets[i] = at
    slots = threading.BoundedSemaphore(args.max_concurrency) if args.max_concurrency else None
    planned, called = [0.0] * n, [0.0] * n

    def work(i: int) -> Completion:
        try:
            return stream_one(target, pool, bodies[i])
        finally:
            if slots is not None:
                slots.release()

    futures: list[Any] = [None] * n  # by request index, whatever the order they were sent in
    t0 = time.perf_counter()
    for i in sorted(range(n), key=lambda i: offsets[i]):
        planned[i] = t0 + offsets[i]
        _sleep_until(planned[i])
        if slots is not None:
            slots.acquire()
        called[i] = time.perf_counter()
        futures[i] = workers.submit(work, i)
    done, pending = wait(futures, timeout=args.request_timeout_s)
    failed = [(i, f.exception() if f in done else "timed out") for i, f in enumerate(futures)
              if f in pending or f.exception() is not None]
    if failed:
        i, err = failed[0]
        raise RuntimeError(f"{len(failed)} of {n} requests failed or timed out; first: request {i}: {err!r}")
    results = [f.result() for f in futures]
    starts = [c.timings["submitted"] for c in results]
    ends = [c.token_timestamps[-1] for c in results if c.token_timestamps] or starts
    summary = summarize(results, wall_s=max(1e-9, max(ends) - min(starts)))
    summary.update(submit_wall_s=max(called) - min(called),
                   submit_lag_ms=percentiles((c - p) * 1000.0 for c, p in zip(called, planned)))
    return summary, results


def _tokenizer(args: argparse.Namespace) -> Any:
    """Only random-token workloads need one (to pick ordinary ids and decode them)."""
    if args.prompt_len_min is None and args.prompt_len_max is None and not args.shared_prefix_len \
            and not args.long_prompts:
        return None
    from transformers import AutoTokenizer

    from common.loader import model_dir
    return AutoTokenizer.from_pretrained(str(model_dir(args.tokenizer or args.model)))


def header(args: argparse.Namespace, target: Target) -> dict:
    rate = "burst (all at once)" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s, {args.arrivals}"
    return {"Model": args.model, "Server": args.base_url, "Endpoint": target.path,
            "Mode": "HTTP streaming (bench-serve)", "Workload": describe_workload(args), "Schedule": rate,
            "Max concurrency": args.max_concurrency, "Timestamps": "client side, per SSE chunk with text",
            "Repeats": f"{args.repeat_runs} (+{args.warmup_runs} warmup), medians"}


def server_info(target: Target) -> dict | None:
    """GET /v1/models, kept in the JSON: which server and model answered."""
    conn = target.connect(10.0)
    try:
        conn.request("GET", target.models_path, headers=target.headers)
        resp = conn.getresponse()
        return json.loads(resp.read()) if resp.status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < 1 or args.max_new_tokens < 1 or args.repeat_runs < 1 or args.warmup_runs < 0:
        raise SystemExit("bench-serve: --num-requests, --max-new-tokens, --repeat-runs must be >= 1")
    if (args.prompt_len_min is None) != (args.prompt_len_max is None):
        args.prompt_len_min = args.prompt_len_max = args.prompt_len_min or args.prompt_len_max
    args.pretok = args.pretok_base_token_ids = False  # what workload_from_args reads; ids travel as `prompt`
    target = Target(args.base_url, args.endpoint, args.api_key)
    requests = workload_from_args(_tokenizer(args), args)
    info = server_info(target)
    pool = ConnectionPool(target, args.request_timeout_s)
    runs = []

    def one_run(title: str) -> dict:
        if args.step_stdin and not sys.stdin.readline():
            raise SystemExit("bench-serve: stdin closed before the last run")
        print(title, flush=True)
        summary = run_once(target, pool, workers, args.model, requests, args)[0]
        if args.step_stdin:
            print(RUN_DONE, flush=True)
        return summary

    with ThreadPoolExecutor(args.max_concurrency or len(requests), thread_name_prefix="bench-serve") as workers:
        for w in range(args.warmup_runs):
            one_run(f"=== warmup {w + 1}/{args.warmup_runs} ===")
        for r in range(args.repeat_runs):
            runs.append(one_run(f"=== run {r + 1}/{args.repeat_runs} ==="))
    pool.close()
    result = {"engine": "http", "mode": "http-streaming", **median_summary(runs), "runs": runs}
    print(format_report(result, header(args, target), runs=runs, title="streaming benchmark (HTTP)"), flush=True)
    if args.json:
        from common.envinfo import collect_env
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        write_json(args.json, {"tool": "bench-serve", "model": args.model, "base_url": args.base_url,
                               "config": config, "server": info, "env": collect_env(None), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
