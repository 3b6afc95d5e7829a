"""What a SchedulerManager hands its callers: a RequestHandle per request, StreamChunks on it.

These never change from stage 04 on (only the manager behind them does), so they live here
once. The worker puts `StreamChunk`s on a request's own `ChunkQueue` as tokens are flushed, then
one `Done` (the final Completion) or `Failed` (the request's own error); the handle turns that
queue into an iterator of chunks and a blocking `result()` for threads, and into `drain()` plus
a put listener for an event loop (`stagewise serve`), which then needs no thread per request.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from common.requests import Completion, Request


@dataclass
class StreamChunk:
    """Text (and the token ids behind it) produced since the previous chunk."""

    text: str
    token_ids: list[int]


@dataclass
class Done:
    completion: Completion


@dataclass
class Failed:
    error: BaseException


@dataclass
class Pending:
    """A request waiting for the worker to prefill it."""

    request_id: int
    request: Request
    timings: dict[str, float]


@dataclass
class StreamState:
    """Tokens produced but not yet flushed to the caller."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""


class ChunkQueue(queue.Queue):
    """A request's queue: a plain `queue.Queue` that can also call a listener after every put.

    Why: a thread blocked in `get()` per request is how a Python caller reads a stream, but a
    server holding 64 streams would keep 64 threads, each woken by every token and each taking
    the GIL back from the worker in the middle of its decode step. With a listener (set by the
    event loop that serves the request) the worker's `put` itself tells the loop, and the loop
    drains the queue without blocking: one hop per token, no thread in between. vLLM's
    `AsyncLLM` feeds its per-request output queues from one task the same way.
    """

    def __init__(self) -> None:
        super().__init__()
        self._listener: Callable[[], None] | None = None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        listener = self._listener
        if listener is not None:
            listener()  # runs in the putting thread (the worker): must be quick and never raise

    def take_all(self) -> list[Any]:
        """Everything waiting, at once and without blocking: one lock round, not one per item."""
        with self.mutex:
            items = list(self.queue)
            self.queue.clear()
            self.not_full.notify_all()
        return items

    def set_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every put from now on, and once now if items are waiting."""
        with self.mutex:
            self._listener = listener
            waiting = self._qsize() > 0
        if waiting:
            listener()


class _Cancels(Protocol):
    def cancel(self, request_id: int) -> None: ...


class RequestHandle:
    """What `add_request` returns: iterate it for StreamChunks, or wait for the final Completion."""

    def __init__(self, manager: _Cancels, request_id: int, out: ChunkQueue) -> None:
        self.request_id = request_id
        self._manager = manager
        self._out = out
        self._final: Completion | BaseException | None = None
        self._cancel_sent = False

    def _take(self, item: StreamChunk | Done | Failed) -> StreamChunk | None:
        """A chunk as it is; the end (Done's Completion, Failed's error) kept as `_final`."""
        if isinstance(item, StreamChunk):
            return item
        self._final = item.completion if isinstance(item, Done) else item.error
        return None

    def __iter__(self) -> Iterator[StreamChunk]:
        while self._final is None:
            chunk = self._take(self._out.get())
            if chunk is not None:
                yield chunk
        if isinstance(self._final, BaseException):
            raise self._final

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request ends; raises the request's own error if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._final is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._out.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s") from None
            self._take(item)  # chunks are skipped: only the end counts here
        if isinstance(self._final, BaseException):
            raise self._final
        return self._final

    def drain(self) -> tuple[list[StreamChunk], Completion | BaseException | None]:
        """Without blocking: the chunks that have arrived, and the end (Completion or the
        request's error) if it has come. For an event loop woken by `set_listener`."""
        chunks: list[StreamChunk] = []
        if self._final is None:
            for item in self._out.take_all():  # the end, when there, is the last item
                chunk = self._take(item)
                if chunk is not None:
                    chunks.append(chunk)
        return chunks, self._final

    def set_listener(self, listener: Callable[[], None]) -> None:
        """Have `listener()` called (in the worker's thread) whenever something arrives."""
        self._out.set_listener(listener)

    def cancel(self) -> None:
        """Stop the request. Once: a second call, or one after its end was read, does nothing."""
        if self._cancel_sent or self._final is not None:
            return
        self._cancel_sent = True
        self._manager.cancel(self.request_id)
