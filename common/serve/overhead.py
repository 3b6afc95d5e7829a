"""What HTTP costs: one workload through `stagewise serve` + `bench-serve`, and in-process, paired.

    stagewise serve-overhead --stage 9 --model smollm2-135m --json docs/results/cpu/serve.cpu.json

This process serves the stage's engine over HTTP (the server `stagewise serve` runs, in a
thread), and holds the engine and its SchedulerManager too, as `stagewise serve` does by default
(`--engine-process`: in a process of their own). `bench-serve` runs in another process as the HTTP
client. The two sides take turns on the SAME manager: a run in-process (`add_request` from a
thread of the manager's own process, a consumer thread per request), then a run over HTTP, then
the other order, and so on. Why paired: this machine's speed drifts by 20 % and more from
minute to minute, a burst's TTFT is most of a second of prefill, and the target is 5 ms; two runs
seconds apart on one engine see the same machine, so their difference is HTTP's, and the median
over pairs is the figure. The JSON keeps both sides whole, every pair, and the env of the run.
Each HTTP run also records the CPU time of HTTP's work (`loop_cpu_us_per_request`): uvicorn's
event loop, and with the engine in its own process the reader that takes its tokens: a cost that
swings far less with the machine than a TTFT.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common.bench.envinfo import REPO_ROOT, collect_env
from common.bench.flags import output_file
from common.bench.report import format_comparison
from common.bench.results import write_json
from common.commands import add_model_args, run_command

TARGETS = {"throughput_loss_pct": 10.0, "ttft_p50_added_ms": 5.0}
QUIET_MS = 50.0  # the idle worker's quiet window on both sides, when a queue delay is on (below)


def build_parser() -> argparse.ArgumentParser:
    from common.serve.engine import WORKER_PRIORITIES
    p = argparse.ArgumentParser(prog="stagewise serve-overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="9")
    add_model_args(p)
    p.add_argument("--prompt", default="Hello")
    p.add_argument("--num-requests", type=int, default=64, help="requests a run: one burst, or sent at --request-rate")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, evenly spaced, on both sides (default inf: one burst); post 052's is 50")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--prefill-max-batch-size", type=int, default=64)
    # An idle worker waits for the rest of a burst, so neither side splits it and the difference is
    # what HTTP costs. The quiet window is well above the arrival gaps seen over HTTP on a shared
    # 2-core CPU; it costs nothing here, because the burst fills the batch (--num-requests =
    # --max-batch-size), which ends the wait. Requests that arrive at a rate are admitted as they
    # come, as `stagewise serve` does by default: the wait is off then.
    p.add_argument("--max-queue-delay-ms", type=float, default=None, help="0: off (default: 200 for a burst, 0 at a rate)")
    p.add_argument("--queue-quiet-ms", type=float, default=QUIET_MS)
    p.add_argument("--warmup-runs", type=int, default=1, help="per side")
    p.add_argument("--repeat-runs", type=int, default=3, help="pairs of runs (one per side)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="the engine in its own process, as `stagewise serve --engine-process` runs it "
                        "(the in-process side then runs in that process too)")
    p.add_argument("--worker-priority", choices=WORKER_PRIORITIES, default="auto",
                   help="as `stagewise serve`'s: the scheduling class of the worker both sides share")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="e.g. docs/results/cpu/serve.cpu.json")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    return p


def _workload_flags(a: argparse.Namespace) -> list[str]:
    """The workload both sides run: distinct prompts, fixed length (EOS ignored); the schedule
    (a burst, or `--request-rate`) is each side's own flag."""
    return ["--model", a.model, "--prompt", a.prompt, "--unique-prompts", "--num-requests", str(a.num_requests),
            "--max-new-tokens", str(a.max_new_tokens), "--no-stop-on-eos"]


def _is_burst(a: argparse.Namespace) -> bool:
    return a.request_rate == float("inf")


def queue_delay_ms(a: argparse.Namespace) -> float:
    """The idle worker's admission wait: as asked, else 200 ms for a burst and off at a rate."""
    if a.max_queue_delay_ms is not None:
        return a.max_queue_delay_ms
    return 200.0 if _is_burst(a) else 0.0


