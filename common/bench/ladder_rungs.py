"""The ladder's rungs: its flags, its engines (every stage, transformers' two), and how one runs.

`stagewise ladder` (common/bench/ladder.py) builds these in its own process to plan the run;
each rung's fresh process (common/bench/child.py) builds the same from the same flags and runs
its one rung here. Apart from the ladder's entry point so that the child never imports the
code that spawns it.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from common import stages as registry
from common.bench.engines import kv_of_run, wall_seconds
from common.bench.flags import output_dir
from common.bench.knobs import accepted
from common.bench.ladder_workloads import DEFAULT_MAX_BATCH_SIZE, WORKLOADS, auto_kv_blocks, workload_kwargs
from common.bench.metrics import summarize
from common.bench.workloads import build_workload, fresh_copies
from common.commands import add_model_args
from common.threads import set_intra_op_threads


@dataclass
class Engine:
    """One rung of the ladder: how to build it, how to run it once, and what it measured."""
    name: str
    label: str                              # short name for the table and chart
    factory: Callable[[], Any]
    mode: str = "offline"                   # "offline" generate() or "streaming" SchedulerManager
    stage: int | None = None
    module: Any = None
    engine: Any = None
    summaries: list[dict] = field(default_factory=list)
    first_tokens: list[list[int]] | None = None   # token ids of its first run (the correctness check)
    match: bool | None = None                     # those ids equal the reference engine's
    error: str | None = None
    kv: dict | None = None                        # kv_stats() of its last timed run (run_all), or from its worker
    setup_s: list[float] | None = None
    floor: dict | None = None                     # floor_ms, floor_batch, measured in its process
    process: dict | None = None                   # fresh_process, pid, exit_code


@dataclass
class Setup:
    """What every engine of a ladder shares: the model, the workload, the KV pool size."""
    loaded: Any
    requests: list
    kw: dict
    num_blocks: int


# ----------------------------------------------------------------------------- flags

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise ladder", description="Every stage and Hugging Face on one workload.")
    add_model_args(p)
    p.add_argument("--out", type=output_dir, required=True, help="directory for ladder.<device>[.<tag>].{json,png,txt}")
    p.add_argument("--tag", nargs="?", const="", default=None,
                   help="add a suffix to the file names (--tag alone: the workload name)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the workload's (long ones scale)")
    p.add_argument("--max-batch-size", type=int, default=None, help="default: the workload's, else 8")
    p.add_argument("--prefill-max-batch-size", type=int, default=None, help="stage 07+ managers (streaming mode)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool of stages 03+ (default: fits the workload)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step of stages 11+ (decode rows + prompt chunks; default: each stage's)")
    p.add_argument("--mode", choices=["offline", "streaming"], default="offline",
                   help="streaming: stages 04+ through their SchedulerManager (shows stages 06-09)")
    p.add_argument("--warmup-runs", type=int, default=1)
    p.add_argument("--repeat-runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="fresh processes per engine, interleaved (A B C, A B C, ...), each doing the warmups "
                        "and repeats; their runs are pooled, so a slow minute of the machine falls on every engine")
    p.add_argument("--stages", default=None, help="subset, e.g. 1,2,4 (default: all)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 for the tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--same-process", action="store_true",
                   help="run every engine in this process, alternating (default: each in a fresh process)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with the workload's own max batch sizes where none is given."""
    args = build_parser().parse_args(argv)
    preset = WORKLOADS[args.workload][2]
    for flag in ("max_batch_size", "prefill_max_batch_size", "num_kv_blocks", "threads"):  # None: not given; 0 is no size
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.max_batch_size is None:
        args.max_batch_size = preset.get("max_batch_size", DEFAULT_MAX_BATCH_SIZE)
    if args.prefill_max_batch_size is None:
        args.prefill_max_batch_size = preset.get("prefill_max_batch_size")
    if args.repeat_runs < 1 or args.warmup_runs < 0 or args.rounds < 1:
        raise ValueError("--repeat-runs and --rounds must be >= 1, --warmup-runs >= 0")
    if args.rounds > 1 and args.same_process:
        raise ValueError("--rounds: fresh processes per engine; it cannot go with --same-process")
    return args


# ----------------------------------------------------------------------------- engines

def stage_engine(n: int, args: argparse.Namespace, loaded, knobs: dict) -> Engine:
    module = registry.load_stage(n)
    name = registry.short_name(registry.stage_package(n))
    mode = "streaming" if args.mode == "streaming" and hasattr(module, "SchedulerManager") else "offline"
    took = accepted(module.InferenceEngine, knobs)
    return Engine(name, f"{n:02d} {name.split('_', 1)[1].replace('_', ' ')}",
                  lambda: module.InferenceEngine(loaded, max_batch_size=args.max_batch_size, **took),
                  mode=mode, stage=n, module=module)


