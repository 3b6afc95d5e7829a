"""The engines of a bench: how each is built, run and summed up, in this process.

An `EngineSpec` is one engine of a comparison (a stage, or transformers' `generate` with
`--baseline hf`). The harness (common/bench/harness.py) runs the specs here when there is one,
or when `--same-process` says so; otherwise each runs in a process of its own
(common/bench/spawn.py), whose child (common/bench/child.py) runs it here, alone. Both sides
import this module, so the two ways of running an engine cannot drift apart.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from common import stages as registry
from common.bench.flags import describe_workload
from common.bench.knobs import accepted, engine_knobs, knobs_not_taken
from common.bench.floor import with_x_floor
from common.bench.metrics import median_summary, summarize
from common.bench.workloads import fresh_copies


@dataclass
class EngineSpec:
    """One engine in a comparison: how to build it, the engine itself, and its run summaries."""
    name: str                              # "s02_kv_cache" or "hf_generate"
    factory: Callable[[], Any]             # builds the engine (per run, or once with --reuse-engine)
    module: ModuleType | None = None       # the stage package (None for the HF baseline)
    engine: Any = None
    knobs: dict = field(default_factory=dict)  # the engine knobs its constructor accepted
    summaries: list[dict] = field(default_factory=list)
    first_tokens: list[list[int]] | None = None  # token ids of its first run, per request
    kv: dict | None = None                 # kv_stats() of its last run (kv_of_run), here or in its worker process
    floor: dict | None = None              # floor_ms, floor_batch (measured in its process)
    process: dict | None = None            # fresh_process, pid, exit_code


# ----------------------------------------------------------------------------- building

def stage_spec(package: str, args: argparse.Namespace, loaded, notes: list[str]) -> EngineSpec:
    module = importlib.import_module(package)
    knobs = accepted(module.InferenceEngine, engine_knobs(args))
    ignored = knobs_not_taken(module, args)
    if ignored:
        notes.append(f"{registry.short_name(package)} takes no {', '.join(ignored)}: not applied")
    return EngineSpec(registry.short_name(package),
                      lambda: module.InferenceEngine(loaded, max_batch_size=args.max_batch_size, **knobs), module,
                      knobs=knobs)


def hf_spec(args: argparse.Namespace, loaded) -> EngineSpec:
    from common.bench import hf_baseline
    return EngineSpec("hf_generate", lambda: hf_baseline.HFGenerateEngine(loaded, max_batch_size=args.max_batch_size))


def build_specs(stage_package: str, args: argparse.Namespace, loaded, notes: list[str]) -> list[EngineSpec]:
    specs = [stage_spec(stage_package, args, loaded, notes)]
    if args.compare:
        prev = registry.previous_stage(stage_package)
        if prev is None:
            notes.append("--compare: this is the first stage; nothing to compare with")
        else:
            try:
                specs.append(stage_spec(prev, args, loaded, notes))
            except ImportError as exc:
                notes.append(f"--compare: {registry.short_name(prev)} does not import ({exc}); skipped")
    if args.baseline == "hf":
        specs.append(hf_spec(args, loaded))
    return specs


# ----------------------------------------------------------------------------- running

def wall_seconds(completions: list, t_start: float, t_end: float) -> float:
    """First submission -> last token (post 030's definition), from the engines' own stamps."""
    starts = [c.timings["submitted"] for c in completions if "submitted" in (c.timings or {})]
    ends = [c.token_timestamps[-1] for c in completions if c.token_timestamps]
    return max(1e-9, (max(ends) if ends else t_end) - (min(starts) if starts else t_start))


def run_offline_once(spec: EngineSpec, requests: list) -> tuple[dict, list]:
    batch = fresh_copies(requests)
    t0 = time.perf_counter()
    completions = spec.engine.generate(batch)
    t1 = time.perf_counter()
    return summarize(completions, wall_s=wall_seconds(completions, t0, t1)), completions


def check_same_tokens(specs: list[EngineSpec], requests: list) -> dict:
    """Greedy decoding is deterministic: every engine's first run must give the stage's token ids."""
    if not all(r.params.greedy for r in requests):
        return {"checked": False, "reason": "sampling workload"}
    mismatches: dict[str, dict] = {}
    ref = specs[0].first_tokens or []
    for spec in specs[1:]:
        got = spec.first_tokens or []
        for i in range(max(len(ref), len(got))):
            a = ref[i] if i < len(ref) else None
            b = got[i] if i < len(got) else None
            if a != b:
                mismatches[spec.name] = {"request": i, specs[0].name: a, spec.name: b}
                print(f"WARNING: token ids differ between {specs[0].name} and {spec.name} at request {i} "
                      f"(prompt {requests[i].prompt!r:.60}):\n  {specs[0].name}: {a}\n  {spec.name}: {b}",
                      file=sys.stderr, flush=True)
                break
    if len(specs) > 1 and not mismatches:
        print(f"correctness: greedy token ids identical across {', '.join(s.name for s in specs)}", flush=True)
    return {"checked": len(specs) > 1, "equal": not mismatches, "mismatches": mismatches}


# kv_stats() fields that count events. An engine that serves several runs (a ladder rung; the bench
# with --reuse-engine) adds them up over its runs: a result keeps the last run's share, as a fresh
# engine a run (the bench's default) gives. Its peaks and means are over all its runs of one workload.
KV_COUNTERS = ("prefix_cache_hits", "prefix_cache_misses", "prefix_cache_hit_tokens", "prefix_cache_query_tokens",
               "num_preemptions", "recomputed_tokens", "steps_while_waiting", "graph_steps", "eager_steps")


def kv_of_run(engine: Any, before: dict | None) -> dict | None:
    """kv_stats() after a run, its counters less what they held before it (`before`)."""
    if not hasattr(engine, "kv_stats"):
        return None
    kv = engine.kv_stats()
    if before is not None:  # the same engine's stats: the same keys
        for name in KV_COUNTERS:
            if name in kv:
                kv[name] -= before[name]
    return kv


def run_engines(specs: list[EngineSpec], run_once: Callable[[EngineSpec], tuple[dict, list]], requests: list,
                warmup_runs: int, repeat_runs: int, fresh_engine: bool,
                after_run: Callable[[], None] | None = None) -> dict:
    """Warmups, then repeats alternating engines (A B A B ...); returns the correctness record.
    `after_run` is called after every timed run (the worker samples the matmul floor there)."""
    correctness: dict = {"checked": False}

    def one(spec: EngineSpec) -> dict:
        before = None
        if spec.engine is None or fresh_engine:
            spec.engine = spec.factory()
        elif hasattr(spec.engine, "kv_stats"):
            before = spec.engine.kv_stats()
        summary, completions = run_once(spec)
        spec.kv = kv_of_run(spec.engine, before)
        if spec.first_tokens is None:
            spec.first_tokens = [list(c.token_ids) for c in completions]
        return summary

    for w in range(warmup_runs):
        print(f"=== warmup {w + 1}/{warmup_runs} ===", flush=True)
        for spec in specs:
            one(spec)
        if w == 0:
            correctness = check_same_tokens(specs, requests)
    for r in range(repeat_runs):
        print(f"=== run {r + 1}/{repeat_runs} ===", flush=True)
        for spec in specs:
            spec.summaries.append(one(spec))
            if after_run is not None:
                after_run()
        if warmup_runs == 0 and r == 0:
            correctness = check_same_tokens(specs, requests)
    return correctness


def engine_result(spec: EngineSpec, mode: str) -> dict:
    """Medians over repeats at top level, every run kept under "runs", then the floor fields
    and the process the engine ran in."""
    result = {"engine": spec.name, "mode": mode, **median_summary(spec.summaries)}
    result["runs"] = spec.summaries
    kv = spec.kv if spec.kv is not None else (spec.engine.kv_stats() if hasattr(spec.engine, "kv_stats") else None)
    if kv is not None:
        result["kv"] = kv
    with_x_floor(result, spec.floor)
    result["process"] = spec.process or shared_process(None)
    return result


def shared_process(engines: int | None) -> dict:
    """The `process` record of engines run here: alone (a single-stage bench) or alternating."""
    return {"fresh_process": False, "engines_in_process": engines, "pid": os.getpid(), "exit_code": None}


KNOB_LABELS = {"block_size": "Block size", "kv_cache_max_concurrency": "KV cache max concurrency",
               "num_kv_blocks": "KV blocks", "prefill_max_batch_size": "Prefill max batch size",
               "max_num_batched_tokens": "Max num batched tokens", "max_cudagraph_capture_size": "Max CUDA graph batch",
               "tensor_parallel_size": "Tensor parallel size"}


def knob_header(spec: EngineSpec, device: str) -> dict:
    """Report lines for the knobs this engine took (and its prefix cache, if it has one), on `device`."""
    header = {KNOB_LABELS[k]: v for k, v in spec.knobs.items() if k in KNOB_LABELS}
    if spec.module is not None and accepted(spec.module.InferenceEngine, {"prefix_cache_max_entries": 0}):
        size = spec.knobs.get("prefix_cache_max_entries")
        header["Prefix cache"] = "off" if size == 0 else f"on (max entries {size or 'default'})"
    elif spec.module is not None and accepted(spec.module.InferenceEngine, {"enable_prefix_caching": False}):
        header["Prefix cache"] = "off" if spec.knobs.get("enable_prefix_caching") is False else "on (full blocks)"
    if spec.module is not None and accepted(spec.module.InferenceEngine, {"enforce_eager": True}):
        size = spec.knobs.get("max_cudagraph_capture_size")
        eager = spec.knobs.get("enforce_eager")
        if eager is None:  # the engine picks by device (stages 12+: graphs on CUDA only)
            eager = not device.startswith("cuda")
            off = "off: a CPU has no launches to save (--no-enforce-eager runs the padded path)"
        else:
            off = "off (--enforce-eager)"
        header["CUDA graphs"] = (off if eager else f"decode steps up to batch {size or 'max'} "
                                 "(captured on CUDA, the same padded path eager on a CPU)")
    return header


def dtype_line(loaded) -> str:
    """The report's dtype, and why it was picked (`common.loader.choose_dtype`)."""
    name = str(loaded.dtype).replace("torch.", "")
    return f"{name} ({loaded.dtype_reason})" if loaded.dtype_reason else name


def offline_header(args: argparse.Namespace, loaded, spec: EngineSpec) -> dict:
    return {"Model": loaded.name, "Device": str(loaded.device), "Dtype": dtype_line(loaded),
            "Engine": spec.name, "Mode": "offline generate()", "Workload": describe_workload(args),
            "Max batch size": args.max_batch_size, **knob_header(spec, str(loaded.device)),
            "Repeats": f"{args.repeat_runs} (+{args.warmup_runs} warmup), medians"}