def _engine_flags(a: argparse.Namespace) -> list[str]:
    """The server's knobs (both sides use its manager); the prefix cache off, so every run does the same work."""
    delay = queue_delay_ms(a)
    flags = ["--device", a.device, "--max-batch-size", str(a.max_batch_size),
             "--prefill-max-batch-size", str(a.prefill_max_batch_size), "--no-prefix-cache", "--stream-interval", "1",
             "--max-queue-delay-ms", str(delay), "--worker-priority", a.worker_priority]
    quiet = ["--queue-quiet-ms", str(a.queue_quiet_ms)] if delay else []  # a quiet window only ends a wait
    return flags + quiet + (["--dtype", a.dtype] if a.dtype else [])


def record_token_timestamps(manager: Any) -> None:
    """TPOT, ITL and latency of the in-process runs (HTTP's come from its client)."""
    manager.record_token_timestamps = True


def run_in_process(manager: Any, requests: list, timeout_s: float, submit_interval_ms: float = 0.0) -> dict:
    """One in-process run where the manager lives: `add_request` from a thread of its process
    (all at once, or one every `submit_interval_ms` on an absolute schedule, as bench-serve's
    `--request-rate` sends them), a consumer thread per request (with --engine-process, this
    runs in the engine's process)."""
    from common.bench.streaming import run_streaming_once
    summary, completions = run_streaming_once(manager, requests, submit_interval_ms=submit_interval_ms,
                                              submit_schedule="absolute", timeout_s=timeout_s)
    return {**summary, "intake_span_ms": intake_span_ms(completions)}


class Server:
    """`stagewise serve`'s app in a thread of this process, over the stage's manager: in this
    process, as `stagewise serve` runs it by default, or in its own (`--engine-process`)."""

    def __init__(self, a: argparse.Namespace) -> None:
        from common.serve import app, engine, server
        from common.serve.transport import bind_socket
        p = argparse.ArgumentParser()
        engine.add_serve_args(p)
        split = ["--engine-process" if a.engine_process else "--no-engine-process"]
        args = p.parse_args(["--stage", a.stage, "--model", a.model, *_engine_flags(a), *split])
        self.manager, self.stage = server.start_engine(args)
        self.engine_process = bool(a.engine_process)
        self.call(record_token_timestamps)
        self.handles: list[Any] = []  # every request the manager took since the last take_completions()
        add_request = self.manager.add_request

        def recording_add_request(*args: Any, **kwargs: Any) -> Any:
            handle = add_request(*args, **kwargs)
            self.handles.append(handle)
            return handle

        self.manager.add_request = recording_add_request
        self.state = app.ServeState(self.manager, a.model, self.stage)
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = server.make_server(self.state, sock)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("serve-overhead: the server did not start")
            time.sleep(0.02)
        gc.collect()
        gc.freeze()  # as `stagewise serve` does after start-up
        assert self.thread.ident is not None
        self._loop_clock = time.pthread_getcpuclockid(self.thread.ident)

    def call(self, fn: Any, *args: Any) -> Any:
        """fn(manager, *args) where the manager lives, and its result."""
        from common.serve.engine_process import call_beside
        return call_beside(self.manager, fn, *args).result()

    def loop_cpu_s(self) -> float:
        """CPU seconds of all of HTTP's work: the server's thread (uvicorn's event loop), and with
        the engine in its own process this whole process (the loop and the engine's reader)."""
        return time.process_time() if self.engine_process else time.clock_gettime(self._loop_clock)

    def take_completions(self, timeout_s: float) -> list[Any]:
        """The server-side Completions (engine timings included) of the requests since the last call."""
        handles, self.handles = self.handles, []
        return [h.result(timeout=timeout_s) for h in handles]

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # ends the manager too
        self.thread.join(60)