def hf_engines(args: argparse.Namespace, loaded, num_blocks: int, notes: list[str], skipped: list[dict]) -> list[Engine]:
    from common.bench import hf_baseline, hf_continuous

    out = [Engine("hf_generate", "HF generate (static)",
                  lambda: hf_baseline.HFGenerateEngine(loaded, max_batch_size=args.max_batch_size))]
    ok, why = hf_continuous.available(loaded)
    if ok:
        out.append(Engine("hf_continuous_batching", "HF continuous batching",
                          lambda: hf_continuous.HFContinuousEngine(loaded, max_batch_size=args.max_batch_size,
                                                                   num_blocks=num_blocks)))
        notes.append("hf_continuous_batching: transformers' continuous batching manager (the one behind "
                     "generate_batch), per-request max_new_tokens, pool of the same size; its set-up is not timed")
    else:
        skipped.append({"engine": "hf_continuous_batching", "reason": why})
    return out


def run_once(e: Engine, requests: list, args: argparse.Namespace) -> tuple[dict, list]:
    if e.engine is None:
        e.engine = e.factory()
    cache = getattr(e.engine, "prefix_cache", None)
    if cache is not None:
        cache.clear()  # every run starts cold: a warmup must not pre-fill the prefix cache
    if e.mode == "streaming":
        from common.bench.streaming import run_streaming_once
        cls = e.module.SchedulerManager
        manager = cls(e.engine, **accepted(cls, {"max_batch_size": args.max_batch_size, "record_token_timestamps": True,
                                                 "prefill_max_batch_size": args.prefill_max_batch_size}))
        try:
            return run_streaming_once(manager, requests)
        finally:
            manager.close()
    batch = fresh_copies(requests)
    t0 = time.perf_counter()
    completions = e.engine.generate(batch)
    return summarize(completions, wall_s=wall_seconds(completions, t0, time.perf_counter())), completions


def run_all(engines: list[Engine], requests: list, args: argparse.Namespace,
            after_run: Callable[[], None] | None = None) -> None:
    """Warmups then repeats, alternating engines; an engine that fails is dropped (and says why).
    `after_run` is called after every timed run (the worker samples the matmul floor there)."""
    from tqdm import tqdm

    total = len(engines) * (args.warmup_runs + args.repeat_runs)
    with tqdm(total=total, desc="ladder", unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        for i in range(args.warmup_runs + args.repeat_runs):
            warm = i < args.warmup_runs
            for e in engines:
                bar.set_postfix_str(f"{'warmup' if warm else 'run'} {i + 1 - (0 if warm else args.warmup_runs)}: {e.name}")
                if e.error is None:
                    try:
                        before = e.engine.kv_stats() if hasattr(e.engine, "kv_stats") else None
                        summary, completions = run_once(e, requests, args)
                        if e.first_tokens is None:
                            e.first_tokens = [c.token_ids for c in completions]
                        if not warm:
                            e.summaries.append(summary)
                            e.kv = kv_of_run(e.engine, before)
                            if after_run is not None:
                                after_run()
                    except Exception as exc:  # noqa: BLE001 -- recorded in the JSON, the ladder goes on
                        e.error = f"{type(exc).__name__}: {exc}"
                        tqdm.write(f"WARNING: {e.name} failed and is skipped: {e.error}\n"
                                   + "".join(traceback.format_exception(exc)[-3:]), file=sys.stderr)
                bar.update(1)


def parse_stages(text: str | None) -> list[int]:
    if not text:
        return sorted(registry.STAGES)
    wanted = sorted({registry.stage_number(s.strip()) for s in text.split(",") if s.strip()})
    if not wanted:
        raise ValueError("give stage numbers, e.g. 1,2,4")
    return wanted


def prepare(args: argparse.Namespace, notes: list[str], weights: bool = True) -> Setup:
    """Load the model and build the workload; the parent and every worker do exactly this
    (the parent without the weights when every rung runs in a worker of its own)."""
    from common.loader import load_model

    if args.threads is None and args.model == "tiny":
        args.threads = 1
        notes.append("tiny model: 1 CPU thread (too small to gain from more; on a busy machine idle "
                     "threads spin and slow every op down)")
    if args.threads:
        set_intra_op_threads(args.threads)  # no call where the count is already that (common/threads.py)
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, weights=weights)
    max_len = int(loaded.config.max_position_embeddings)
    kw = workload_kwargs(args, max_len, notes)
    requests = build_workload(loaded.tokenizer, seed=args.seed, **kw)
    concurrency = WORKLOADS[args.workload][2].get("kv_concurrency") or \
        min(len(requests), max(args.max_batch_size, args.prefill_max_batch_size or 0))
    num_blocks = args.num_kv_blocks or auto_kv_blocks(requests, loaded.tokenizer, max_len, concurrency)
    return Setup(loaded, requests, kw, num_blocks)


def build_engines(args: argparse.Namespace, setup: Setup, stage_numbers: list[int], hf: bool,
                  notes: list[str], skipped: list[dict]) -> list[Engine]:
    knobs = {"num_kv_blocks": setup.num_blocks}
    if args.max_num_batched_tokens is not None:  # only the stages that take it (accepted)
        knobs["max_num_batched_tokens"] = args.max_num_batched_tokens
        notes.append(f"max_num_batched_tokens {args.max_num_batched_tokens}: the step budget of the stages that have one (11+)")
    engines = [stage_engine(n, args, setup.loaded, knobs) for n in stage_numbers]
    if hf:
        engines += hf_engines(args, setup.loaded, setup.num_blocks, notes, skipped)
    return engines
