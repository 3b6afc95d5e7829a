"""The benchmark harness every stage shares: `python -m stages.<stage>.bench`.

Method (the same for every number this project reports):
1. each engine of a comparison in its own fresh process (common/engine_worker.py), because a
   CPU engine's speed depends on what ran before it in the process; `--same-process` runs them
   all in this one, alternating (A B A B ...), as the harness used to;
2. one workload (`common.workloads`), rebuilt from the same flags and seed in every process
   (checked by a digest), fresh copies of it for every run of every engine;
3. correctness: a greedy workload must give the same token ids on every compared engine in its
   first run (a loud warning names the first differing request);
4. warmup runs, then repeat runs; the report shows medians over repeats plus the run-to-run
   spread; `--json` keeps every run;
5. the matmul floor (common/floor.py) measured in each engine's process after its runs, and
   each engine's decode step (ITL p50) as a multiple of it: `x floor`.
Stages 01-03 are measured through `engine.generate(requests)` (offline); stages that export a
`SchedulerManager` go through `common.streaming_bench`, the posts' streaming benchmark.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from common import stages as registry
from common.envinfo import collect_env
from common.floor import FloorSampler, decode_batch, with_x_floor
from common.metrics import median_summary, summarize
from common.report import comparison_ratios, format_comparison, format_report
from common.workloads import build_workload, fresh_copies

ENGINE_KNOBS = ("block_size", "kv_cache_max_concurrency", "num_kv_blocks",
                "prefix_cache_max_entries", "prefill_max_batch_size", "max_num_batched_tokens")
# Two stages' ways to switch the prefix cache: stages 05-09 count whole-prompt entries, the
# block-level cache of stage 10+ is on or off (vLLM's name). `--no-prefix-cache` sets both.
PREFIX_CACHE_KNOBS = ("prefix_cache_max_entries", "enable_prefix_caching")

# Named workloads (`--preset NAME`): a preset takes the place of the stage's own BENCH (a flag it
# does not set keeps the bench's plain default, not the stage's); typed flags still override.
# "post-052" is post 052's shape (stage 09's BENCH; a test keeps the two equal): `make bench`
# runs it on the newest stage, whatever that stage's own workload, so its numbers compare.
PRESETS: dict[str, dict] = {
    "post-052": {
        "mode": "streaming",
        "prompt": "Hello",
        "pretok": True,
        "stream_interval": 8,
        "num_requests": 64,
        "submit_interval_ms": 20.0,
        "submit_schedule": "absolute",
        "max_new_tokens": 128,
        "max_batch_size": 64,
        "prefill_max_batch_size": 64,
        "no_stop_on_eos": True,
        "no_prefix_cache": True,
        "warmup_runs": 1,
        "repeat_runs": 2,
    },
}


# The workload flags (`workload_from_args` reads them): the benches, the ladder's workers and
# `stagewise bench-serve`, which replays the same workloads over HTTP, all take exactly these.
WORKLOAD_FLAGS: list[tuple[str, dict]] = [
    ("--prompt", {"default": "Hello"}),
    ("--unique-prompts", {"action": "store_true", "help": "append ' #i' to each prompt text"}),
    ("--prompt-len-min", {"type": int, "default": None, "help": "random prompt token ids, min length"}),
    ("--prompt-len-max", {"type": int, "default": None, "help": "random prompt token ids, max length"}),
    ("--num-requests", {"type": int, "default": 32}),
    ("--max-new-tokens", {"type": int, "default": 16}),
    ("--no-stop-on-eos", {"action": "store_true", "help": "always generate max-new-tokens (HTTP: sends ignore_eos)"}),
    ("--long-every", {"type": int, "default": None, "help": "request i wants --long-max-new-tokens if i %% N == 0"}),
    ("--long-max-new-tokens", {"type": int, "default": None, "help": "default 10x --max-new-tokens"}),
    ("--shared-prefix-len", {"type": int, "default": None, "help": "random token prefix shared by all prompts"}),
    ("--repeat-prompts", {"type": int, "default": None, "help": "each distinct prompt sent K times in a row"}),
    ("--long-prompts", {"type": int, "default": None,
                        "help": "K late requests after the others, each --long-prompt-len random token ids"}),
    ("--long-prompt-len", {"type": int, "default": 2000, "help": "tokens in each late long prompt"}),
    ("--long-prompt-interval-ms", {"type": float, "default": 2000.0,
                                   "help": "the first late long prompt arrives after T ms, then one every T ms"}),
]


def add_engine_knob_args(g: argparse._ArgumentGroup) -> None:
    """The stages' engine knobs as flags (the benches and `stagewise serve`); `engine_knobs`
    reads them back, and each is passed only to stages whose constructor takes it."""
    g.add_argument("--max-batch-size", type=int, default=8)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--kv-cache-max-concurrency", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--prefix-cache-max-entries", type=int, default=None)
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="prefix_cache_max_entries=0 (stages 05-09), enable_prefix_caching=False (10+)")
    g.add_argument("--prefill-max-batch-size", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="stage 11+: tokens per step (chunked prefill)")


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
    kv: dict | None = None                 # kv_stats() (from its worker process, or the engine)
    floor: dict | None = None              # floor_ms, floor_batch (measured in its process)
    process: dict | None = None            # fresh_process, pid, exit_code


# ----------------------------------------------------------------------------- flags

def build_parser(prog: str, defaults: dict | None = None) -> argparse.ArgumentParser:
    from common.streaming_bench import add_streaming_args

    p = argparse.ArgumentParser(prog=prog, description="Benchmark a stage (see docs: method).")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | gpt2-random | HF dir")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--seed", type=int, default=0, help="workload RNG and torch seed")
    g = p.add_argument_group("workload")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named workload instead of the stage's BENCH (flags still override); "
                        "post-052: post 052's shape, what `make bench` runs")
    for flag, kwargs in WORKLOAD_FLAGS:
        g.add_argument(flag, **kwargs)
    g = p.add_argument_group("engine knobs (passed only to engines whose constructor takes them)")
    add_engine_knob_args(g)
    # A fresh engine per run (the model stays loaded): caches start cold, as in the posts' one run
    # per process; otherwise a warmup run would turn every timed request into a prefix-cache hit.
    g.add_argument("--reuse-engine", dest="fresh_engine", action="store_false",
                   help="keep one engine across warmup and repeats (its caches stay warm)")
    g = p.add_argument_group("method")
    g.add_argument("--mode", choices=["offline", "streaming"], default=None,
                   help="offline generate() or streaming SchedulerManager (default: streaming when the stage has one)")
    g.add_argument("--warmup-runs", type=int, default=1)
    g.add_argument("--repeat-runs", type=int, default=3)
    g.add_argument("--compare", action="store_true", help="also run the previous stage, same workload")
    g.add_argument("--baseline", choices=["hf"], default=None, help="also run transformers generate")
    g.add_argument("--same-process", action="store_true",
                   help="run compared engines in this one process, alternating (default: each in a fresh process)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON")
    add_streaming_args(p)
    if defaults:
        p.set_defaults(**defaults)
    return p


def bench_defaults(module: ModuleType, parser: argparse.ArgumentParser | None = None) -> dict:
    """A stage's `BENCH` dict turned into argparse defaults (CLI flags still override)."""
    return as_defaults(getattr(module, "BENCH", {}) or {}, parser, f"BENCH of {module.__name__}")