class StepClient:
    """`bench-serve --step-stdin` in its own process: one run each time we ask for one."""

    def __init__(self, a: argparse.Namespace, url: str, out: Path) -> None:
        from common.serve.bench import RUN_DONE
        self.done, self.out = RUN_DONE, out
        rate = [] if _is_burst(a) else ["--request-rate", repr(a.request_rate), "--arrivals", "fixed"]
        cmd = [sys.executable, "-m", "common.cli", "bench-serve", "--base-url", url, *_workload_flags(a), *rate,
               "--warmup-runs", str(a.warmup_runs), "--repeat-runs", str(a.repeat_runs), "--step-stdin",
               "--json", str(out)]
        print("$", " ".join(cmd[2:]), flush=True)
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.strip() == self.done:
                return
            print("  [http] " + line.rstrip(), flush=True)
        raise RuntimeError(f"bench-serve ended before its run was done (exit {self.proc.wait()})")

    def finish(self, timeout_s: float) -> dict:
        out, _ = self.proc.communicate(timeout=timeout_s)  # its report and the JSON
        print("\n".join("  [http] " + line for line in (out or "").splitlines()), flush=True)
        if self.proc.returncode != 0:
            raise RuntimeError(f"bench-serve failed (exit {self.proc.returncode})")
        return json.loads(self.out.read_text())


def overhead(http: dict, local: dict, pairs: list[dict] | None = None, burst: bool = True) -> dict:
    """HTTP's cost, positive = HTTP is worse; and whether it stays inside the issue's targets.

    At a rate (`burst=False`) only throughput is judged: a request that arrives during a decode
    step waits for it (hundreds of milliseconds on a CPU, a different wait on each side of a
    pair), and that swamps a 5 ms TTFT target. The TTFT figures are kept all the same.

    TTFT like for like: an HTTP client stamps the first token when it reads it, so the
    in-process side is read where its consumer thread gets the token (`ttft_received_ms`), not
    where the worker sampled it (`ttft_ms`, kept as `ttft_p50_ms.in_process_sampled`). With
    `pairs` (one HTTP run and one in-process run back to back), the figures are the medians of
    the per-pair figures (see `pair`); the sides' own medians are kept beside them.
    """
    tput_http, tput_local = http["throughput_tok_s"]["completion"], local["throughput_tok_s"]["completion"]
    local_ttft = (local.get("ttft_received_ms") or local["ttft_ms"])["p50"]
    if pairs:
        loss = statistics.median(p["throughput_loss_pct"] for p in pairs)
        added = statistics.median(p["ttft_p50_added_ms"] for p in pairs)
    else:
        loss = 100.0 * (1.0 - tput_http / tput_local) if tput_local else float("nan")
        added = http["ttft_ms"]["p50"] - local_ttft
    loop_cpu = [p["loop_cpu_us_per_request"] for p in pairs or [] if p.get("loop_cpu_us_per_request") is not None]
    targets = TARGETS if burst else {"throughput_loss_pct": TARGETS["throughput_loss_pct"]}
    return {"throughput_loss_pct": loss, "ttft_p50_added_ms": added,
            "loop_cpu_us_per_request": statistics.median(loop_cpu) if loop_cpu else None,
            "throughput_completion_tok_s": {"http": tput_http, "in_process": tput_local},
            "ttft_p50_ms": {"http": http["ttft_ms"]["p50"], "in_process": local_ttft,
                            "in_process_sampled": local["ttft_ms"]["p50"]},
            "pairs": pairs or [], "method": "paired runs, median of differences" if pairs else "medians per side",
            "targets": targets, "within_targets": loss <= targets["throughput_loss_pct"]
            and added <= targets.get("ttft_p50_added_ms", float("inf"))}


def intake_span_ms(completions: list[Any]) -> float:
    """From the first request of a burst reaching `add_request` to the last one (server clock).

    In-process, that is the submitter's loop over `add_request`; over HTTP, the event loop
    parsing and routing the burst one request after another, then `add_request` for each.
    The burst's prefill starts after the last, so the difference is HTTP's intake cost. At a
    rate the span is the schedule's on both sides (63 gaps of 20 ms at 50/s), a check that
    both sides kept it."""
    stamps = [c.timings["submitted"] for c in completions]
    return 1000.0 * (max(stamps) - min(stamps))


