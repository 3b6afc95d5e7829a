"""Where a streaming stage's worker spends a benchmark run: decode steps, prefills, the rest.

    stagewise worker-probe --stage 9 --preset post-052 --model gpt2-random --json /tmp/probe.json

Why: a TPOT is what a request sees, a decode step what the engine does; when the two part (on
an H200, stage 09 under post 052's load gave a token every 19.7 ms while its decode step,
profiled alone at the same batch, took 4.3 ms), the difference is spent somewhere in the worker
thread or waiting for it, and neither the bench nor `profile-decode` says where. torch.profiler
records only the thread that started it, and the worker is a thread the bench does not own.

So this runs the stage's own bench unchanged, in this process (one engine, so the bench does
not fork one), with a stopwatch around the worker's three kinds of work, on the stage's classes:

- `decode`: `SchedulerManager._run_decode_once`, one decode step and pushing its tokens out;
  inside it `step`, the scheduler's `step()` (the forward, sampling, the sessions' bookkeeping),
  whose difference from `decode` is the pushing: detokenizing, flushing, the queues' puts;
- `prefill`: the scheduler's `add_requests` (stage 06 on; `add_request` before), the prefills;
- the rest of the worker's wall time: the loop, waiting for work, and its admission bookkeeping.

Time a thread waits for the GIL inside a section counts in that section: a `step` slower here
than in `profile-decode` at the same batch is the other threads (the bench's submitter and its
consumer per stream) taking the interpreter from the worker. Every bench flag works; the worker
section is added to the bench's own JSON. The timers are perf_counter calls, a microsecond each.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from typing import Any, Callable

import common.bench.envinfo  # noqa: F401  at start: its GIT_AT_START is the code this run measures
from common.bench.flags import output_file

Event = tuple[str, float, float, int, bool | None]  # (section, start, seconds, rows: batch or prompts,
#   eager: did the call run a step without a graph; None where the engine has no graphs to count)


class Stopwatch:
    """Events of the worker's sections, one list per SchedulerManager (the bench makes one a run)."""

    def __init__(self) -> None:
        self.runs: list[list[Event]] = []

    def wrap(self, cls: type, name: str, section: str, rows: Callable[[tuple, Any], int],
             eager_count: Callable[[Any], int | None] | None = None) -> None:
        """`eager_count(obj)`: the engine's count of eager steps (stage 12 on), read around the call
        to tell a step that ran kernel by kernel from one that went through the graphs."""
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            before = eager_count(obj) if eager_count else None
            start = time.perf_counter()
            out = original(obj, *args, **kwargs)
            seconds = time.perf_counter() - start
            eager = None if before is None else eager_count(obj) > before
            if self.runs:
                self.runs[-1].append((section, start, seconds, rows(args, out), eager))
            return out

        setattr(cls, name, timed)

    def new_run(self, cls: type) -> None:
        original = cls.__init__

        @functools.wraps(original)  # the bench reads the signature to pass only the knobs a stage takes
        def init(obj: Any, *args: Any, **kwargs: Any) -> None:
            self.runs.append([])
            original(obj, *args, **kwargs)

        cls.__init__ = init


def eager_count(scheduler: Any) -> int | None:
    """The engine's count of eager steps, where some steps may go through the decode graphs (stage
    12 on, graphs on): None for an engine without graphs, every step of which is eager."""
    engine = scheduler.engine
    return engine.eager_steps if getattr(engine, "graphs", None) is not None else None


def instrument(stage_package: str) -> Stopwatch:
    """Stopwatches on the stage's SchedulerManager and OnlineScheduler classes (this process only)."""
    from common.stages import streaming_stage
    streaming_stage(stage_package)  # a stage with no worker to probe: a ValueError naming it
    server = importlib.import_module(f"{stage_package}.server")
    scheduler = importlib.import_module(f"{stage_package}.scheduler").OnlineScheduler
    watch = Stopwatch()
    watch.new_run(server.SchedulerManager)
    watch.wrap(server.SchedulerManager, "_run_decode_once", "decode", lambda a, out: 0)
    watch.wrap(scheduler, "step", "step", lambda a, out: len(out), eager_count)
    if hasattr(scheduler, "add_requests"):
        watch.wrap(scheduler, "add_requests", "prefill", lambda a, out: len(a[0]))
    else:
        watch.wrap(scheduler, "add_request", "prefill", lambda a, out: 1)
    return watch


