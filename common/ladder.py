"""`stagewise ladder`: every stage, plus Hugging Face, on one workload, each in a fresh process.

The one picture that shows how each idea moves the numbers. The method is the benchmark's
(common/bench.py): each engine alone in its own process (common/engine_worker.py), since on a
CPU an engine's speed depends on what ran before it in the process; the same workload rebuilt
from the same flags in each; correctness (every engine's first-run greedy token ids must equal
stage 01's); a warmup, then repeats; medians over repeats, every run kept in the JSON; the
matmul floor measured in each process, so each rung's decode step reads as `x floor`.
`--same-process` runs every engine in this process instead, alternating (A B C ... A B C ...).

Every engine goes through the same door, `engine.generate(requests)` (offline: all requests
at once), so the numbers compare like with like. That door does not show everything: stages
06, 07 and 09 change how the streaming `SchedulerManager` admits and streams requests, which
offline `generate()` never uses. `--mode streaming` sends stages 04+ through their manager
instead (all requests submitted at once), which is where those stages show.

    stagewise ladder --out docs/results                       # smollm2-135m, default workload
    stagewise ladder --model tiny --out /tmp/ladder           # a quick check (under a minute)
    stagewise ladder --workload burst --mode streaming --tag --out docs/results
    stagewise ladder --workload decode-step --rounds 3 --repeat-runs 1 --tag --out docs/results   # vs the floor
    stagewise ladder --workload long-prompts --mode streaming --stages 9,10,11 --tag --out docs/results

The workloads, and what each one shows, are in common/ladder_workloads.py. The table and chart
are drawn from the JSON alone (common/ladder_report.py), so a committed result can be redrawn
without measuring again.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from common import stages as registry
from common.bench import shared_process, wall_seconds, write_json
from common.bench_flags import accepted
from common.envinfo import collect_env
from common.floor import FloorSampler, decode_batch, with_x_floor
from common.ladder_report import HF_ENGINES, write_report
from common.ladder_workloads import DEFAULT_MAX_BATCH_SIZE, WORKLOADS, auto_kv_blocks, describe, workload_kwargs
from common.metrics import median_summary, summarize
from common.workloads import build_workload, fresh_copies


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
    kv: dict | None = None                        # kv_stats(), from its worker process
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
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | gpt2-random | HF dir")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--out", required=True, help="directory for ladder.<device>[.<tag>].{json,png,txt}")
    p.add_argument("--tag", nargs="?", const="", default=None,
                   help="add a suffix to the file names (--tag alone: the workload name)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the workload's (long ones scale)")
    p.add_argument("--max-batch-size", type=int, default=None, help="default: the workload's, else 8")
    p.add_argument("--prefill-max-batch-size", type=int, default=None, help="stage 07+ managers (streaming mode)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool of stages 03+ (default: fits the workload)")
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
    args.max_batch_size = args.max_batch_size or preset.get("max_batch_size", DEFAULT_MAX_BATCH_SIZE)
    args.prefill_max_batch_size = args.prefill_max_batch_size or preset.get("prefill_max_batch_size")
    if args.repeat_runs < 1 or args.warmup_runs < 0 or args.max_batch_size < 1 or args.rounds < 1:
        raise SystemExit("--repeat-runs, --rounds and --max-batch-size must be >= 1, --warmup-runs >= 0")
    if args.rounds > 1 and args.same_process:
        raise SystemExit("--rounds: fresh processes per engine; it cannot go with --same-process")
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
    from common import hf_baseline, hf_continuous

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
        from common.streaming_bench import run_streaming_once
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
                        summary, completions = run_once(e, requests, args)
                        if e.first_tokens is None:
                            e.first_tokens = [c.token_ids for c in completions]
                        if not warm:
                            e.summaries.append(summary)
                            if after_run is not None:
                                after_run()
                    except Exception as exc:  # noqa: BLE001 -- recorded in the JSON, the ladder goes on
                        e.error = f"{type(exc).__name__}: {exc}"
                        tqdm.write(f"WARNING: {e.name} failed and is skipped: {e.error}\n"
                                   + "".join(traceback.format_exception(exc)[-3:]), file=sys.stderr)
                bar.update(1)


def check_tokens(engines: list[Engine]) -> dict:
    """Greedy decoding is deterministic: every engine's first-run token ids must equal the reference's."""
    ran = [e for e in engines if e.first_tokens is not None]
    if not ran:
        return {"checked": False}
    ref = ran[0]
    mismatches = {}
    for e in ran:
        diff = next((i for i, (a, b) in enumerate(zip(ref.first_tokens, e.first_tokens)) if a != b), None)
        e.match = diff is None and len(ref.first_tokens) == len(e.first_tokens)
        if not e.match:
            i = diff or 0
            mismatches[e.name] = {"request": i, ref.name: ref.first_tokens[i], e.name: e.first_tokens[i]}
            print(f"WARNING: greedy token ids of {e.name} differ from {ref.name} at request {i}", file=sys.stderr)
    return {"checked": True, "reference": ref.name, "equal": not mismatches, "mismatches": mismatches}


# ----------------------------------------------------------------------------- results

def entry(e: Engine, reference: str | None) -> dict:
    out: dict[str, Any] = {"engine": e.name, "label": e.label, "stage": e.stage, "mode": e.mode}
    out.update(median_summary(e.summaries))
    out["runs"] = e.summaries
    kv = e.kv if e.kv is not None else (e.engine.kv_stats() if hasattr(e.engine, "kv_stats") else None)
    out["kv"] = kv or {"peak_kv_bytes": None}
    out["tokens_match_reference"] = e.match
    out["tokens_match_stage1"] = e.match if reference == "s01_naive_batching" else None
    setup_s = e.setup_s if e.setup_s is not None else getattr(e.engine, "setup_s", None)
    if setup_s:
        out["setup_s"] = list(setup_s)
    with_x_floor(out, e.floor)
    out["process"] = e.process or shared_process(None)
    return out


# ----------------------------------------------------------------------------- entry point

def parse_stages(text: str | None) -> list[int]:
    if not text:
        return sorted(registry.STAGES)
    wanted = sorted({registry.stage_number(s.strip()) for s in text.split(",") if s.strip()})
    if not wanted:
        raise SystemExit("--stages: give stage numbers, e.g. 1,2,4")
    return wanted


def prepare(args: argparse.Namespace, notes: list[str]) -> Setup:
    """Load the model and build the workload; the parent and every worker do exactly this."""
    from common.loader import load_model

    if args.threads is None and args.model == "tiny":
        args.threads = 1
        notes.append("tiny model: 1 CPU thread (too small to gain from more; on a busy machine idle "
                     "threads spin and slow every op down)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    max_len = int(loaded.config.max_position_embeddings)
    kw = workload_kwargs(args, max_len, notes)
    requests = build_workload(loaded.tokenizer, seed=args.seed, **kw)
    concurrency = min(len(requests), max(args.max_batch_size, args.prefill_max_batch_size or 0))
    num_blocks = args.num_kv_blocks or auto_kv_blocks(requests, loaded.tokenizer, max_len, concurrency)
    return Setup(loaded, requests, kw, num_blocks)


def build_engines(args: argparse.Namespace, setup: Setup, stage_numbers: list[int], hf: bool,
                  notes: list[str], skipped: list[dict]) -> list[Engine]:
    engines = [stage_engine(n, args, setup.loaded, {"num_kv_blocks": setup.num_blocks}) for n in stage_numbers]
    if hf:
        engines += hf_engines(args, setup.loaded, setup.num_blocks, notes, skipped)
    return engines


def run_ladder(argv: list[str] | None = None) -> dict:
    """Run the ladder, print the table, write JSON/PNG/TXT into --out; returns the JSON dict."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        stage_numbers = parse_stages(args.stages)
    except ValueError as exc:
        raise SystemExit(f"--stages: {exc}") from None
    notes: list[str] = []
    skipped: list[dict] = []
    setup = prepare(args, notes)
    loaded, requests, kw, num_blocks = setup.loaded, setup.requests, setup.kw, setup.num_blocks
    notes.append(f"KV pool of stages 03+: {num_blocks} blocks of 16 tokens "
                 f"({num_blocks * 16 * loaded.config.kv_bytes_per_token(loaded.dtype) / 2**20:,.1f} MiB)")
    if args.mode == "offline":
        notes.append("offline generate(): stages 06, 07 and 09 change the streaming SchedulerManager, "
                     "which this mode does not use (--mode streaming does)")
    if any(r.submit_offset_s is not None for r in requests):
        notes.append("the late requests' planned arrivals are honoured by the streaming SchedulerManager only; "
                     "offline generate() takes every request at once")
    engines = build_engines(args, setup, stage_numbers, not args.no_hf, notes, skipped)

    t0 = time.perf_counter()
    if args.same_process:
        sampler = FloorSampler(loaded.model, decode_batch(args.max_batch_size, len(requests)))
        run_all(engines, requests, args, after_run=sampler)
        floor = sampler.fields()
        for e in engines:
            e.floor = floor
            e.process = shared_process(len(engines))
    else:
        from common.engine_worker import run_ladder_engines
        run_ladder_engines(engines, argv, requests, rounds=args.rounds)
    correctness = check_tokens(engines)
    ref = correctness.get("reference")
    skipped += [{"engine": e.name, "reason": e.error} for e in engines if e.error]
    first = next((e.summaries[0] for e in engines if e.summaries), {})
    device = loaded.device.type
    tag = None if args.tag is None else (args.tag or args.workload)
    data = {
        "command": "stagewise ladder " + shlex.join(argv), "model": loaded.name, "device": device,
        "dtype": str(loaded.dtype).replace("torch.", ""), "config": vars(args),
        "env": collect_env(loaded.device),
        "workload": {"name": args.workload, "description": describe(args.workload, kw), "shows": WORKLOADS[args.workload][0],
                     "kwargs": kw, "requests": len(requests), "prompt_tokens": first.get("prompt_tokens"),
                     "completion_tokens": first.get("completion_tokens")},
        "correctness": correctness, "entries": [entry(e, ref) for e in engines if e.summaries and not e.error],
        "skipped": skipped, "notes": notes, "ladder_wall_s": time.perf_counter() - t0,
    }
    if not data["entries"]:
        raise SystemExit("ladder: every engine failed; see the warnings above")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / (f"ladder.{device}" + (f".{tag}" if tag else "") + ".json")
    write_json(json_path, data)
    print(write_report(data, json_path), flush=True)
    print(f"wrote {json_path.with_suffix('.png')}", flush=True)
    return data


def failed_engines(data: dict) -> list[str]:
    """The stages that make the ladder fail: one that did not run, or, in fp32, one whose greedy
    tokens differ from the reference. In bf16 or fp16 two correct engines may part where the
    reference's best two logits are a rounding step apart (`stagewise parity` measures how often),
    so a difference there is a warning and the table's "DIFFER", not a failure; a Hugging Face
    engine only ever warns."""
    bad = [s["engine"] for s in data["skipped"]]
    if data["dtype"] == "float32":
        bad += list(data["correctness"].get("mismatches", {}))
    return [name for name in bad if name not in HF_ENGINES]


def main(argv: list[str] | None = None) -> int:
    """Exit 1 when `failed_engines` names any stage."""
    return 1 if failed_engines(run_ladder(argv)) else 0


if __name__ == "__main__":
    sys.exit(main())
