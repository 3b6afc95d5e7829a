"""The TCP side of `stagewise serve`: what reaches the wire, and in how many writes.

A streamed token is a few hundred bytes, so on loopback what it costs is the system calls that
send it and the acknowledgements TCP waits for, not the bytes: Nagle's algorithm would hold a
response's second small write for the client's delayed ACK (40 ms), and uvicorn writes a response's
head and its first body part in two calls where one does. `EventStream` writes a stream's events
straight to ASGI's `send`, in the request's own task.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, AsyncGenerator


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so `--port 0` works and the real port can be printed.

    IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections accepted from a socket that says it is TCP. With Nagle on, a streamed response
    is a small write (the headers) followed by another (the first token): the second waits for
    the client's delayed ACK, 40 ms on Linux, on every request's first token.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class HeadWithBody:
    """A connection's transport that sends a response's head together with its first body write.

    uvicorn writes the status line and headers as soon as the app sends `http.response.start`,
    and each body part in a write of its own: two send() system calls for a streamed response's
    first token, each ~60 us on this VM's loopback (the kernel delivers to the client inside the
    call). The app always sends the first body part right after the start, in the same step, so
    the head waits here for it; if none comes in this event-loop pass, the head goes alone.
    Every other write goes straight through.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        elif data.startswith(b"HTTP/1.1 "):  # a response head (a body part starts with its hex size)
            self._head = data
            self._loop.call_soon(self._send_head)
            return
        self._transport.write(data)

    def _send_head(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self._send_head()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's
        return getattr(self._transport, name)


def http_protocol() -> Any:
    """uvicorn's httptools protocol with HeadWithBody on every connection ("auto" without httptools)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class Protocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(HeadWithBody(transport, self.loop))  # type: ignore[arg-type]

    return Protocol


class CancelOnDisconnect:
    """`async with CancelOnDisconnect(receive):` cancels the task running the block when the client
    goes away (ASGI's `receive` says `http.disconnect`), and swallows that one cancellation: the
    block's awaits end at once, and their finally clauses (a request's cancel, a stream's close)
    run. A watcher task waits on `receive` meanwhile, one a request, so the request's own task
    pays only its start. Only after a request's body is read: the watcher takes whatever `receive` gives."""

    def __init__(self, receive: Any) -> None:
        self.receive, self.gone = receive, False
        self.task: asyncio.Task | None = None  # the task running the block, and the one watching for it
        self.watcher: asyncio.Task | None = None

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.task.cancel()  # raised where the block awaits now, never past it: __aexit__ does not await

    async def __aenter__(self) -> "CancelOnDisconnect":
        self.task = asyncio.current_task()
        self.watcher = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.watcher.cancel()
        if exc_type is asyncio.CancelledError and self.gone:
            if hasattr(self.task, "uncancel"):  # Python 3.11+: the cancel we asked for is handled
                self.task.uncancel()
            return True
        return False  # any other exception, and a cancel from outside (server shutdown), go on


class EventStream:
    """A stream of Server-Sent Events, written straight to ASGI's `send` in the request's own task.

    Why not Starlette's StreamingResponse: under uvicorn (ASGI spec 2.3) it runs the stream in a
    new task of a per-response task group, and a new task first runs one event-loop pass later.
    In a burst the loop makes all 64 responses in one pass and streams them in the next, so the
    median request's first token waits for the whole burst's set-up. Its cancel scope, task group
    and header building also cost more than writing the first chunk. Here the head and the first
    chunk are written in the pass that makes the response. It runs inside the request's
    `CancelOnDisconnect`, whose watcher cancels this task when the client goes away (events()'
    finally then cancels the request, freeing its blocks).
    """

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
            async for text in self.events:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Cancelled in a send, events() still waits at a yield: close it now (its finally
            # cancels the request, freeing its blocks) rather than whenever it is collected.
            await self.events.aclose()
