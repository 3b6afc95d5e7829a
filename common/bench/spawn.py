"""Each engine of a comparison measured alone, in a fresh process: the parent's side.

Why: on a CPU the same engine's throughput depends on what ran before it in the process (glibc
malloc thresholds, page faults, allocator caches). Measured on a 2-core CPU, stage 09 alone in
five fresh processes gave 64-144 completion tok/s, 45-56 with a second engine in the process and
130-150 after transformers' generate. So a number from a shared process depends on run order.
Every A/B (bench `--compare` / `--baseline`, the ladder) therefore runs each engine in its own
`python -m common.bench.child` (common/bench/child.py): it loads the model, rebuilds the workload
from the same flags and seed, does the warmup and the repeats, measures the matmul floor
(common/bench/floor.py), and writes back JSON. The parent prints the reports and checks the
greedy token ids across engines, as before.

With `--rounds R` each engine gets R fresh processes, interleaved (A B C, A B C, ...), and its
runs are pooled: a shared VM has slow minutes, and one that falls on one engine's only process
moves that engine alone (the same stage 09 code gave 85 and 119 ms decode steps in two rungs of
one ladder); spread over rounds, it falls on every engine alike.

The child never imports this module: it runs what the parent names, and the parent knows the
child only as a command line and two JSON files.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common.bench.engines import check_same_tokens
from common.bench.workloads import workload_digest

REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerError(RuntimeError):
    """An engine's worker process failed; the message names the engine and its exit code."""


def child_env() -> dict[str, str]:
    """This process's environment for a fresh `python -m ...` of this checkout: the checkout first
    on PYTHONPATH, whatever was there after it (on a GPU machine, the carried wheels: gpu_env.sh)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def spawn(job: dict, engine: str) -> dict:
    """Run `job` in a fresh `python -m common.bench.child` and return its JSON.

    The child shares our stdout and stderr, so its progress and any traceback show as they
    happen; a non-zero exit raises WorkerError naming the engine instead of hanging or guessing."""
    with tempfile.TemporaryDirectory(prefix="stagewise-worker-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job, default=str))
        sys.stdout.flush()
        sys.stderr.flush()
        proc = subprocess.Popen([sys.executable, "-m", "common.bench.child", str(job_path), str(out_path)],
                                cwd=REPO_ROOT, env=child_env())
        code = proc.wait()
        if code != 0 or not out_path.is_file():
            raise WorkerError(f"{engine}: its worker process (pid {proc.pid}) exited with code {code}"
                              f"{'' if code else ' without a result'}; its error is printed above")
        result = json.loads(out_path.read_text())
    result["process"] = {"fresh_process": True, "engines_in_process": 1, "pid": proc.pid, "exit_code": code}
    return result


# ----------------------------------------------------------------------------- parent side

def merge_rounds(rounds: list[dict]) -> dict:
    """One engine's worker results from several fresh processes, pooled as if from one: every
    timed run, every floor sample (the floor is their median), every process. Greedy decoding is
    deterministic, so a round whose first-run tokens differ from round 1's is an error."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    got = dict(rounds[-1])  # kv, env: the last process's
    got["summaries"] = [s for r in rounds for s in r["summaries"]]
    got["first_tokens"] = first["first_tokens"]
    got["setup_s"] = [t for r in rounds for t in r.get("setup_s") or []]
    samples = [t for r in rounds for t in r["floor"]["floor_samples_ms"]]
    got["floor"] = {**first["floor"], "floor_ms": float(statistics.median(samples)), "floor_samples_ms": samples}
    got["process"] = {**first["process"], "pids": [r["process"]["pid"] for r in rounds], "rounds": len(rounds)}
    got["error"] = next((r.get("error") for r in rounds if r.get("error")), None)
    if got["error"] is None and any(r["first_tokens"] != first["first_tokens"] for r in rounds):
        got["error"] = "its greedy token ids differ between rounds (fresh processes)"
    return got


def run_bench_engines(specs: list, stage_package: str, argv: list[str], mode: str, requests: list,
                      rounds: int = 1) -> dict:
    """Each bench engine alone in its own worker process (warmups, then repeats), one after the
    other, `rounds` times over; their results land on `specs` (common.bench.engines.EngineSpec). Returns
    the token-id check."""
    digest = workload_digest(requests)
    got: dict[str, list[dict]] = {spec.name: [] for spec in specs}
    for r in range(rounds):
        for spec in specs:
            print(f"=== {spec.name}: fresh process{_round(r, rounds)} ===", flush=True)
            job = {"kind": "bench", "package": stage_package, "argv": argv, "engine": spec.name, "mode": mode}
            result = spawn(job, spec.name)
            if result["workload_digest"] != digest:
                raise WorkerError(f"{spec.name}: its worker built a different workload (digest "
                                  f"{result['workload_digest']} != {digest}); the workload must depend on the flags only")
            got[spec.name].append(result)
    for spec in specs:
        merged = merge_rounds(got[spec.name])
        if merged.get("error"):
            raise WorkerError(f"{spec.name}: {merged['error']}")
        spec.summaries, spec.first_tokens = merged["summaries"], merged["first_tokens"]
        spec.kv, spec.floor, spec.process = merged["kv"], merged["floor"], merged["process"]
    return check_same_tokens(specs, requests)


def run_ladder_engines(engines: list, argv: list[str], requests: list, rounds: int = 1) -> None:
    """Each ladder rung (common.bench.ladder_rungs.Engine) alone in its own worker process, one after the
    other, `rounds` times over; a rung whose worker fails gets `error` set and the ladder goes on
    without it."""
    digest = workload_digest(requests)
    got: dict[str, list[dict]] = {e.name: [] for e in engines}
    for r in range(rounds):
        for e in engines:
            if e.error is not None or any(result.get("error") for result in got[e.name]):
                continue  # a rung that failed once is not run again
            print(f"=== {e.name}: fresh process{_round(r, rounds)} ===", file=sys.stderr, flush=True)
            try:
                result = spawn({"kind": "ladder", "argv": argv, "engine": e.name}, e.name)
            except WorkerError as exc:
                e.error = str(exc)
                print(f"WARNING: {e.error}", file=sys.stderr, flush=True)
                continue
            if result["workload_digest"] != digest:
                result["error"] = f"its worker built a different workload (digest {result['workload_digest']} != {digest})"
            got[e.name].append(result)
    for e in engines:
        if not got[e.name]:
            continue
        merged = merge_rounds(got[e.name])
        e.error = e.error or merged["error"]
        e.summaries, e.first_tokens, e.kv = merged["summaries"], merged["first_tokens"], merged["kv"]
        e.setup_s, e.floor, e.process = merged["setup_s"], merged["floor"], merged["process"]


def _round(r: int, rounds: int) -> str:
    return f", round {r + 1} of {rounds}" if rounds > 1 else ""
