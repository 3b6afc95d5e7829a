"""The engine in its own process, behind a stand-in for its SchedulerManager (`stagewise serve --engine-process`).

Why: in one process the server's event loop and the manager's worker thread share one GIL. The
worker holds it through the Python between its operators and gives it up when Python's switch
interval (5 ms) says so, so the loop gets a token the worker has just sampled some 6 ms later
(measured with per-request stamps on the 2-core CPU); and every token the loop writes to a
client is Python run while the worker waits for the GIL. Two processes have two GILs: the
worker's Python never waits for HTTP's, and the loop is woken by the OS when the engine's bytes
arrive. vLLM splits its server the same way (`AsyncLLM` in the API server, `EngineCore` in a
background process, ZMQ between them).

    parent (the server)                          child (the engine)
    EngineProcess.add_request ──("add")────────▶ main thread: manager.add_request
    RequestHandle ◀── reader thread ◀──("out")── worker thread: what each step put on the
                                                 requests' queues, in one message (Outbox)
    EngineProcess.call(fn, ...) ──("call")─────▶ fn(manager, ...) ──("reply")──▶ a Future

The parent hands out the same `RequestHandle`s a SchedulerManager does (common/streams.py),
filled by its reader thread, so the server code is the same over either. Detokenizing stays
where it is, in the engine's worker; a prompt too long to tokenize in passing is tokenized on the
server's side (in the thread the server hands it to) and sent as ids. If the engine process dies, every open request ends with
an error and new ones are refused: nothing is left hanging.

Measured on the 2-core CPU (`stagewise serve-overhead --engine-process`, docs/results/questions/serve-reruns/),
it did not pay there: the engine's two OpenMP threads fill both cores, so the server's process
waits for a core instead of the GIL, and the pipe adds its own work; TTFT over HTTP came out no
shorter and HTTP's CPU per token larger. Hence off by default; it is the layout for a machine with
cores to spare beside the engine (a GPU server), where vLLM uses it.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from common.requests import ContextLengthExceeded, SamplingParams
from common.streams import ChunkQueue, Done, Failed, RequestHandle
from common.tokenizer import LONG_TEXT, encode

START_TIMEOUT_S = 900.0  # loading (a first run converts SmolLM2's GGUF) can take minutes
FLUSH_GRACE_S = 0.002  # how long puts made outside a step may wait to be sent (Outbox)


@dataclass
class EngineInfo:
    """What the server reads of `manager.engine`, sent once by the engine process when it is ready."""

    tokenizer: Any
    max_model_len: int
    device: str
    dtype: str
    dtype_reason: str  # why that dtype (common.loader.choose_dtype)
    stage: str

    @classmethod
    def of(cls, engine: Any, stage: str) -> "EngineInfo":
        return cls(engine.tokenizer, int(engine.max_model_len), str(engine.device),
                   str(engine.model.lm_head_weight.dtype).replace("torch.", ""), engine.loaded.dtype_reason, stage)


def send_or_drop(conn: Any, lock: threading.Lock, message: tuple) -> None:
    """Send on the pipe under `lock` (several threads send on each end); if the other end is
    gone, drop it: that end's reader sees EOF and ends what is open."""
    try:
        with lock:
            conn.send(message)
    except (OSError, ValueError):
        pass


