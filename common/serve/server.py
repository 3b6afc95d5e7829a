"""Running `stagewise serve`: the engine its flags ask for, and a uvicorn server that shuts down
gracefully.

    stagewise serve --stage 9 --model smollm2-135m --host 127.0.0.1 --port 8000

Apart from common/serve/app.py (the HTTP side) because `stagewise serve-overhead` and the tests
build the same server around a manager of their own: they take `make_server` and `start_engine`
from here (the flags and `build_manager` from common/serve/engine.py) and never go through `main`.
"""
from __future__ import annotations

import argparse
import gc
import socket
import sys
import time
from typing import Any

from common.serve.app import GenerationRoutes, ServeState
from common.serve.engine import add_serve_args, build_manager, check_serve_flags, worker_priority
from common.serve.transport import bind_socket, http_protocol


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


def start_engine(args: argparse.Namespace) -> tuple[Any, str]:
    """The manager the server talks to: built here, or in a process of its own (`--engine-process`).
    Both hand out the same RequestHandles, so the server cannot tell them apart."""
    if args.engine_process:
        from common.serve.engine_process import EngineProcess
        check_serve_flags(args)  # here, not only in the engine's process (its build_manager checks them again)
        engine = EngineProcess(args)
        return engine, engine.engine.stage
    return build_manager(args)


def pool_note(kv: dict | None, max_model_len: int) -> str | None:
    """What a KV pool smaller than the context window means for a client. vLLM refuses to start
    then; a small pool is how one watches admission and preemption at work, so we say it instead."""
    if kv is None or kv["total"] * kv["block_size"] >= max_model_len:
        return None
    return (f"stagewise serve: note: the KV pool holds {kv['total'] * kv['block_size']} tokens, fewer than the "
            f"context window ({max_model_len}): a request whose prompt and max_tokens need more (a chat that gives "
            f"no max_tokens asks for the whole window) is refused, or ended when it outgrows the pool, with an error "
            f"naming the field to lower; --num-kv-blocks or --kv-cache-max-concurrency make room")


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
    try:
        note = pool_note(state.check_health().result(60), state.max_model_len)
    except Exception:  # a rank that died, or no answer: /health will say so; nothing to note here
        note = None
    if note:
        print(note, file=sys.stderr, flush=True)
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
