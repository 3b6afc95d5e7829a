"""bench-serve's HTTP reading (common/sse_client.py): chunked framing parsed from whatever a read returns, and a head in one read."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.sse_client import Connection, split_chunks

EVENTS = [b'data: {"text": "Hi"}\n\n', b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]


def chunked(parts: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailers + b"\r\n"


@pytest.mark.parametrize("trailers", [b"", b"x-usage: 1\r\n"])
def test_split_chunks_reassembles_any_split_of_the_stream(trailers: bytes) -> None:
    wire = chunked(EVENTS, trailers)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randint(1, 12)))
        got, buf, done = [], b"", False
        for a, b in zip([0] + cuts, cuts + [len(wire)]):
            assert not done  # nothing is announced finished before its last byte
            pieces, buf, done = split_chunks(buf + wire[a:b])
            got += pieces
        assert done and buf.endswith(b"\r\n") and b"".join(got) == b"".join(EVENTS)


def test_head_and_chunked_body_from_a_stream_reader() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def main() -> tuple[int, dict, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(head + chunked(EVENTS))
        conn = Connection(reader, writer=None)  # type: ignore[arg-type]
        status, headers = await conn.response_head()
        body = b"".join([p async for p in conn.body_pieces(headers)])
        return status, headers, body

    status, headers, body = asyncio.run(main())
    assert status == 200 and headers["transfer-encoding"] == "chunked" and body == b"".join(EVENTS)


def test_a_closed_connection_is_a_connection_error() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_eof()
        await Connection(reader, writer=None).response_head()  # type: ignore[arg-type]

    with pytest.raises(ConnectionError):
        asyncio.run(main())