def pair(http_run: dict, http_engine: dict, local_run: dict, first: str) -> dict:
    """One pair's figures. TTFT: what each side adds to the engine's own prefill.

    A burst's TTFT is the wait for admission + the batched prefill + the way back to the client.
    The prefill is the same work on both sides, but it is most of a second here and this machine
    runs the same prefill 20-50 % slower or faster from one run to the next, even seconds apart;
    a 5 ms difference cannot be read through that. So each side's TTFT p50 is taken net of its
    run's prefill (the engine's `prefill_to_first_token_ms` p50, read from the server's own
    Completions for the HTTP run) and those are compared. `ttft_p50_added_raw_ms` keeps the
    plain difference.
    """
    figures = overhead(http_run, local_run)
    prefill_http = http_engine["prefill_to_first_token_ms"]["p50"]
    prefill_local = local_run["prefill_to_first_token_ms"]["p50"]
    outside = {"http": figures["ttft_p50_ms"]["http"] - prefill_http,
               "in_process": figures["ttft_p50_ms"]["in_process"] - prefill_local}
    return {"first": first, "throughput_loss_pct": figures["throughput_loss_pct"],
            "ttft_p50_added_ms": outside["http"] - outside["in_process"],
            "ttft_p50_added_raw_ms": figures["ttft_p50_added_ms"],
            "ttft_p50_ms": figures["ttft_p50_ms"], "prefill_p50_ms": {"http": prefill_http, "in_process": prefill_local},
            "ttft_p50_outside_prefill_ms": outside,
            "queue_wait_p50_ms": {"http": http_engine["queue_wait_ms"]["p50"], "in_process": local_run["queue_wait_ms"]["p50"]},
            "intake_span_ms": {"http": http_engine["intake_span_ms"], "in_process": local_run["intake_span_ms"]},
            "loop_cpu_us_per_request": http_engine.get("loop_cpu_us_per_request"),
            "loop_cpu_us_per_token": http_engine.get("loop_cpu_us_per_token"),
            "throughput_completion_tok_s": figures["throughput_completion_tok_s"]}