def summarize_run(events: list[Event]) -> dict[str, Any]:
    """One run's sections: counts, milliseconds each, and shares of the worker's wall time."""
    by = {s: [e for e in events if e[0] == s] for s in ("decode", "step", "prefill")}
    wall = max(e[1] + e[2] for e in events) - min(e[1] for e in events)
    total = {s: sum(e[2] for e in evs) for s, evs in by.items()}
    steps, prefills = by["step"], by["prefill"]
    rest = wall - total["decode"] - total["prefill"]
    return {**decode_tail(by["decode"], steps),
        "worker_wall_s": wall,
        "decode_steps": len(steps),
        "step_ms": 1e3 * statistics.median(e[2] for e in steps) if steps else None,
        "decode_ms": 1e3 * statistics.median(e[2] for e in by["decode"]) if by["decode"] else None,
        "push_ms_mean": 1e3 * (total["decode"] - total["step"]) / len(steps) if steps else None,
        "batch_mean": sum(e[3] for e in steps) / len(steps) if steps else None,
        "step_tokens": sum(e[3] for e in steps),
        "prefills": len(prefills),
        "prefill_ms": 1e3 * statistics.median(e[2] for e in prefills) if prefills else None,
        "prompts_per_prefill": sum(e[3] for e in prefills) / len(prefills) if prefills else None,
        "share": {"decode": total["decode"] / wall, "prefill": total["prefill"] / wall, "rest": rest / wall},
        **eager_split(steps),
    }


def eager_split(steps: list[Event]) -> dict[str, Any]:
    """Stage 12 on: how many scheduler steps ran eagerly (prompt chunks, no bucket) and how long
    each kind took, median; nothing for an engine without graphs to count."""
    if not steps or any(e[4] is None for e in steps):
        return {}
    eager = [e[2] for e in steps if e[4]]
    graph = [e[2] for e in steps if not e[4]]
    return {"eager_steps": len(eager), "eager_step_ms": 1e3 * statistics.median(eager) if eager else None,
            "eager_step_s_total": sum(eager),
            "graph_steps": len(graph), "graph_step_ms": 1e3 * statistics.median(graph) if graph else None}


def decode_tail(decodes: list[Event], steps: list[Event], slowest: int = 5) -> dict[str, Any]:
    """How the decode steps' times spread: a TPOT follows their mean, a median hides the slow ones.

    Under post 052's load on the H200, stage 09's median decode step was 9.2 ms and its mean
    23.8 ms, with TPOT p50 at 20 ms: a few slow steps held most of the time. `slow_*` counts the
    steps over twice the median and their share of all decode time; `slowest` gives the slowest
    scheduler steps with their place in the run and their batch, to tell a new shape (a batch or
    width first seen) from a stall."""
    if not decodes:
        return {}
    ms = sorted(1e3 * e[2] for e in decodes)
    median = statistics.median(ms)
    slow = [t for t in ms if t > 2 * median]
    ranked = sorted(enumerate(steps), key=lambda ie: -ie[1][2])[:slowest]
    return {
        "decode_ms_mean": sum(ms) / len(ms),
        "decode_ms_p90": statistics.quantiles(ms, n=10, method="inclusive")[-1] if len(ms) > 1 else ms[0],  # numpy's
        "decode_ms_max": ms[-1],
        "slow_decode_steps": len(slow),
        "slow_decode_share": sum(slow) / sum(ms) if sum(ms) else 0.0,
        "slowest": [{"step": i, "ms": 1e3 * e[2], "batch": e[3], "eager": e[4]}
                    for i, e in ranked],
    }


def worker_fields(watch: Stopwatch, warmup_runs: int) -> dict[str, Any]:
    """Every measured run's sections, and the medians across them (the bench's own convention)."""
    runs = [summarize_run(r) for r in watch.runs[warmup_runs:] if r]
    if not runs:
        raise SystemExit("worker-probe: the bench made no SchedulerManager (is this stage 04+, --mode streaming?)")
    keys = {k for r in runs for k, v in r.items() if isinstance(v, (int, float))}
    med = {k: statistics.median(v for r in runs if isinstance(v := r.get(k), (int, float))) for k in sorted(keys)}
    med["share"] = {k: statistics.median(r["share"][k] for r in runs) for k in runs[0]["share"]}
    return {**med, "runs": runs}


