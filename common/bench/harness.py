"""The benchmark harness every stage shares: `python -m stages.<stage>.bench`.

Method (the same for every number this project reports):
1. each engine of a comparison in its own fresh process (common/bench/spawn.py), because a
   CPU engine's speed depends on what ran before it in the process; `--same-process` runs them
   all in this one, alternating (A B A B ...), as the harness used to;
2. one workload (`common.bench.workloads`), rebuilt from the same flags and seed in every process
   (checked by a digest), fresh copies of it for every run of every engine;
3. correctness: a greedy workload must give the same token ids on every compared engine in its
   first run (a loud warning names the first differing request);
4. warmup runs, then repeat runs; the report shows medians over repeats plus the run-to-run
   spread; `--json` keeps every run;
5. the matmul floor (common/bench/floor.py) measured in each engine's process after its runs, and
   each engine's decode step (ITL p50) as a multiple of it: `x floor`.
Stages 01-03 are measured through `engine.generate(requests)` (offline); stages that export a
`SchedulerManager` go through `common.bench.streaming`, the posts' streaming benchmark.
"""
from __future__ import annotations

import importlib
import sys

import torch

from common import stages as registry
from common.commands import run_command
from common.bench.engines import build_specs, engine_result, offline_header, run_engines, run_offline_once, shared_process
from common.bench.envinfo import collect_env
from common.bench.flags import check_args, offline_unused, parse_bench_args, workload_from_args
from common.bench.floor import FloorSampler, decode_batch
from common.bench.report import comparison_ratios, format_comparison, format_report
from common.bench.results import write_json


def bench_main(stage_package: str) -> None:
    """`python -m stages.<stage>.bench`: run_stage_bench, with bad input as one line (common/commands.py)."""
    sys.exit(run_command(lambda: run_stage_bench(stage_package), f"python -m {stage_package}.bench"))


def run_stage_bench(stage_package: str, argv: list[str] | None = None, prog: str | None = None) -> dict:
    """Entry point of every `stages/<stage>/bench.py`; returns the JSON-shaped result. `prog`:
    the command named in --help and usage errors (`stagewise bench` says its --stage there)."""
    module = importlib.import_module(stage_package)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_bench_args(module, argv, prog)
    check_args(args)
    from common.loader import load_model, load_weights

    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, weights=False)  # weights: below
    requests = workload_from_args(loaded.tokenizer, args)
    notes: list[str] = []
    specs = build_specs(stage_package, args, loaded, notes)

    mode = args.mode or ("streaming" if hasattr(module, "SchedulerManager") else "offline")
    if mode == "streaming":
        lacking = [s.name for s in specs if s.module is None or not hasattr(s.module, "SchedulerManager")]
        if lacking:
            notes.append(f"{', '.join(lacking)} has no SchedulerManager: every engine runs through offline "
                         f"generate() so the comparison stays like for like")
            mode = "offline"
    if mode == "offline" and any(r.submit_offset_s is not None for r in requests):
        notes.append("offline generate() takes every request at once: the late requests' planned arrivals "
                     "(--long-prompts) are ignored")
    unused = offline_unused(args) if mode == "offline" else []
    if unused:
        notes.append(f"offline generate() has no scheduler manager, submitter or stream: {', '.join(unused)} not applied")
    for note in notes:
        print(f"note: {note}", flush=True)

    fresh = len(specs) > 1 and not args.same_process
    if fresh:  # each child loads the model and samples the floor; this process never runs it
        from common.bench.spawn import run_bench_engines
        correctness = run_bench_engines(specs, stage_package, argv, mode, requests, rounds=args.rounds)
    else:  # the engines run here: the model's weights, and the floor sampled after each run
        floor = FloorSampler(load_weights(loaded).model, decode_batch(args.max_batch_size, len(requests)))
        if mode == "streaming":
            from common.bench import streaming
            correctness = streaming.run_streaming_engines(specs, requests, args, after_run=floor)
        else:
            correctness = run_engines(specs, lambda s: run_offline_once(s, requests), requests,
                                      args.warmup_runs, args.repeat_runs, args.fresh_engine, after_run=floor)
        fields = floor.fields()
        for spec in specs:
            spec.floor = fields
            spec.process = shared_process(len(specs))
    if mode == "streaming":
        from common.bench import streaming
        headers = [streaming.streaming_header(args, loaded, s) for s in specs]
    else:
        headers = [offline_header(args, loaded, s) for s in specs]
    process = "fresh, this engine alone" if fresh or len(specs) == 1 else "shared, engines alternating"
    rounds = args.rounds if fresh else 1
    if rounds > 1:
        process += f", {rounds} processes interleaved with the others'"
    for header in headers:
        header["Process"] = process
        if rounds > 1:
            header["Repeats"] = (f"{args.repeat_runs} (+{args.warmup_runs} warmup) in each of {rounds} "
                                 f"processes, medians of all {rounds * args.repeat_runs}")

    results = [engine_result(s, mode) for s in specs]
    for result, header in zip(results, headers):
        print(format_report(result, header, runs=result["runs"]), flush=True)
    if len(results) > 1:
        print(format_comparison(results), flush=True)
    out = {"stage": registry.short_name(stage_package), "model": loaded.name, "device": str(loaded.device),
           "dtype": str(loaded.dtype).replace("torch.", ""), "dtype_reason": loaded.dtype_reason, "config": vars(args),
           "env": collect_env(loaded.device), **results[0], "compare": results[1:],
           "ratios": comparison_ratios(results), "correctness": correctness, "notes": notes}
    if args.json:
        write_json(args.json, out)
    return out