def portable(exc: BaseException) -> BaseException:
    """An error the parent can unpickle without importing a stage: its kind (bad input or not) and
    message survive, which is all the server answers with (400 for ValueError, 500 otherwise).
    ContextLengthExceeded is common's own and crosses as it is: the server names its field."""
    if isinstance(exc, ContextLengthExceeded):
        return exc
    if isinstance(exc, ValueError):
        return ValueError(str(exc))
    return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineProcess:
    """A SchedulerManager in a child process, used like one: add_request, cancel, close, `engine`."""

    def __init__(self, serve_args: argparse.Namespace, start_timeout_s: float = START_TIMEOUT_S) -> None:
        """Start a fresh Python that builds the manager `stagewise serve` would from `serve_args`
        (its parsed flags), and wait until it is ready. If it cannot start, SystemExit carries
        its message, as the in-process path would."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked OpenMP or torch state
        self._conn, child_conn = ctx.Pipe()
        # Not a daemon: a daemon may not start processes, and a tensor-parallel engine (stage 14)
        # starts its other ranks. It still ends with the server: the pipe's EOF stops its loop,
        # and close() kills it if it is stuck.
        self._process = ctx.Process(target=_engine_main, args=(child_conn, serve_args),
                                    name="stagewise-engine", daemon=False)
        self._process.start()
        child_conn.close()  # ours is closed: the child's end alone keeps the pipe open, so its death is EOF
        if not self._conn.poll(start_timeout_s):
            self._process.kill()
            raise SystemExit(f"serve: the engine process did not start in {start_timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise SystemExit(f"serve: the engine process exited with code {self._process.exitcode} while "
                             "starting; its error is printed above") from None
        if kind != "ready":
            self._process.join(10)
            raise SystemExit(payload)
        self.engine: EngineInfo = payload
        self.pid = self._process.pid
        self._ids = itertools.count()
        self._send_lock = threading.Lock()  # the loop, a closing thread and callers all send
        self._lock = threading.Lock()  # guards _queues, _calls and _alive against the reader
        self._queues: dict[int, ChunkQueue] = {}
        self._calls: dict[int, Future] = {}
        self._alive = True  # the reader has not seen the engine end
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="stagewise-engine-reader", daemon=True)
        self._reader.start()

    # ---- what a SchedulerManager offers ------------------------------------------------

    def add_request(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, **sampling: Any) -> RequestHandle:
        """Send a request to the engine and return its handle at once (errors arrive on it)."""
        rid, out = next(self._ids), ChunkQueue()
        handle = RequestHandle(self, rid, out)
        with self._lock:
            if self._closing or not self._alive:
                raise RuntimeError("SchedulerManager is closed" if self._closing else "the engine process has ended")
            self._queues[rid] = out
        try:
            params = SamplingParams.of(params, sampling)
            if prompt_token_ids is None and isinstance(prompt, str) and len(prompt) > LONG_TEXT:
                # Tokenized here, in the caller's thread (the server hands a long prompt to one), as
                # vLLM's API server tokenizes before its engine sees a request: sent as text, it would
                # hold the engine's main thread, and every other request's "add" and "cancel" behind it.
                prompt_token_ids = encode(self.engine.tokenizer, prompt)
        except Exception as exc:  # an unknown sampling keyword, a bad prompt: this request's error, as in-process
            self._end(rid, Failed(exc))
            return handle
        self._send(("add", rid, prompt, prompt_token_ids, params))
        return handle

    def cancel(self, request_id: int) -> None:
        """Stop a request; its stream ends with finish_reason "cancelled" (sent by the engine)."""
        self._send(("cancel", request_id))

    def call(self, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        """Run `fn(manager, *args)` in the engine process (fn must be importable there: a module's
        top-level function); the Future gets its result or its error. For what only the engine can
        see (its KV pool) and for benchmarks that must run beside it. It runs on the engine's main
        thread, so requests and cancels sent meanwhile wait until it returns: keep it short, or
        call it when nothing else is in flight (as serve-overhead does)."""
        future: Future[Any] = Future()
        with self._lock:
            if not self._alive:
                future.set_exception(RuntimeError("the engine process has ended"))
                return future
            call_id = next(self._ids)
            self._calls[call_id] = future
        self._send(("call", call_id, fn, args))
        return future

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine. It ends every request still in flight (cancelled) before it exits."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._send(("close",))
        self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():  # stuck: it must not outlive the server
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the pipe ------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        send_or_drop(self._conn, self._send_lock, message)

    def _end(self, rid: int, item: Done | Failed) -> None:
        with self._lock:
            out = self._queues.pop(rid, None)
        if out is not None:
            out.put(item)

    def _read(self) -> None:
        """The reader thread: the engine's messages onto their handles' queues, until it ends.

        It holds the GIL only to unpickle and put; recv() waits outside it."""
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "out":  # one step's chunks and ends, for every request that had any
                    for rid, chunks, final in message[1]:
                        out = self._queues.get(rid)
                        if out is not None:
                            for chunk in chunks:
                                out.put(chunk)
                        if final is not None:
                            self._end(rid, Failed(final) if isinstance(final, BaseException) else Done(final))
                elif kind == "reply":
                    _, call_id, ok, value = message
                    with self._lock:
                        future = self._calls.pop(call_id, None)
                    if future is not None:
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "closed":
                    return
        except (EOFError, OSError):
            pass
        finally:
            self._engine_ended()

    def _engine_ended(self) -> None:
        """Nothing more will come: end what is still open, so no caller waits forever."""
        with self._lock:
            self._alive = False
            queues, self._queues = self._queues, {}
            calls, self._calls = self._calls, {}
        code = self._process.exitcode
        why = "the engine process has ended" + (f" (exit code {code})" if code else "")
        for out in queues.values():
            out.put(Failed(RuntimeError(why)))
        for future in calls.values():
            future.set_exception(RuntimeError(why))


def call_beside(manager: Any, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
    """`fn(manager, *args)` where the manager lives: through `EngineProcess.call` in the engine's
    process, or at once in this one; either way a Future, so a caller need not know which."""
    call = getattr(manager, "call", None)  # EngineProcess
    if call is not None:
        return call(fn, *args)
    done: Future[Any] = Future()
    try:
        done.set_result(fn(manager, *args))
    except Exception as exc:  # as EngineProcess.call delivers it: on the Future
        done.set_exception(exc)
    return done


def kv_blocks(manager: Any) -> dict | None:
    """The engine's KV pool: free and total blocks, and tokens a block (for `/health` and the tests; called
    where the manager lives, in this process or, through `call`, in the engine's)."""
    pool = getattr(manager.engine, "pool", None)
    if pool is None:
        return None
    return {"free": pool.allocator.num_free, "total": pool.allocator.num_blocks, "block_size": pool.block_size}