def as_defaults(bench: dict, parser: argparse.ArgumentParser | None, where: str) -> dict:
    """A BENCH-style dict (or a preset) as argparse dests; unknown keys are an error naming `where`."""
    bench = dict(bench)
    if "prompt_len_range" in bench:
        rng = bench.pop("prompt_len_range")
        bench["prompt_len_min"], bench["prompt_len_max"] = (None, None) if rng is None else rng
    if "stop_on_eos" in bench:
        bench["no_stop_on_eos"] = not bench.pop("stop_on_eos")
    known = {a.dest for a in (parser or build_parser("bench"))._actions}
    unknown = sorted(set(bench) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}")
    return bench


def parse_bench_args(module: ModuleType, argv: list[str], prog: str | None = None) -> argparse.Namespace:
    """The flags of a stage's bench: its BENCH (or `--preset`'s workload instead) as defaults,
    then what was typed. The bench and its worker processes both parse here, so they build the
    same workload."""
    prog = prog or f"python -m {module.__name__}.bench"
    parser = build_parser(prog)
    parser.set_defaults(**bench_defaults(module, parser))
    args = parser.parse_args(argv)
    if args.preset is not None:  # a second pass on a parser without the stage's BENCH
        parser = build_parser(prog)
        parser.set_defaults(**as_defaults(PRESETS[args.preset], parser, f"preset {args.preset!r}"))
        args = parser.parse_args(argv)
    return args


