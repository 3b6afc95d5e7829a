"""What HTTP costs: one workload through `stagewise serve` + `bench-serve`, and in-process.

    stagewise serve-overhead --stage 9 --model smollm2-135m --json docs/results/serve.cpu.json

Three fresh processes, one after the other, on one machine: (1) the stage's own streaming
benchmark (`stagewise bench`, the SchedulerManager in-process); (2) `stagewise serve` with the
same engine knobs; (3) `stagewise bench-serve` against it, same workload, same warmups and
repeats. The JSON keeps both results whole, the env of this run, and the two figures the docs
quote: the completion-throughput loss and the TTFT p50 added by HTTP. The client shares the
machine with the server, as a benchmark client on the same box does.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common.bench import write_json
from common.envinfo import REPO_ROOT, collect_env
from common.report import format_comparison

TARGETS = {"throughput_loss_pct": 10.0, "ttft_p50_added_ms": 5.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise serve-overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="9")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompt", default="Hello")
    p.add_argument("--num-requests", type=int, default=64, help="one burst of this many requests")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--prefill-max-batch-size", type=int, default=64)
    # On for both sides: an idle worker waits for the rest of a burst, so neither side splits it and
    # the difference is what HTTP costs. The quiet window is well above the arrival gaps seen over
    # HTTP on a shared 2-core CPU (13 ms, and more when another job runs); it costs nothing here,
    # because the burst fills the batch (--num-requests = --max-batch-size), which ends the wait.
    p.add_argument("--max-queue-delay-ms", type=float, default=200.0, help="both sides; 0: off")
    p.add_argument("--queue-quiet-ms", type=float, default=50.0, help="both sides")
    p.add_argument("--warmup-runs", type=int, default=1)
    p.add_argument("--repeat-runs", type=int, default=3)
    p.add_argument("--json", default=None, metavar="PATH", help="e.g. docs/results/serve.cpu.json")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per side")
    return p


def _workload_flags(a: argparse.Namespace) -> list[str]:
    """The workload both sides run: a burst of distinct prompts, fixed length (EOS ignored)."""
    return ["--model", a.model, "--prompt", a.prompt, "--unique-prompts", "--num-requests", str(a.num_requests),
            "--max-new-tokens", str(a.max_new_tokens), "--no-stop-on-eos",
            "--warmup-runs", str(a.warmup_runs), "--repeat-runs", str(a.repeat_runs)]


def _engine_flags(a: argparse.Namespace) -> list[str]:
    """Identical engine knobs on both sides; the prefix cache off, so every run does the same work."""
    flags = ["--device", a.device, "--max-batch-size", str(a.max_batch_size),
             "--prefill-max-batch-size", str(a.prefill_max_batch_size), "--no-prefix-cache", "--stream-interval", "1",
             "--max-queue-delay-ms", str(a.max_queue_delay_ms), "--queue-quiet-ms", str(a.queue_quiet_ms)]
    return flags + (["--dtype", a.dtype] if a.dtype else [])


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "common.cli", *args]


def run_inprocess(a: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "common.serve_overhead", "in-process", "--stage", a.stage,
           *_workload_flags(a), *_engine_flags(a), "--json", str(out)]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, timeout=a.timeout_s)
    return json.loads(out.read_text())


def in_process_main(argv: list[str]) -> int:
    """The in-process side: the stage's streaming benchmark with the benches' flags, but NOT the
    stage's BENCH defaults (pretok, long requests, ...), so both sides run exactly these flags."""
    import torch

    from common import bench, streaming_bench
    from common.cli import resolve_stage
    from common.loader import load_model
    from common.report import format_report

    stage, rest = None, list(argv)
    if rest[:1] == ["--stage"]:
        stage, rest = rest[1], rest[2:]
    package = resolve_stage(stage)
    args = bench.build_parser("stagewise serve-overhead in-process").parse_args(rest)
    bench.check_args(args)
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    requests = bench.workload_from_args(loaded.tokenizer, args)
    spec = bench.stage_spec(package, args, loaded, notes := [])
    correctness = streaming_bench.run_streaming_engines([spec], requests, args)
    result = bench.engine_result(spec, "streaming")
    print(format_report(result, streaming_bench.streaming_header(args, loaded, spec), runs=result["runs"]), flush=True)
    bench.write_json(args.json, {"stage": spec.name, "model": loaded.name, "device": str(loaded.device),
                                 "dtype": str(loaded.dtype).replace("torch.", ""), "config": vars(args),
                                 "env": collect_env(loaded.device), **result, "correctness": correctness,
                                 "notes": notes})
    return 0


