"""`stagewise bench-serve`: the streaming benchmark, over HTTP, against any OpenAI-compatible server.

    stagewise bench-serve --base-url http://127.0.0.1:8000 --model smollm2-135m --num-requests 64

The same workloads as the benches (common/bench/workloads.py) and the same report (common/bench/report.py),
measured where a client stands: each request is one streaming POST (`stream: true`,
`stream_options.include_usage`) on a keep-alive connection, all of them on one asyncio event loop,
sent on a schedule (a burst, or `--request-rate` per second, fixed or Poisson, optionally capped
by `--max-concurrency`). Only the standard library speaks HTTP here (common/serve/sse_client.py), so
nothing ties it to stagewise: point it at vLLM or SGLang on a GPU and compare the same report.

What a client can see differs from the in-process stamps: "submitted" is just before the request
is written, a token's time is when its SSE chunk is read, and token counts come from the server's
`usage` (the chunk count when a server sends none). TPOT and ITL are per chunk: one token per
chunk for stagewise (`--stream-interval 1`), vLLM and SGLang.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import random
import sys
import time
import urllib.request
from typing import Any

from common.bench import flags as bench_flags
from common.bench.results import write_json
from common.bench.flags import check_prompt_kind, check_workload_flags, describe_workload, typed_flags, workload_from_args
from common.bench.metrics import median_summary, percentiles, summarize
from common.bench.report import format_report
from common.requests import Completion, Request
from common.serve.sse_client import ConnectionPool, Target, request_body, stream_one

# The benches' workload flags, so a workload replays over HTTP exactly as in-process; the seed
# here also seeds Poisson arrivals.
WORKLOAD_FLAGS: list[tuple[str, dict]] = bench_flags.WORKLOAD_FLAGS + [
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
    g.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                   help="the client's event loop; auto: uvloop where installed (the C loop uvicorn serves on), "
                        "else asyncio's own")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="give up on a run after this long")
    g.add_argument("--json", type=bench_flags.output_file, default=None, metavar="PATH", help="write the result as JSON")
    g.add_argument("--step-stdin", action="store_true",
                   help="wait for a line on stdin before each run and print '%s' after it, so another "
                        "process can run its own between ours (serve-overhead)" % RUN_DONE)
    return p


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


async def run_once(target: Target, pool: ConnectionPool, model: str, requests: list[Request],
                   args: argparse.Namespace) -> tuple[dict, list]:
    """Send every request on the schedule, wait for all streams, summarize as the benches do.

    One thread and one event loop carry every stream, as vLLM's and SGLang's benchmark clients
    do: with a thread per stream, 64 threads woken at once by their first tokens queue for the
    GIL and the client's own parsing shows up in TTFT. Connections outlive a run."""
    n = len(requests)
    bodies = [request_body(target, model, r) for r in requests]
    # The requests without a planned arrival on the --request-rate schedule; the late ones
    # (--long-prompts) at their own offset. Sent in order of planned time.
    plain = [i for i, r in enumerate(requests) if r.submit_offset_s is None]
    offsets = [r.submit_offset_s or 0.0 for r in requests]
    for i, at in zip(plain, arrival_offsets(len(plain), args.request_rate, args.arrivals, args.seed)):
        offsets[i] = at
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    planned, called = [0.0] * n, [0.0] * n

    async def work(i: int) -> Completion:
        try:
            return await stream_one(target, pool, bodies[i])
        finally:
            if slots is not None:
                slots.release()

    tasks: list[Any] = [None] * n  # by request index, whatever the order they were sent in
    t0 = time.perf_counter()
    for i in sorted(range(n), key=lambda i: offsets[i]):
        planned[i] = t0 + offsets[i]
        if (delay := planned[i] - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        called[i] = time.perf_counter()
        tasks[i] = asyncio.ensure_future(work(i))
    done, pending = await asyncio.wait(tasks, timeout=args.request_timeout_s)
    for task in pending:
        task.cancel()
    failed = [(i, t.exception() if t in done else "timed out") for i, t in enumerate(tasks)
              if t in pending or t.exception() is not None]
    if failed:
        i, err = failed[0]
        raise RuntimeError(f"{len(failed)} of {n} requests failed or timed out; first: request {i}: {err!r}")
    results = [t.result() for t in tasks]
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
    from common.loader import load_tokenizer, model_dir
    return load_tokenizer(model_dir(args.tokenizer or args.model))


def header(args: argparse.Namespace, target: Target) -> dict:
    rate = "burst (all at once)" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s, {args.arrivals}"
    workload = describe_workload(args)
    if args.chat_prompts and args.endpoint == "completions":  # the benches apply the template; a server here does not
        workload += " (as plain text: /v1/completions applies no chat template, --endpoint chat the server's own)"
    return {"Model": args.model, "Server": args.base_url, "Endpoint": target.path,
            "Mode": "HTTP streaming (bench-serve)", "Workload": workload, "Schedule": rate,
            "Max concurrency": args.max_concurrency, "Timestamps": "client side, per SSE chunk with text",
            "Repeats": f"{args.repeat_runs} (+{args.warmup_runs} warmup), medians"}


def server_info(target: Target) -> dict | None:
    """GET /v1/models, kept in the JSON: which server and model answered."""
    scheme = "https" if target.https else "http"
    req = urllib.request.Request(f"{scheme}://{target.host}:{target.port}{target.models_path}", headers=target.headers)
    try:
        with urllib.request.urlopen(req, timeout=10.0) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


async def run_all(target: Target, requests: list[Request], args: argparse.Namespace) -> list[dict]:
    """The warmups, then the measured runs, on one pool of connections."""
    pool, runs = ConnectionPool(target), []
    loop = asyncio.get_running_loop()
    try:
        for k in range(args.warmup_runs + args.repeat_runs):
            if args.step_stdin and not await loop.run_in_executor(None, sys.stdin.readline):
                raise SystemExit("bench-serve: stdin closed before the last run")
            warm = k < args.warmup_runs
            print(f"=== warmup {k + 1}/{args.warmup_runs} ===" if warm else
                  f"=== run {k - args.warmup_runs + 1}/{args.repeat_runs} ===", flush=True)
            summary = (await run_once(target, pool, args.model, requests, args))[0]
            if not warm:
                runs.append(summary)
            if args.step_stdin:
                print(RUN_DONE, flush=True)
    finally:
        pool.close()
    return runs


def run_event_loop(coro: Any, args: argparse.Namespace) -> Any:
    """Run the client on uvloop where it is installed (`args.loop` says which loop ran, for the JSON).

    Why it matters: the client shares the machine with the server, and on a small one with the
    engine too; every stream's every chunk is a read and a parse on this loop, and a late read is
    a later token time. On uvloop those reads cost less of the CPU the server needs.
    """
    if args.loop == "auto":
        args.loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if args.loop == "asyncio":
        return asyncio.run(coro)
    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def check_run_args(args: argparse.Namespace) -> None:
    """The workload's size, runs and rate, each a ValueError naming its flag: bench-serve's own
    check, and serve-compare's before it starts a server (a `request_rate` of None is a burst there)."""
    for flag, value in (("--num-requests", args.num_requests), ("--max-new-tokens", args.max_new_tokens),
                        ("--repeat-runs", args.repeat_runs)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.warmup_runs < 0:
        raise ValueError(f"--warmup-runs must be >= 0, got {args.warmup_runs}")
    if args.request_rate is not None and not args.request_rate > 0:  # inf (the default) is a burst; 0 would
        # divide by zero, and a negative rate means nothing
        raise ValueError(f"--request-rate must be > 0 (inf: a burst), got {args.request_rate:g}")
    if getattr(args, "arrivals", "fixed") != "fixed" and args.request_rate in (None, float("inf")):
        raise ValueError(f"--arrivals {args.arrivals}: spaces requests at --request-rate; a burst has no spacing")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_run_args(args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (leave it out: no limit), got {args.max_concurrency}")
    check_prompt_kind(args.chat_prompts, args.prompt_len_min is not None or args.prompt_len_max is not None,
                      bool(args.shared_prefix_len), "prompt" in typed_flags(build_parser(), argv))
    check_workload_flags(args)
    args.pretok = args.pretok_base_token_ids = False  # what workload_from_args reads; ids travel as `prompt`
    target = Target(args.base_url, args.endpoint, args.api_key)
    requests = workload_from_args(_tokenizer(args), args)
    info = server_info(target)
    # What is loaded now lives to the end: keep it out of the cyclic GC, so a full collection
    # in the middle of a burst does not stall the client and show up in TTFT.
    gc.collect()
    gc.freeze()
    runs = run_event_loop(run_all(target, requests, args), args)
    result = {"engine": "http", "mode": "http-streaming", **median_summary(runs), "runs": runs}
    print(format_report(result, header(args, target), runs=runs, title="streaming benchmark (HTTP)"), flush=True)
    if args.json:
        from common.bench.envinfo import collect_env
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        write_json(args.json, {"tool": "bench-serve", "model": args.model, "base_url": args.base_url,
                               "config": config, "server": info, "env": collect_env(None), **result})
    return 0


if __name__ == "__main__":  # as `stagewise bench-serve`: bad input is one line and status 2
    from common.commands import run_command
    sys.exit(run_command(main, "stagewise bench-serve"))