def check_args(args: argparse.Namespace) -> None:
    if (args.prompt_len_min is None) != (args.prompt_len_max is None):
        args.prompt_len_min = args.prompt_len_max = args.prompt_len_min or args.prompt_len_max
    for name in ("num_requests", "max_new_tokens", "max_batch_size", "repeat_runs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1")
    if args.warmup_runs < 0:
        raise SystemExit("--warmup-runs: must be >= 0")


def workload_from_args(tokenizer, args: argparse.Namespace):
    rng = None if args.prompt_len_min is None else (args.prompt_len_min, args.prompt_len_max)
    return build_workload(
        tokenizer, prompt=args.prompt, num_requests=args.num_requests, unique_prompts=args.unique_prompts,
        prompt_len_range=rng, max_new_tokens=args.max_new_tokens, long_every=args.long_every,
        long_max_new_tokens=args.long_max_new_tokens, shared_prefix_len=args.shared_prefix_len,
        repeat_prompts=args.repeat_prompts, stop_on_eos=not args.no_stop_on_eos, seed=args.seed,
        pretok=args.pretok, pretok_base_token_ids=args.pretok_base_token_ids, long_prompts=args.long_prompts,
        long_prompt_len=args.long_prompt_len, long_prompt_interval_ms=args.long_prompt_interval_ms)


def describe_workload(args: argparse.Namespace) -> str:
    if args.prompt_len_min is not None:
        text = f"random prompts {args.prompt_len_min}-{args.prompt_len_max} tokens"
    else:
        text = f"prompt {args.prompt!r}" + (" + ' #i'" if args.unique_prompts else "")
    if args.shared_prefix_len:
        text += f", shared prefix {args.shared_prefix_len} tokens"
    if args.repeat_prompts:
        text += f", each prompt x{args.repeat_prompts}"
    text += f", {args.max_new_tokens} new tokens"
    if args.long_every:
        text += f" ({args.long_max_new_tokens or 10 * args.max_new_tokens} for 1 in {args.long_every})"
    text += ", EOS ignored" if args.no_stop_on_eos else ", stop on EOS"
    if args.long_prompts:
        text += (f"; then {args.long_prompts} late prompts of {args.long_prompt_len} random tokens, "
                 f"one every {args.long_prompt_interval_ms:g} ms")
    return text


# ----------------------------------------------------------------------------- engines

def accepted(callable_: Any, knobs: dict) -> dict:
    """The knobs (not None) that `callable_` names in its signature: `--block-size` reaches
    stage 03+ and is simply not offered to stage 02, whose constructor has no such parameter."""
    try:
        params = inspect.signature(callable_).parameters
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {k: v for k, v in knobs.items() if v is not None and k in params and params[k].kind in kinds}


def engine_knobs(args: argparse.Namespace) -> dict:
    knobs = {k: getattr(args, k) for k in ENGINE_KNOBS}
    if args.no_prefix_cache:
        knobs["prefix_cache_max_entries"] = 0
        knobs["enable_prefix_caching"] = False
    return knobs


def stage_spec(package: str, args: argparse.Namespace, loaded, notes: list[str]) -> EngineSpec:
    module = importlib.import_module(package)
    knobs = accepted(module.InferenceEngine, engine_knobs(args))
    ignored = sorted(k for k, v in engine_knobs(args).items() if v is not None and k not in knobs)
    manager = getattr(module, "SchedulerManager", None)
    if manager is not None:  # knobs the manager takes itself (e.g. prefill_max_batch_size) are not "ignored"
        ignored = [k for k in ignored if k not in accepted(manager, engine_knobs(args))]
    # `--no-prefix-cache` reached the stage if it took either of the two knobs; report it once otherwise.
    took_cache_knob = any(k in knobs for k in PREFIX_CACHE_KNOBS)
    explicit = {"prefix_cache_max_entries"} if args.prefix_cache_max_entries is not None else set()
    ignored = [k for k in ignored if k not in PREFIX_CACHE_KNOBS or k in explicit
               or (not took_cache_knob and k == "prefix_cache_max_entries")]
    if ignored:
        notes.append(f"{registry.short_name(package)} takes no {', '.join(ignored)}: not applied")
    return EngineSpec(registry.short_name(package),
                      lambda: module.InferenceEngine(loaded, max_batch_size=args.max_batch_size, **knobs), module,
                      knobs=knobs)


def hf_spec(args: argparse.Namespace, loaded) -> EngineSpec:
    from common import hf_baseline
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
    """First submission -> last token (post 000's definition), from the engines' own stamps."""
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


