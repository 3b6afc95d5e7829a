"""`stagewise`: one command for the whole ladder of stages.

    stagewise generate "Tell me a joke" [--stage 4] [--max-new-tokens 64] ...
    stagewise bench --stage 2 [any flag of python -m stages.<stage>.bench]
    stagewise stages
    stagewise ladder ...          (every stage on one workload; provided by common/bench/ladder.py)
    stagewise stability --stage 9 --processes 5 [bench flags]   (common/bench/stability.py)
    stagewise serve --stage 9 --model NAME --port 8000     (OpenAI-compatible HTTP; common/serve/)
    stagewise bench-serve --base-url URL --model NAME ...  (a workload over HTTP; common/serve/bench.py)
    stagewise serve-compare [--stage 11]                   (against `transformers serve`; common/serve/compare.py)
    stagewise parity --model NAME --dtype bfloat16        (every stage's tokens against transformers'; common/bench/parity.py)

`bench --stage N ...` is exactly `python -m stages.<stage>.bench ...`: the remaining flags are
handed over untouched, so the two spellings can never drift apart.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from common import stages as registry
from common.commands import add_model_args, add_sampling_args, run_command, sampling_knobs


def _pop_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Take `name VALUE` / `name=VALUE` out of argv, leaving everything else in order."""
    rest, value, i = [], None, 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(name + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest


def cmd_bench(argv: list[str]) -> int:
    stage, rest = _pop_option(argv, "--stage")
    from common.bench.harness import run_stage_bench
    run_stage_bench(registry.resolve_stage(stage), rest, prog="stagewise bench [--stage N]")
    return 0


def cmd_ladder(argv: list[str]) -> int:
    # Imported here, not at the top: the ladder pulls in matplotlib, which `generate` never needs.
    from common.bench import ladder
    return int(ladder.main(argv) or 0)


# Subcommands that own their flags: `stagewise NAME ...` is `NAME`'s module main(argv).
SUBPROGRAMS = {"serve": "common.serve.server", "bench-serve": "common.serve.bench", "serve-overhead": "common.serve.overhead",
               "serve-compare": "common.serve.compare", "stability": "common.bench.stability",
               "profile-decode": "common.bench.profile_decode", "profile-prefill": "common.bench.profile_prefill",
               "parity": "common.bench.parity", "worker-probe": "common.bench.worker_probe",
               "floor-curve": "common.bench.floor_curve"}


def cmd_stages(_: argparse.Namespace) -> int:
    for n, package in registry.STAGES.items():
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            print(f"{n}  {registry.short_name(package):30s} (not available: {exc})")
            continue
        print(f"{n}  {registry.short_name(package):30s} {registry.summary_line(module)}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from common.loader import load_model
    from common.requests import Request, SamplingParams
    from common.tokenizer import chat_prompt

    params = SamplingParams(max_new_tokens=args.max_new_tokens, **sampling_knobs(args))
    params.validate()  # bad flags: before any weights
    module = importlib.import_module(registry.resolve_stage(args.stage))
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt = args.prompt if args.no_chat else chat_prompt(loaded.tokenizer, args.prompt)
    engine = module.InferenceEngine(loaded)
    manager_cls = getattr(module, "SchedulerManager", None)
    if manager_cls is None or args.no_stream:
        print(engine.generate([Request(prompt=prompt, params=params)])[0].text)
        return 0
    manager = manager_cls(engine)
    try:  # stream as the text arrives: the point of stage 04+
        for chunk in manager.add_request(prompt, params=params):
            print(chunk.text, end="", flush=True)
        print()
    finally:
        manager.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagewise", description="A pure-PyTorch LLM inference engine, built in stages.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with one stage's engine")
    gen.add_argument("prompt")
    gen.add_argument("--stage", default=str(max(registry.STAGES)), help="stage number or name (default: newest)")
    add_model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    add_sampling_args(gen)
    gen.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--no-stream", action="store_true", help="print the text at the end, even on stage 04+")
    sub.add_parser("bench", add_help=False, help="a stage's benchmark: bench --stage N [bench flags] (--help for them)")
    sub.add_parser("stages", help="list the stages and what each adds")
    sub.add_parser("ladder", add_help=False, help="every stage on one workload (common/bench/ladder.py)")
    sub.add_parser("stability", add_help=False, help="one stage's bench in N fresh processes (common/bench/stability.py)")
    sub.add_parser("serve", add_help=False, help="OpenAI-compatible HTTP server over a stage 04+ (common/serve/server.py)")
    sub.add_parser("bench-serve", add_help=False, help="benchmark any OpenAI-compatible server (common/serve/bench.py)")
    sub.add_parser("profile-decode", add_help=False,
                   help="one stage's decode step op by op, against the matmul floor (common/bench/profile_decode.py)")
    sub.add_parser("profile-prefill", add_help=False,
                   help="one prompt's prefill op by op, against its matmul floor (common/bench/profile_prefill.py)")
    sub.add_parser("serve-overhead", add_help=False,
                   help="HTTP vs in-process on one workload, one JSON (common/serve/overhead.py)")
    sub.add_parser("serve-compare", add_help=False,
                   help="stagewise serve against transformers serve, same client and workload (common/serve/compare.py)")
    sub.add_parser("parity", add_help=False,
                   help="every stage's greedy tokens against transformers' generate (common/bench/parity.py)")
    sub.add_parser("worker-probe", add_help=False,
                   help="a streaming stage's bench with stopwatches on its worker (common/bench/worker_probe.py)")
    sub.add_parser("floor-curve", add_help=False,
                   help="the matmul floor at several batch sizes, in one process (common/bench/floor_curve.py)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`stagewise <command> ...`; a ValueError from the command (bad input) is one line and status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: _run(argv), " ".join(["stagewise", *argv[:1]]))


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "bench":  # flags belong to the stage's bench parser, untouched
        return cmd_bench(argv[1:])
    if argv and argv[0] == "ladder":
        return cmd_ladder(argv[1:])
    if argv and argv[0] in SUBPROGRAMS:  # imported on demand: `generate` never needs fastapi
        return int(importlib.import_module(SUBPROGRAMS[argv[0]]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return {"generate": cmd_generate, "stages": cmd_stages}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
