"""What `stagewise serve`'s flags build: the stage's engine and its `SchedulerManager`.

Its own module, below both the server (common/serve/server.py) and the engine's own process
(common/serve/engine_process.py), since each builds the manager from the same flags: the one in
its process, the other in a process of its own (`--engine-process`).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from common.commands import add_model_args
from common.threads import run_at_idle_priority

if TYPE_CHECKING:
    import torch


WORKER_PRIORITIES = ("auto", "idle", "normal")  # --worker-priority's choices


def worker_priority(choice: str, device: "torch.device") -> str:
    """`--worker-priority` resolved: auto is idle where the engine computes on the CPU under Linux.

    On a GPU the worker's CPU time is kernel launches that keep the device fed; it is not what the
    server's event loop is waiting for there, and nobody has measured it: it stays normal."""
    if choice not in WORKER_PRIORITIES:
        raise ValueError(f"worker_priority must be auto, idle or normal, not {choice!r}")
    if choice == "auto":
        return "idle" if device.type == "cpu" and hasattr(os, "SCHED_IDLE") else "normal"
    return choice


def check_serve_flags(args: argparse.Namespace) -> None:
    """The flags that clash with each other, checked before anything loads (in the server's process
    too when the engine gets one of its own: there an error would be a traceback, after a Python started)."""
    from common.bench.knobs import check_manager_flags, check_prefix_cache_flags

    check_prefix_cache_flags(args.no_prefix_cache, args.prefix_cache_max_entries)
    check_manager_flags(args)


def build_manager(args: argparse.Namespace) -> tuple[Any, str]:
    """Load the model and build the chosen stage's engine and SchedulerManager from the flags."""
    import importlib

    import torch

    from common import stages as registry
    from common.bench.knobs import accepted, engine_knobs, knobs_not_taken, manager_knobs
    from common.loader import load_model

    package = registry.resolve_stage(args.stage)  # an unknown stage: a ValueError
    try:
        module = importlib.import_module(registry.streaming_stage(package))
    except ValueError as exc:  # a stage without a manager: the server exits with why (engine_process.py too)
        raise SystemExit(f"serve: {exc}") from None
    check_serve_flags(args)
    ignored = knobs_not_taken(module, args)  # said at start-up, as the bench says it: a server runs so all its life
    if ignored:  # (a refusal would stop serve-overhead and serve-compare, whose flags suit every stage, on 04-06)
        print(f"stagewise serve: note: {registry.short_name(package)} takes no {', '.join(ignored)}: not applied",
              file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)
    knobs = accepted(module.InferenceEngine, engine_knobs(args))
    # Split across ranks (stage 14), every rank reads its own share of the weights: none loads them all.
    loaded = load_model(args.model, device=args.device, dtype=args.dtype,
                        weights=knobs.get("tensor_parallel_size", 1) == 1)
    engine = module.InferenceEngine(loaded, max_batch_size=args.max_batch_size, **knobs)
    manager = module.SchedulerManager(engine, **accepted(module.SchedulerManager, manager_knobs(args)))
    if worker_priority(args.worker_priority, loaded.device) == "idle":
        # The worker has started but not run the model yet, so its OpenMP team, made at its first
        # parallel region, will inherit the class (common/threads.py).
        run_at_idle_priority(manager._worker)
    return manager, registry.short_name(package)


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the OS picks one), as argparse's type: out of range is a usage
    error naming --port, not an OverflowError from the socket."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port


def host_address(text: str) -> str:
    """An address to listen on, as argparse's type: one that does not resolve is a usage error
    naming --host when the flags are read, not a socket.gaierror after the model has loaded."""
    try:
        socket.getaddrinfo(text, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot resolve {text!r}: {getattr(exc, 'strerror', None) or exc}") from None
    return text


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from common import stages as registry
    from common.bench.knobs import add_engine_knob_args, add_manager_args

    p.add_argument("--stage", default=str(max(registry.STAGES)), help=f"stage 4-{max(registry.STAGES)}: those with a SchedulerManager (default: newest)")
    add_model_args(p)
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument("--host", type=host_address, default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--seed", type=int, default=0, help="torch seed for requests that give none")
    g = p.add_argument_group("engine knobs (passed only where the stage takes them; the others are named at start-up)")
    add_engine_knob_args(g)
    add_manager_args(g)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine in a process of its own, as vLLM does, so HTTP's Python never waits "
                        "for the worker's GIL (common/serve/engine_process.py). Off by default: on a 2-core CPU it "
                        "made TTFT no shorter and HTTP's CPU per token larger (docs: Serving)")
    p.add_argument("--worker-priority", choices=WORKER_PRIORITIES, default="auto",
                   help="idle: the engine's worker thread (and its OpenMP threads) in Linux's SCHED_IDLE class, "
                        "so the event loop and a client on the same machine get a core the moment they wake; "
                        "anything CPU-bound on the machine then comes first. auto (default): idle when the "
                        "engine runs on the CPU, normal on a GPU (docs: Serving)")
    p.add_argument("--api-key", default=os.environ.get("STAGEWISE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/ (default: $STAGEWISE_API_KEY; unset: open)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
