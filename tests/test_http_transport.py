"""common/serve/transport.py: a response's head leaves with its first body part, in one write;
the listening socket fails fast on a taken port and gives connections with Nagle off."""

from __future__ import annotations

import asyncio
import socket

import pytest

from common.serve.transport import HeadWithBody, bind_socket, http_protocol

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
CHUNK = b"1a\r\ndata: {\"text\": \"Hi\"}\n\n\r\n"


class Recorder:
    """A transport that records each write (one write = one send() system call)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 1234) if name == "peername" else default


def test_head_waits_for_the_first_body_part_and_goes_with_it() -> None:
    async def main() -> list[bytes]:
        inner = Recorder()
        t = HeadWithBody(inner, asyncio.get_running_loop())
        t.write(HEAD)
        assert inner.writes == []  # held
        t.write(CHUNK)
        t.write(CHUNK)
        await asyncio.sleep(0)  # the safety net runs, and finds nothing held
        return inner.writes

    assert asyncio.run(main()) == [HEAD + CHUNK, CHUNK]


def test_a_head_with_no_body_in_the_same_pass_goes_alone() -> None:
    async def main() -> Recorder:
        inner = Recorder()
        t = HeadWithBody(inner, asyncio.get_running_loop())
        t.write(HEAD)
        await asyncio.sleep(0)
        assert inner.writes == [HEAD]
        t.write(CHUNK)
        return inner

    assert asyncio.run(main()).writes == [HEAD, CHUNK]


def test_close_sends_a_held_head_first_and_the_rest_is_the_transports() -> None:
    async def main() -> Recorder:
        inner = Recorder()
        t = HeadWithBody(inner, asyncio.get_running_loop())
        assert t.get_extra_info("peername") == ("127.0.0.1", 1234)
        t.write(HEAD)
        t.close()
        assert t.is_closing()
        await asyncio.sleep(0)
        return inner

    inner = asyncio.run(main())
    assert inner.writes == [HEAD] and inner.closed


def test_the_server_protocol_wraps_every_connection() -> None:
    import uvicorn
    from uvicorn.server import ServerState

    async def app(scope, receive, send) -> None:
        pass

    async def main() -> object:
        config = uvicorn.Config(app, http=http_protocol(), lifespan="off")
        config.load()
        protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={},
                                              _loop=asyncio.get_running_loop())
        protocol.connection_made(Recorder())
        return protocol.transport

    assert isinstance(asyncio.run(main()), HeadWithBody)


def test_port_in_use_fails_fast() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            bind_socket("127.0.0.1", taken.getsockname()[1])



def test_accepted_connections_have_nagle_off() -> None:
    """Every accepted connection sends at once (TCP_NODELAY). asyncio sets it only when the
    listening socket was made with IPPROTO_TCP; without it, every first token of a stream
    waited 40 ms for the client's delayed ACK."""
    sock = bind_socket("127.0.0.1", 0)
    nodelay: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            nodelay.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            await asyncio.wait_for(reader.read(), timeout=10)  # the probe closes it
            writer.close()

    asyncio.run(accept_one())
    assert nodelay and nodelay[0] != 0

