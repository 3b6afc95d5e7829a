"""`stagewise stability`: the same stage's bench in N fresh processes, and how far they disagree.

Why: a median over repeats inside one process hides what the process itself adds. On a CPU,
glibc malloc thresholds and page faults depend on the process's history, and one stage measured
alone in five fresh processes gave 64 to 144 completion tok/s. A number is only worth
committing when separate processes agree on it, so this runs `stagewise bench --stage N ...`
N times, each a fresh process, and prints each process's completion tok/s, decode step and
`x floor`, their median and the largest deviation from it. With `--repeat-runs N` it also says how
far each process's own runs stray from that process's median: the machine's minutes move the
runs inside a process too, a process's own state does not.

    stagewise stability --stage 9 --processes 5 --model tiny --num-requests 8 --json /tmp/stab.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common.bench.flags import output_file
from common.bench.results import write_json
from common.bench.spawn import REPO_ROOT, child_env

# (result key path, column label, format)
COLUMNS: list[tuple[tuple[str, ...], str, str]] = [
    (("throughput_tok_s", "completion"), "compl tok/s", "{:11.2f}"),
    (("decode_step_ms",), "step ms", "{:8.2f}"),
    (("floor_ms",), "floor ms", "{:8.3f}"),
    (("x_floor",), "x floor", "{:7.2f}"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise stability", description=__doc__.split("\n\n")[0],
                                epilog="Every other flag goes to the stage's bench unchanged.")
    p.add_argument("--stage", required=True, help="stage number or name")
    p.add_argument("--processes", type=int, default=5, help="how many fresh processes (default 5)")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write every process's result and the summary")
    return p


def _get(result: dict, path: tuple[str, ...]) -> float | None:
    node = result
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return float(node)


def deviation(values: list[float]) -> dict[str, float]:
    """Median, min, max and the largest |value - median| / median in percent."""
    med = statistics.median(values)
    worst = max(abs(v - med) for v in values) / med * 100.0 if med else 0.0
    return {"median": med, "min": min(values), "max": max(values), "max_deviation_pct": worst}


def within_processes(results: list[dict]) -> dict | None:
    """With several timed runs per process (`--repeat-runs N`): how far each process's runs stray
    from that process's own median completion tok/s. Runs inside one process that spread as far
    as the processes do point at the machine's minutes; runs that agree while processes do not
    point at each process's own state (allocator, memory placement). None with one run each."""
    per_process, runs = [], []
    for r in results:
        values = [v for run in r.get("runs") or [] if (v := _get(run, ("throughput_tok_s", "completion"))) is not None]
        if len(values) < 2:
            return None
        per_process.append(deviation(values)["max_deviation_pct"])
        runs.append(len(values))
    return {"runs_per_process": min(runs),
            "max_deviation_pct_per_process": per_process, "max_deviation_pct": max(per_process)}


def run_one(stage: str, bench_argv: list[str], index: int, out: Path) -> dict:
    """One `stagewise bench` in a fresh process; its report is kept quiet, its stderr is not."""
    cmd = [sys.executable, "-m", "common.cli", "bench", "--stage", stage, *bench_argv, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise SystemExit(f"stability: process {index + 1} (stage {stage}) exited with code {proc.returncode}; "
                         f"its stderr is above, the end of its stdout:\n{tail}")
    return json.loads(out.read_text())


def format_table(data: dict) -> str:
    head = f"{'process':>7s} {'pid':>8s} " + " ".join(f"{label:>{len(fmt.format(0.0))}s}" for _, label, fmt in COLUMNS)
    lines = [f"=== stability: {data['stage']}, {len(data['processes'])} fresh processes ===",
             f"Bench flags: {shlex.join(data['config']['bench_argv']) or '(the stage defaults)'}", head, "-" * len(head)]
    for i, p in enumerate(data["processes"]):
        cells = [fmt.format(v) if (v := p.get(label)) is not None else f"{'—':>{len(fmt.format(0.0))}s}"
                 for _, label, fmt in COLUMNS]
        lines.append(f"{i + 1:>7d} {p['pid']:>8} " + " ".join(cells))
    for _, label, fmt in COLUMNS:
        s = data["summary"].get(label)
        if s:
            lines.append(f"{label}: median {fmt.format(s['median']).strip()}, range {fmt.format(s['min']).strip()}"
                         f"-{fmt.format(s['max']).strip()}, max deviation from the median {s['max_deviation_pct']:.1f}%")
    inside = data["summary"].get("within_process")
    if inside:
        lines.append(f"compl tok/s inside each process ({inside['runs_per_process']} timed runs): max deviation "
                     f"from that process's median {inside['max_deviation_pct']:.1f}% (per process: "
                     + ", ".join(f"{v:.1f}%" for v in inside["max_deviation_pct_per_process"]) + ")")
    return "\n".join(lines)


def run_stability(argv: list[str]) -> dict:
    args, bench_argv = build_parser().parse_known_args(argv)
    if args.processes < 1:
        raise ValueError("--processes: must be >= 1")
    from common.stages import resolve_stage
    from common.stages import short_name

    package = resolve_stage(args.stage)
    stage = str(args.stage)
    results, rows = [], []
    with tempfile.TemporaryDirectory(prefix="stagewise-stability-") as tmp:
        for i in range(args.processes):
            print(f"=== process {i + 1}/{args.processes} ===", file=sys.stderr, flush=True)
            result = run_one(stage, bench_argv, i, Path(tmp) / f"{i}.json")
            results.append(result)
            row = {label: _get(result, path) for path, label, _ in COLUMNS}
            row["pid"] = (result.get("process") or {}).get("pid")
            rows.append(row)
            print(f"process {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                   if k != "pid" and v is not None), file=sys.stderr, flush=True)
    summary = {}
    for _, label, _ in COLUMNS:
        values = [r[label] for r in rows if r[label] is not None]
        if values:
            summary[label] = deviation(values)
    if (inside := within_processes(results)) is not None:
        summary["within_process"] = inside
    first = results[0]
    data = {"command": "stagewise stability " + shlex.join(argv), "stage": short_name(package),
            "model": first.get("model"), "device": first.get("device"), "dtype": first.get("dtype"),
            "dtype_reason": first.get("dtype_reason"), "config": {"stage": stage, "processes": args.processes, "bench_argv": bench_argv,
                       "bench_config": first.get("config")},
            "env": first.get("env"), "processes": rows, "summary": summary, "results": results}
    print(format_table(data), flush=True)
    if args.json:
        write_json(args.json, data)
    return data


def main(argv: list[str] | None = None) -> int:
    run_stability(list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":  # as `stagewise stability`: bad input is one line and status 2
    from common.commands import run_command
    sys.exit(run_command(main, "stagewise stability"))
