"""`stagewise ladder`: every stage, plus Hugging Face, on one workload, each in a fresh process.

The one picture that shows how each idea moves the numbers. The method is the benchmark's
(common/bench/harness.py): each engine alone in its own process (common/bench/spawn.py), since on a
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

The rungs and the flags are in common/bench/ladder_rungs.py, the workloads, and what each one
shows, in common/bench/ladder_workloads.py. The table and chart are drawn from the JSON alone
(common/bench/ladder_report.py), so a committed result can be redrawn
without measuring again.
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

from common.bench.engines import shared_process
from common.bench.envinfo import collect_env
from common.bench.floor import FloorSampler, decode_batch, with_x_floor
from common.bench.ladder_report import HF_ENGINES, write_report
from common.bench.ladder_rungs import Engine, build_engines, parse_args, parse_stages, prepare, run_all
from common.bench.ladder_workloads import WORKLOADS, describe
from common.bench.metrics import median_summary
from common.bench.results import write_json


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

def run_ladder(argv: list[str] | None = None) -> dict:
    """Run the ladder, print the table, write JSON/PNG/TXT into --out; returns the JSON dict."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        stage_numbers = parse_stages(args.stages)
    except ValueError as exc:
        raise ValueError(f"--stages: {exc}") from None
    notes: list[str] = []
    skipped: list[dict] = []
    setup = prepare(args, notes, weights=args.same_process)  # workers load their own
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
        from common.bench.spawn import run_ladder_engines
        run_ladder_engines(engines, argv, requests, rounds=args.rounds)
    correctness = check_tokens(engines)
    ref = correctness.get("reference")
    skipped += [{"engine": e.name, "reason": e.error} for e in engines if e.error]
    first = next((e.summaries[0] for e in engines if e.summaries), {})
    device = loaded.device.type
    tag = None if args.tag is None else (args.tag or args.workload)
    data = {
        "command": "stagewise ladder " + shlex.join(argv), "model": loaded.name, "device": device,
        "dtype": str(loaded.dtype).replace("torch.", ""), "dtype_reason": loaded.dtype_reason, "config": vars(args),
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


if __name__ == "__main__":  # as `stagewise ladder`: bad input is one line and status 2
    from common.commands import run_command
    sys.exit(run_command(main, "stagewise ladder"))
