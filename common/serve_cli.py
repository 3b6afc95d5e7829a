"""Running `stagewise serve`: its flags, the stage's manager they build, and a uvicorn server
that shuts down gracefully.

    stagewise serve --stage 9 --model smollm2-135m --host 127.0.0.1 --port 8000

Apart from common/serve.py (the HTTP side) because `stagewise serve-overhead` and the tests build
the same server around a manager of their own: they take `make_server`, `start_engine` (or
`build_manager`) and `add_serve_args` from here and never go through `main`.
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from common.http_transport import bind_socket, http_protocol
from common.serve import GenerationRoutes, ServeState
from common.threads import run_at_idle_priority

if TYPE_CHECKING:
    import torch


def make_server(state: ServeState, sock: socket.socket, log_level: str = "warning") -> Any:
    """A uvicorn Server whose SIGINT/SIGTERM first ends the in-flight requests, then stops."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            state.begin_shutdown()
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal once it has stopped, which would kill us before
            # main()'s clean-up and exit 0; the shutdown was graceful, so forget it.
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(GenerationRoutes(state), http=http_protocol(), log_level=log_level, access_log=False, lifespan="off",
                            proxy_headers=False, timeout_graceful_shutdown=30)
    return _Server(config)


def build_manager(args: argparse.Namespace) -> tuple[Any, str]:
    """Load the model and build the chosen stage's engine and SchedulerManager from the flags."""
    import importlib

    import torch

    from common import stages as registry
    from common.bench_flags import accepted, engine_knobs
    from common.streaming_bench import manager_knobs
    from common.cli import resolve_stage
    from common.loader import load_model

    package = resolve_stage(args.stage)
    module = importlib.import_module(package)
    if not hasattr(module, "SchedulerManager"):
        raise SystemExit(f"serve: {registry.short_name(package)} has no SchedulerManager; serve needs stage 4 or later")
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    knobs = accepted(module.InferenceEngine, engine_knobs(args))
    engine = module.InferenceEngine(loaded, max_batch_size=args.max_batch_size, **knobs)
    manager = module.SchedulerManager(engine, **accepted(module.SchedulerManager, manager_knobs(args)))
    if worker_priority(args.worker_priority, loaded.device) == "idle":
        # The worker has started but not run the model yet, so its OpenMP team, made at its first
        # parallel region, will inherit the class (common/threads.py).
        run_at_idle_priority(manager._worker)
    return manager, registry.short_name(package)


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


def start_engine(args: argparse.Namespace) -> tuple[Any, str]:
    """The manager the server talks to: built here, or in a process of its own (`--engine-process`).
    Both hand out the same RequestHandles, so the server cannot tell them apart."""
    if args.engine_process:
        from common.engine_process import EngineProcess
        engine = EngineProcess(args)
        return engine, engine.engine.stage
    return build_manager(args)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from common import stages as registry
    from common.bench_flags import add_engine_knob_args
    from common.streaming_bench import add_manager_args

    p.add_argument("--stage", default=str(max(registry.STAGES)), help=f"stage 4-{max(registry.STAGES)}: those with a SchedulerManager (default: newest)")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | gpt2-random | HF dir")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0, help="torch seed for requests that give none")
    g = p.add_argument_group("engine knobs (passed only where the stage's constructor takes them)")
    add_engine_knob_args(g)
    add_manager_args(g)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine in a process of its own, as vLLM does, so HTTP's Python never waits "
                        "for the worker's GIL (common/engine_process.py). Off by default: on a 2-core CPU it "
                        "made TTFT no shorter and HTTP's CPU per token larger (docs: Serving)")
    p.add_argument("--worker-priority", choices=WORKER_PRIORITIES, default="auto",
                   help="idle: the engine's worker thread (and its OpenMP threads) in Linux's SCHED_IDLE class, "
                        "so the event loop and a client on the same machine get a core the moment they wake; "
                        "anything CPU-bound on the machine then comes first. auto (default): idle when the "
                        "engine runs on the CPU, normal on a GPU (docs: Serving)")
    p.add_argument("--api-key", default=os.environ.get("STAGEWISE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/ (default: $STAGEWISE_API_KEY; unset: open)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stagewise serve", description="OpenAI-compatible HTTP server over one stage.")
    add_serve_args(p)
    args = p.parse_args(argv)
    sock = bind_socket(args.host, args.port)  # before loading: a taken port fails in a second, not a minute
    manager, stage = start_engine(args)
    state = ServeState(manager, args.served_model_name or args.model, stage, api_key=args.api_key)
    server = make_server(state, sock, args.log_level)
    # Everything loaded so far (model, tokenizer, FastAPI) lives as long as the server: freeze it
    # out of the cyclic GC, so a full collection does not walk it and stall every request (vLLM
    # and SGLang do the same after start-up).
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
    import torch
    sched = worker_priority(args.worker_priority, torch.device(manager.engine.device))
    print(f"stagewise serve: {stage} {state.model_name!r} on http://{host}:{port}, its worker in the {sched} "
          f"scheduling class (Ctrl-C to stop)", flush=True)
    t0 = time.perf_counter()
    try:
        server.run(sockets=[sock])
    finally:
        state.begin_shutdown()
        state.wait_closed(15.0)
        sock.close()
    print(f"stagewise serve: stopped after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0