def start_server(a: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`stagewise serve --port 0` in a fresh process; returns it and its base URL once healthy."""
    cmd = _cli("serve", "--stage", a.stage, "--port", "0", "--host", "127.0.0.1", *_engine_flags(a), "--model", a.model)
    print("$", " ".join(cmd[2:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    match = re.search(r"http://[\d.]+:\d+", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"serve did not start: {line!r}")
    url = match.group(0)
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("serve never became healthy")


def run_http(a: argparse.Namespace, out: Path) -> dict:
    proc, url = start_server(a)
    try:
        cmd = _cli("bench-serve", "--base-url", url, *_workload_flags(a), "--json", str(out))
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, cwd=REPO_ROOT, check=True, timeout=a.timeout_s)
    finally:
        proc.send_signal(signal.SIGTERM)  # a graceful stop, as Ctrl-C
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return json.loads(out.read_text())


def overhead(http: dict, local: dict) -> dict:
    """HTTP's cost, positive = HTTP is worse; and whether it stays inside the issue's targets.

    TTFT like for like: an HTTP client stamps the first token when it reads it, so the
    in-process side is read where its consumer thread gets the token (`ttft_received_ms`), not
    where the worker sampled it (`ttft_ms`, kept as `ttft_p50_ms.in_process_sampled`). Results
    from before that stamp existed fall back to `ttft_ms`.
    """
    tput_http, tput_local = http["throughput_tok_s"]["completion"], local["throughput_tok_s"]["completion"]
    loss = 100.0 * (1.0 - tput_http / tput_local) if tput_local else float("nan")
    local_ttft = (local.get("ttft_received_ms") or local["ttft_ms"])["p50"]
    added = http["ttft_ms"]["p50"] - local_ttft
    return {"throughput_loss_pct": loss, "ttft_p50_added_ms": added,
            "throughput_completion_tok_s": {"http": tput_http, "in_process": tput_local},
            "ttft_p50_ms": {"http": http["ttft_ms"]["p50"], "in_process": local_ttft,
                            "in_process_sampled": local["ttft_ms"]["p50"]},
            "targets": TARGETS, "within_targets": loss <= TARGETS["throughput_loss_pct"]
            and added <= TARGETS["ttft_p50_added_ms"]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["in-process"]:
        return in_process_main(argv[1:])
    a = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stagewise-serve-overhead-") as tmp:
        local = run_inprocess(a, Path(tmp) / "in_process.json")
        http = run_http(a, Path(tmp) / "http.json")
    local_entry = {**{k: local[k] for k in local if k not in ("compare", "ratios", "env")}, "engine": "in-process"}
    http_entry = {**{k: http[k] for k in http if k != "env"}, "engine": "http"}
    print(format_comparison([http_entry, local_entry]), flush=True)
    figures = overhead(http_entry, local_entry)
    print(f"HTTP cost: completion throughput {figures['throughput_loss_pct']:+.1f}% lost "
          f"(target <= {TARGETS['throughput_loss_pct']:g}%), TTFT p50 {figures['ttft_p50_added_ms']:+.2f} ms "
          f"(target <= {TARGETS['ttft_p50_added_ms']:g} ms)", flush=True)
    if a.json:  # shaped like a bench JSON: the HTTP side on top, the in-process side under `compare`
        http_side = {k: v for k, v in http_entry.items() if k not in ("config", "model")}
        write_json(a.json, {"kind": "serve-overhead", "command": shlex.join(["stagewise", "serve-overhead", *argv]),
                            "stage": local.get("stage"), "model": local.get("model"), "device": local.get("device"),
                            "dtype": local.get("dtype"), "config": vars(a), "env": collect_env(local.get("device")),
                            "cpu_affinity": _affinity(), "overhead": figures, **http_side,
                            "bench_serve_config": http_entry.get("config"), "compare": [local_entry]})
    return 0


def _affinity() -> list[int] | None:
    """The cores this run was pinned to (taskset), which matters more than the core count."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


if __name__ == "__main__":
    sys.exit(main())
