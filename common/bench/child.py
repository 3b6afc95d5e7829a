"""One engine of a comparison, measured alone in this fresh process: the child's side.

    python -m common.bench.child JOB.json OUT.json       (written and read by common/bench/spawn.py)

The job names a bench engine (a stage's or transformers') or a ladder rung, and the argv its
parent was given: this process parses the same flags, loads the model, rebuilds the same
workload (the parent checks its digest), runs the warmups and the repeats with the engine
alone, samples the matmul floor after each timed run, and writes the summaries back.
It imports the engines and their runners (common/bench/engines.py, streaming.py,
ladder_rungs.py), never the code that spawned it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import common.bench.envinfo  # noqa: F401  first: its GIT_AT_START is the code this run measures
from common.bench.workloads import workload_digest


def bench_job(job: dict) -> dict:
    """One engine of `python -m stages.<stage>.bench`, parsed from the same argv as the parent."""
    import importlib

    import torch

    from common.bench import engines, flags
    from common.bench.floor import FloorSampler, decode_batch
    from common.loader import load_model

    package, engine = job["package"], job["engine"]
    module = importlib.import_module(package)
    args = flags.parse_bench_args(module, job["argv"])
    flags.check_args(args)
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    requests = flags.workload_from_args(loaded.tokenizer, args)
    specs = [s for s in engines.build_specs(package, args, loaded, []) if s.name == engine]
    if not specs:
        raise SystemExit(f"child: {package}'s bench has no engine {engine!r}")
    spec = specs[0]
    floor = FloorSampler(loaded.model, decode_batch(args.max_batch_size, len(requests)))
    if job["mode"] == "streaming":
        from common.bench import streaming
        streaming.run_streaming_engines([spec], requests, args, after_run=floor)
    else:
        engines.run_engines([spec], lambda s: engines.run_offline_once(s, requests), requests,
                          args.warmup_runs, args.repeat_runs, args.fresh_engine, after_run=floor)
    return {"engine": spec.name, "summaries": spec.summaries, "first_tokens": spec.first_tokens,
            "kv": spec.kv,
            "floor": floor.fields(), "workload_digest": workload_digest(requests), "env": _env(loaded)}


def ladder_job(job: dict) -> dict:
    """One rung of `stagewise ladder`, parsed from the same argv as the parent."""
    from common.bench import ladder_rungs as ladder
    from common.bench.floor import FloorSampler, decode_batch

    args = ladder.parse_args(job["argv"])
    setup = ladder.prepare(args, [])
    engine = job["engine"]
    stage = int(engine[1:3]) if engine.startswith("s") and engine[1:3].isdigit() else None
    engines = ladder.build_engines(args, setup, [] if stage is None else [stage], hf=stage is None, notes=[], skipped=[])
    picked = [e for e in engines if e.name == engine]
    if not picked:
        raise SystemExit(f"child: the ladder has no engine {engine!r} here")
    e = picked[0]
    floor = FloorSampler(setup.loaded.model, decode_batch(args.max_batch_size, len(setup.requests)))
    ladder.run_all([e], setup.requests, args, after_run=floor)
    return {"engine": e.name, "error": e.error, "summaries": e.summaries, "first_tokens": e.first_tokens,
            "kv": e.kv,
            "setup_s": list(getattr(e.engine, "setup_s", None) or []),
            "floor": floor.fields(), "workload_digest": workload_digest(setup.requests), "env": _env(setup.loaded)}


def _env(loaded: Any) -> dict:
    from common.bench.envinfo import collect_env
    return collect_env(loaded.device)


JOBS = {"bench": bench_job, "ladder": ladder_job}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m common.bench.child JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    result = JOBS[job["kind"]](job)
    result["pid"] = os.getpid()
    Path(argv[1]).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
