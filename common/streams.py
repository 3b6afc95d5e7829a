"""What a SchedulerManager hands its callers: a RequestHandle per request, StreamChunks on it.

These never change from stage 04 on (only the manager behind them does), so they live here
once. The worker puts `StreamChunk`s on a request's own queue as tokens are flushed, then one
`Done` (the final Completion) or `Failed` (the request's own error); the handle turns that queue
into an iterator of chunks and a blocking `result()`.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

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


class _Cancels(Protocol):
    def cancel(self, request_id: int) -> None: ...


class RequestHandle:
    """What `add_request` returns: iterate it for StreamChunks, or wait for the final Completion."""

    def __init__(self, manager: _Cancels, request_id: int, out: "queue.Queue[Any]") -> None:
        self.request_id = request_id
        self._manager = manager
        self._out = out
        self._final: Completion | BaseException | None = None

    def __iter__(self) -> Iterator[StreamChunk]:
        while self._final is None:
            item = self._out.get()
            if isinstance(item, StreamChunk):
                yield item
            else:
                self._final = item.completion if isinstance(item, Done) else item.error
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
            if isinstance(item, Done):
                self._final = item.completion
            elif isinstance(item, Failed):
                self._final = item.error
        if isinstance(self._final, BaseException):
            raise self._final
        return self._final

    def cancel(self) -> None:
        self._manager.cancel(self.request_id)
