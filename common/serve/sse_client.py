"""The client side of one streaming OpenAI request: keep-alive HTTP/1.1 and SSE, standard library only.

Why not `httpx` or the `openai` SDK: a client that measures TTFT must not add its own latency,
and a benchmark that runs against vLLM or SGLang should not need a stack of their dependencies.
So a request is one write (head and body together), a response is read with asyncio streams
(chunked or not), and each SSE event that carries text is stamped with the time its bytes were
read. `stagewise bench-serve` (common/serve/bench.py) sends a workload through `stream_one`.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from typing import Any, AsyncIterator

from common.requests import Completion, Request


class Target:
    """Where to POST: scheme, host, port and the endpoint's path."""

    def __init__(self, base_url: str, endpoint: str, api_key: str | None) -> None:
        url = urllib.parse.urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"--base-url: expected http(s)://host[:port], got {base_url!r}")
        self.https, self.host = url.scheme == "https", url.hostname
        self.port = url.port or (443 if self.https else 80)
        prefix = url.path if url.path.endswith("/v1") else url.path + "/v1"
        self.chat = endpoint == "chat"
        self.path = prefix + ("/chat/completions" if self.chat else "/completions")
        self.models_path = prefix + "/models"
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def request_bytes(self, method: str, path: str, body: bytes = b"") -> bytes:
        """One HTTP/1.1 request, headers and body in one write (one segment, no Nagle wait)."""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}",
                 *(f"{k}: {v}" for k, v in self.headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def request_body(target: Target, model: str, request: Request) -> bytes:
    """One streaming request: greedy (temperature 0), usage asked for, EOS ignored if the workload says so."""
    body: dict[str, Any] = {"model": model, "max_tokens": request.params.max_new_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if target.chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:  # token ids when the workload only exists as ids (random lengths, shared prefix)
        body["prompt"] = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
    if not request.params.stop_on_eos:
        body["ignore_eos"] = True  # vLLM's and SGLang's extra field too
    return json.dumps(body).encode()


class Connection:
    """One keep-alive HTTP/1.1 connection, read with asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, target: Target) -> "Connection":
        return cls(*await asyncio.open_connection(target.host, target.port, ssl=True if target.https else None))

    async def response_head(self) -> tuple[int, dict[str, str]]:
        """Status code and headers (lower-case names); ConnectionError if the server closed it.

        The head in one read up to its blank line, not a read per line: in a burst this loop
        reads 64 heads at once, and every await is another pass before the next stream's turn."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise ConnectionError("connection closed by the server" if not exc.partial
                                  else f"connection closed in the response head: {exc.partial[:200]!r}") from None
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers

    async def body_pieces(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body as it arrives: chunked, by Content-Length, or up to the close.

        Chunked: whatever the socket has is read at once and every complete chunk in it is
        yielded together, so a token costs the client one read, not three (size line, data, CRLF).
        """
        if headers.get("transfer-encoding", "").lower() == "chunked":
            buf = b""
            while True:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("connection closed in a chunked body")
                buf += data
                pieces, buf, done = split_chunks(buf)
                if pieces:
                    yield b"".join(pieces)
                if done:
                    return
        elif "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
        else:
            while piece := await self.reader.read(65536):
                yield piece

    def close(self) -> None:
        self.writer.close()


def split_chunks(buf: bytes) -> tuple[list[bytes], bytes, bool]:
    """HTTP/1.1 chunked framing: (the complete chunks' data, what is left for the next read,
    whether the last chunk and the trailers have arrived)."""
    pieces, pos = [], 0
    while (eol := buf.find(b"\r\n", pos)) >= 0:
        size = int(buf[pos:eol].split(b";")[0], 16)
        if size == 0:  # the last chunk, then trailers (usually none) and a blank line
            end = 0 if buf.startswith(b"\r\n", eol + 2) else buf.find(b"\r\n\r\n", eol + 2)
            return pieces, buf[pos:], end >= 0
        if len(buf) < eol + 2 + size + 2:
            break  # this chunk's data is not all here yet
        pieces.append(buf[eol + 2:eol + 2 + size])
        pos = eol + 2 + size + 2
    return pieces, buf[pos:], False


class ConnectionPool:
    """Keep-alive connections, reused across requests as an SDK's pool reuses them: a TCP
    handshake is the network's cost, not the server's TTFT. The warmup run opens them."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._idle: list[Connection] = []

    async def get(self) -> tuple[Connection, bool]:
        """A connection, and whether it was reused (a reused one may have been closed meanwhile)."""
        if self._idle:
            return self._idle.pop(), True
        return await Connection.open(self.target), False

    def put(self, conn: Connection) -> None:
        self._idle.append(conn)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


async def stream_one(target: Target, pool: ConnectionPool, body: bytes) -> Completion:
    """POST one request and read its SSE stream, stamping each chunk that carries text."""
    conn, reused = await pool.get()
    payload = target.request_bytes("POST", target.path, body)
    try:
        submitted = time.perf_counter()
        conn.writer.write(payload)
        try:
            status, headers = await conn.response_head()
        except (ConnectionError, ValueError, IndexError):
            if not reused:
                raise
            conn.close()  # the server closed an idle keep-alive connection: one fresh try
            conn, reused = await Connection.open(target), False
            submitted = time.perf_counter()
            conn.writer.write(payload)
            status, headers = await conn.response_head()
        if status != 200:
            raw = b"".join([piece async for piece in conn.body_pieces(headers)])
            raise RuntimeError(f"HTTP {status}: {raw[:500].decode(errors='replace')}")
        stamps: list[float] = []
        texts: list[str] = []
        use: dict = {}
        finish = None
        pending = b""
        async for piece in conn.body_pieces(headers):
            now = time.perf_counter()  # every event in this piece arrived now
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                use = event.get("usage") or use
                for c in event.get("choices") or []:
                    text = (c.get("delta") or {}).get("content") if target.chat else c.get("text")
                    if text:
                        stamps.append(now)
                        texts.append(text)
                    finish = c.get("finish_reason") or finish
        if headers.get("connection", "").lower() == "close":
            conn.close()
        else:
            pool.put(conn)
    except BaseException:
        conn.close()
        raise
    n_prompt = int(use.get("prompt_tokens") or 0)
    n_out = int(use.get("completion_tokens") or len(stamps))
    return Completion(prompt_token_ids=[0] * n_prompt, token_ids=[0] * n_out, text="".join(texts),
                      finish_reason=finish or "unknown", token_timestamps=stamps, timings={"submitted": submitted})