def check_health(manager: Any) -> dict | None:
    """`/health`'s answer, `kv_blocks`; RuntimeError if the engine can run no more steps. Only a
    tensor-parallel engine (stage 14) can be broken while its process lives: a rank that died
    fails every later step, so the server must not call itself healthy (vLLM answers 503 too).
    Called where the manager lives, as kv_blocks."""
    tp = getattr(manager.engine, "tp", None)
    why = tp.failure() if tp is not None else None
    if why is not None:
        raise RuntimeError(why)
    return kv_blocks(manager)


def engine_stats(manager: Any) -> dict:
    """`kv_blocks`, and the engine's own counters from its `kv_stats` (the prefix cache's hits and
    lookups, where the stage has one) for `/metrics`; called where the manager lives, as kv_blocks."""
    stats = getattr(manager.engine, "kv_stats", None)
    return {**(stats() if stats is not None else {}), "kv_blocks": kv_blocks(manager)}


# --------------------------------------------------------------------------------- the child

class Outbox:
    """What the worker puts on the requests' queues, sent to the server in one message per step.

    Why not a message per put: at batch 64 that is 64 messages a step, and the server's reader
    paid CPU and a wake-up for each: the server's CPU per token was 45-69 us that way and 32-41 us
    with a message per step, against 26-31 us with the engine in the server's process
    (`loop_cpu_us_per_token` in docs/results/questions/serve-reruns/). The worker makes all of a
    step's puts between two calls into its scheduler, so the outbox is flushed when it next calls
    the scheduler (`step`, `add_requests`), right after its last put; puts made outside a step
    (the last request ending as the worker goes idle, a cancel) are flushed by a small thread that
    the first put wakes, FLUSH_GRACE_S later.
    """

    def __init__(self, send: Callable[[tuple], None], handles: dict[int, Any]) -> None:
        self._send = send
        self._handles = handles  # rid -> handle, forgotten once its end is in the outbox
        self._lock = threading.Lock()  # order: what is drained first is sent first
        self._items: list[tuple[int, list, Any]] = []  # (rid, chunks, end or None)
        self._waiting = threading.Event()
        threading.Thread(target=self._flush_when_woken, name="stagewise-outbox", daemon=True).start()

    def listener(self, rid: int, handle: Any) -> Callable[[], None]:
        """The handle's put listener (run by the worker): move what arrived into the outbox."""
        def on_put() -> None:
            with self._lock:
                chunks, final = handle.drain()
                if not chunks and final is None:
                    return
                if final is not None:
                    self._handles.pop(rid, None)
                    final = portable(final) if isinstance(final, BaseException) else final
                self._items.append((rid, chunks, final))
                self._waiting.set()
        return on_put

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._waiting.clear()
            if items:
                self._send(("out", items))

    def flush_before(self, scheduler: Any) -> None:
        """Flush whenever the worker calls into the scheduler: its puts for a step are all done."""
        for name in ("step", "add_requests", "add_request"):
            call = getattr(scheduler, name, None)
            if call is not None:
                setattr(scheduler, name, self._flushing(call))

    def _flushing(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def flushed_first(*args: Any, **kwargs: Any) -> Any:
            if self._items:
                self.flush()
            return call(*args, **kwargs)
        return flushed_first

    def _flush_when_woken(self) -> None:
        while True:
            self._waiting.wait()
            # A step's puts take the worker about a millisecond at batch 64, and it flushes them
            # itself when it is done; this thread is for what no step follows. Waking at once would
            # take the GIL between the step's puts and split the step into many messages.
            time.sleep(FLUSH_GRACE_S)
            self.flush()


def _engine_main(conn: Any, serve_args: argparse.Namespace) -> None:
    """The engine process: build the manager from serve's flags, then serve the pipe until told to stop."""
    import gc

    from common.serve.engine import build_manager

    # Ctrl-C reaches every process in the terminal's group; the server decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        manager, stage = build_manager(serve_args)
    except SystemExit as exc:  # e.g. a stage without a SchedulerManager: the server exits with it
        conn.send(("failed", str(exc)))
        return
    except BaseException as exc:  # its traceback goes to stderr; the server names it
        conn.send(("failed", f"serve: the engine failed to start: {type(exc).__name__}: {exc}"))
        raise
    conn.send(("ready", EngineInfo.of(manager.engine, stage)))
    gc.collect()
    gc.freeze()  # the model and the manager live as long as we do (as `stagewise serve` does)
    # The worker (tokens), the outbox's thread and this one (replies) all send.
    send = functools.partial(send_or_drop, conn, threading.Lock())
    handles: dict[int, Any] = {}
    outbox = Outbox(send, handles)
    outbox.flush_before(manager.scheduler)

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server died without saying goodbye
                break
            kind = message[0]
            if kind == "add":
                _, rid, prompt, prompt_token_ids, params = message
                try:
                    handle = manager.add_request(prompt, prompt_token_ids=prompt_token_ids, params=params)
                except Exception as exc:  # closed meanwhile: this request's error
                    send(("out", [(rid, [], portable(exc))]))
                    continue
                handles[rid] = handle
                handle.set_listener(outbox.listener(rid, handle))
            elif kind == "cancel":
                handle = handles.get(message[1])
                if handle is not None:
                    handle.cancel()
            elif kind == "call":
                _, call_id, fn, args = message
                try:
                    send(("reply", call_id, True, fn(manager, *args)))
                except Exception as exc:
                    send(("reply", call_id, False, portable(exc)))
            elif kind == "close":
                break
    finally:
        manager.close()  # every request still in flight ends...
        close_engine = getattr(manager.engine, "close", None)
        if close_engine is not None:
            close_engine()  # stage 12+: its graphs; stage 14: its other ranks
        outbox.flush()  # ...and its end goes out before we say goodbye
        send(("closed",))
        conn.close()