def report(w: dict[str, Any], result: dict[str, Any]) -> str:
    share = w["share"]
    return "\n".join([
        f"Worker, medians of {len(w['runs'])} measured runs (stopwatches on the stage's own classes):",
        f"  decode steps: {w['decode_steps']:.0f}, {w['decode_ms']:.2f} ms each: scheduler.step {w['step_ms']:.2f} ms "
        f"+ pushing tokens {w['push_ms_mean']:.2f} ms; mean batch {w['batch_mean']:.1f}",
        f"  decode step spread: mean {w['decode_ms_mean']:.2f} ms, p90 {w['decode_ms_p90']:.2f}, max "
        f"{w['decode_ms_max']:.2f}; {w['slow_decode_steps']:.0f} steps over twice the median hold "
        f"{100 * w['slow_decode_share']:.0f} % of decode time",
        *([f"  steps through the graphs: {w['graph_steps']:.0f}, {w.get('graph_step_ms', 0):.2f} ms each; eager "
             f"(prompt chunks, no bucket): {w['eager_steps']:.0f}, {w.get('eager_step_ms', 0):.2f} ms each, "
             f"{w['eager_step_s_total']:.2f} s in all"] if "eager_steps" in w else []),
        f"  prefills: {w['prefills']:.0f}, {w['prefill_ms']:.2f} ms each, {w['prompts_per_prefill']:.1f} prompts each",
        f"  worker wall {w['worker_wall_s']:.2f} s: decode {100 * share['decode']:.0f} %, prefill "
        f"{100 * share['prefill']:.0f} %, the rest (loop, waiting, admission) {100 * share['rest']:.0f} %",
        f"  against what requests saw: TPOT p50 {result['tpot_ms']['p50']:.2f} ms, ITL p50 {result['itl_ms']['p50']:.2f} ms",
    ])


# --cudnn-attention: where SDPA may take cuDNN, as (DecoderModel.cudnn_attention, .cudnn_attention_captured)
CUDNN_MODES = {"off": (False, False), "graphs": (False, True), "on": (True, True)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="stagewise worker-probe", description=__doc__.split("\n\n")[0],
                                epilog="Every other flag goes to the stage's bench unchanged (one engine: no --compare).")
    p.add_argument("--stage", required=True, help="stage number or name, 04 or later")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="the bench's result with a `worker` section added")
    p.add_argument("--cudnn-attention", choices=CUDNN_MODES, nargs="?", const="on", default="graphs",
                   help="where SDPA may pick its cuDNN backend (CUDA), to compare: 'graphs', the default, only in "
                        "forwards captured into a CUDA graph (fixed shapes, planned once; DecoderModel."
                        "cudnn_attention_captured), 'off' nowhere, 'on' (the flag alone) in every forward, the "
                        "eager steps too, which ran several times slower with it; one rank only")
    a, bench_argv = p.parse_known_args(argv)
    if "--compare" in bench_argv or "--baseline" in bench_argv:
        raise ValueError("worker-probe: --compare/--baseline: one engine only, so that it runs in this process")
    from common.bench.flags import parse_bench_args
    from common.bench.harness import run_stage_bench
    from common.bench.results import write_result
    from common.model import DecoderModel
    from common.stages import resolve_stage

    package = resolve_stage(a.stage)
    if a.cudnn_attention != "graphs" and (getattr(parse_bench_args(importlib.import_module(package), bench_argv),
                                                  "tensor_parallel_size", None) or 1) > 1:  # stage 14's own default is 3
        raise ValueError("worker-probe: --cudnn-attention reaches this process's forwards only, not the ranks "
                         "a --tensor-parallel-size engine starts: add --tensor-parallel-size 1")
    watch = instrument(package)
    defaults = DecoderModel.cudnn_attention, DecoderModel.cudnn_attention_captured
    # Every forward of the run, the worker thread's too, and the graphs captured as the engine starts.
    DecoderModel.cudnn_attention, DecoderModel.cudnn_attention_captured = CUDNN_MODES[a.cudnn_attention]
    try:
        result = run_stage_bench(package, bench_argv)
    finally:
        DecoderModel.cudnn_attention, DecoderModel.cudnn_attention_captured = defaults
    result["worker"] = worker_fields(watch, result["config"]["warmup_runs"])  # the bench's own parse of its flags
    result["worker"]["cudnn_attention"] = a.cudnn_attention
    print(report(result["worker"], result), flush=True)
    if a.json:
        write_result(a.json, result, "worker-probe", argv)
    return 0


if __name__ == "__main__":  # as `stagewise worker-probe`: bad input is one line and status 2
    from common.commands import run_command
    sys.exit(run_command(main, "stagewise worker-probe"))