def run_engines(specs: list[EngineSpec], run_once: Callable[[EngineSpec], tuple[dict, list]], requests: list,
                warmup_runs: int, repeat_runs: int, fresh_engine: bool,
                after_run: Callable[[], None] | None = None) -> dict:
    """Warmups, then repeats alternating engines (A B A B ...); returns the correctness record.
    `after_run` is called after every timed run (the worker samples the matmul floor there)."""
    correctness: dict = {"checked": False}

    def one(spec: EngineSpec) -> dict:
        if spec.engine is None or fresh_engine:
            spec.engine = spec.factory()
        summary, completions = run_once(spec)
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


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)


KNOB_LABELS = {"block_size": "Block size", "kv_cache_max_concurrency": "KV cache max concurrency",
               "num_kv_blocks": "KV blocks", "prefill_max_batch_size": "Prefill max batch size",
               "max_num_batched_tokens": "Max num batched tokens"}


def knob_header(spec: EngineSpec) -> dict:
    """Report lines for the knobs this engine took (and its prefix cache, if it has one)."""
    header = {KNOB_LABELS[k]: v for k, v in spec.knobs.items() if k in KNOB_LABELS}
    if spec.module is not None and accepted(spec.module.InferenceEngine, {"prefix_cache_max_entries": 0}):
        size = spec.knobs.get("prefix_cache_max_entries")
        header["Prefix cache"] = "off" if size == 0 else f"on (max entries {size or 'default'})"
    elif spec.module is not None and accepted(spec.module.InferenceEngine, {"enable_prefix_caching": False}):
        header["Prefix cache"] = "off" if spec.knobs.get("enable_prefix_caching") is False else "on (full blocks)"
    return header


def offline_header(args: argparse.Namespace, loaded, spec: EngineSpec) -> dict:
    return {"Model": loaded.name, "Device": str(loaded.device), "Dtype": str(loaded.dtype).replace("torch.", ""),
            "Engine": spec.name, "Mode": "offline generate()", "Workload": describe_workload(args),
            "Max batch size": args.max_batch_size, **knob_header(spec),
            "Repeats": f"{args.repeat_runs} (+{args.warmup_runs} warmup), medians"}


def run_stage_bench(stage_package: str, argv: list[str] | None = None) -> dict:
    """Entry point of every `stages/<stage>/bench.py`; returns the JSON-shaped result."""
    module = importlib.import_module(stage_package)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_bench_args(module, argv)
    check_args(args)
    from common.loader import load_model

    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
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
    for note in notes:
        print(f"note: {note}", flush=True)

    fresh = len(specs) > 1 and not args.same_process
    floor = FloorSampler(loaded.model, decode_batch(args.max_batch_size, len(requests)))  # in-process runs
    if fresh:
        from common.engine_worker import run_bench_engines
        correctness = run_bench_engines(specs, stage_package, argv, mode, requests)
    elif mode == "streaming":
        from common import streaming_bench
        correctness = streaming_bench.run_streaming_engines(specs, requests, args, after_run=floor)
    else:
        correctness = run_engines(specs, lambda s: run_offline_once(s, requests), requests,
                                  args.warmup_runs, args.repeat_runs, args.fresh_engine, after_run=floor)
    if not fresh:  # sampled after each run here, as each worker does in its own process
        fields = floor.fields()
        for spec in specs:
            spec.floor = fields
            spec.process = shared_process(len(specs))
    if mode == "streaming":
        from common import streaming_bench
        headers = [streaming_bench.streaming_header(args, loaded, s) for s in specs]
    else:
        headers = [offline_header(args, loaded, s) for s in specs]
    for header in headers:
        header["Process"] = "fresh, this engine alone" if fresh or len(specs) == 1 else "shared, engines alternating"

    results = [engine_result(s, mode) for s in specs]
    for result, header in zip(results, headers):
        print(format_report(result, header, runs=result["runs"]), flush=True)
    if len(results) > 1:
        print(format_comparison(results), flush=True)
    out = {"stage": registry.short_name(stage_package), "model": loaded.name, "device": str(loaded.device),
           "dtype": str(loaded.dtype).replace("torch.", ""), "config": vars(args),
           "env": collect_env(loaded.device), **results[0], "compare": results[1:],
           "ratios": comparison_ratios(results), "correctness": correctness, "notes": notes}
    if args.json:
        write_json(args.json, out)
    return out