def run_paired(a: argparse.Namespace, tmp: Path) -> tuple[dict, dict, list[dict], dict]:
    """Warm both sides, then `repeat_runs` pairs, alternating which side goes first."""
    from common.bench import flags as bench_flags
    from common.bench.metrics import median_summary, summarize

    server = Server(a)
    try:
        wargs = bench_flags.build_parser("serve-overhead").parse_args(_workload_flags(a))
        requests = bench_flags.workload_from_args(server.manager.engine.tokenizer, wargs)
        client = StepClient(a, server.url, tmp / "http.json")

        interval_ms = 0.0 if _is_burst(a) else 1000.0 / a.request_rate

        def local_run() -> dict:
            result = server.call(run_in_process, requests, a.timeout_s, interval_ms)
            server.handles.clear()  # HTTP's runs read the server's handles; these were in-process
            return result

        def http_run() -> dict:
            cpu0 = server.loop_cpu_s()
            client.run()
            loop_cpu_ms = 1000.0 * (server.loop_cpu_s() - cpu0)
            completions = server.take_completions(a.timeout_s)  # the server's view: engine timings
            return {**summarize(completions), "intake_span_ms": intake_span_ms(completions),
                    "loop_cpu_ms": loop_cpu_ms, "loop_cpu_us_per_request": 1000.0 * loop_cpu_ms / len(completions),
                    "loop_cpu_us_per_token": 1000.0 * loop_cpu_ms / max(1, sum(len(c.token_ids) for c in completions))}

        for w in range(a.warmup_runs):
            print(f"=== warmup {w + 1}/{a.warmup_runs}: in-process, then HTTP ===", flush=True)
            local_run()
            http_run()
        local_runs: list[dict] = []
        http_engine: list[dict] = []
        order: list[str] = []
        for r in range(a.repeat_runs):
            first = "in-process" if r % 2 == 0 else "http"
            print(f"=== pair {r + 1}/{a.repeat_runs}: {first} first ===", flush=True)
            if first == "http":
                http_engine.append(http_run())
            local_runs.append(local_run())
            if first == "in-process":
                http_engine.append(http_run())
            order.append(first)
        http = client.finish(a.timeout_s)
    finally:
        server.stop()
    pairs = [pair(h, e, l, f) for h, e, l, f in zip(http["runs"], http_engine, local_runs, order)]
    local = {"engine": "in-process", "mode": "streaming", **median_summary(local_runs), "runs": local_runs}
    from common.serve.engine_process import EngineInfo
    engine = server.manager.engine  # an EngineInfo already when the engine has its own process
    info = engine if server.engine_process else EngineInfo.of(engine, server.stage)
    import torch
    from common.serve.engine import worker_priority
    meta = {"stage": server.stage, "model": a.model, "device": info.device, "dtype": info.dtype,
            "dtype_reason": info.dtype_reason,
            "engine_process": server.engine_process,
            "worker_priority": worker_priority(a.worker_priority, torch.device(info.device))}
    return {**http, "engine": "http"}, local, pairs, meta


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    from common.serve.bench import check_run_args
    check_run_args(a)  # the workload bench-serve will get (runs, size, rate), before the model loads
    a.max_queue_delay_ms = queue_delay_ms(a)  # the JSON's config records the wait used
    if not a.max_queue_delay_ms and a.queue_quiet_ms != QUIET_MS:
        raise ValueError("--queue-quiet-ms: only with a queue delay (a burst's, or --max-queue-delay-ms > 0); "
                         "at a rate there is none")
    burst = _is_burst(a)
    with tempfile.TemporaryDirectory(prefix="stagewise-serve-overhead-") as tmp:
        http, local, pairs, meta = run_paired(a, Path(tmp))
    http_entry = {k: v for k, v in http.items() if k != "env"}
    print(format_comparison([http_entry, local]), flush=True)
    figures = overhead(http_entry, local, pairs, burst)
    for p in pairs:
        intake = (f"; burst intake {p['intake_span_ms']['http']:.1f} ms over HTTP, "
                  f"{p['intake_span_ms']['in_process']:.1f} ms in-process") if burst else ""
        print(f"pair ({p['first']} first): TTFT p50 net of prefill {p['ttft_p50_added_ms']:+.2f} ms "
              f"(raw {p['ttft_p50_added_raw_ms']:+.2f} ms), throughput {p['throughput_loss_pct']:+.1f}% lost"
              f"{intake}", flush=True)
    ttft_target = f"target <= {TARGETS['ttft_p50_added_ms']:g} ms" if burst else "not judged at a rate"
    print(f"HTTP cost (median of {len(pairs)} pairs): completion throughput {figures['throughput_loss_pct']:+.1f}% "
          f"lost (target <= {TARGETS['throughput_loss_pct']:g}%), TTFT p50 {figures['ttft_p50_added_ms']:+.2f} ms "
          f"({ttft_target}); the event loop's CPU "
          f"{figures['loop_cpu_us_per_request']:.0f} us per request ({a.max_new_tokens} tokens each)", flush=True)
    if a.json:  # shaped like a bench JSON: the HTTP side on top, the in-process side under `compare`
        write_json(a.json, {"kind": "serve-overhead", "command": shlex.join(["stagewise", "serve-overhead", *argv]),
                            **meta, "config": vars(a), "env": collect_env(meta["device"]),
                            "cpu_affinity": _affinity(), "overhead": figures,
                            **{k: v for k, v in http_entry.items() if k not in ("config", "model")},
                            "bench_serve_config": http_entry.get("config"), "compare": [local]})
    return 0


def _affinity() -> list[int] | None:
    """The cores this run was pinned to (taskset), which matters more than the core count."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


if __name__ == "__main__":  # as `stagewise serve-overhead`: bad input is one line and status 2
    sys.exit(run_command(main, "stagewise serve-overhead"))
