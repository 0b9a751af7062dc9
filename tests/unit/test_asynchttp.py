"""The emulator's asyncio HTTP server speaks what the sandbox's clients send: keep-alive,
Content-Length and chunked bodies, curl's `Expect: 100-continue`, and a 400 for nonsense."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from slurm_idle.testing import asynchttp
from slurm_idle.testing.asynchttp import HttpRequest, Reply


async def echo(request: HttpRequest) -> Reply:
    return 200, f"{request.method} {request.target} {request.body.decode()}".encode(), "text/plain"


@pytest.fixture
def port() -> Iterator[int]:
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asynchttp.start(echo, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield server.sockets[0].getsockname()[1]
    loop.call_soon_threadsafe(server.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def exchange(port: int, data: bytes) -> bytes:
    """Send `data`, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_keep_alive_then_close(port: int) -> None:
    """Two requests on one connection; the second asks to close and gets Connection: close."""
    answer = exchange(port, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
                            b"POST /b HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert answer.endswith(b"Connection: close\r\n\r\nPOST /b hi")
    assert b"GET /a " in answer


def test_chunked_body_and_expect_continue(port: int) -> None:
    """A chunked body is joined; `Expect: 100-continue` gets its interim answer first."""
    answer = exchange(port, b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
                            b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
                            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    assert answer.endswith(b"POST /c abcde")


def test_http_1_0_closes_and_nonsense_gets_400(port: int) -> None:
    assert exchange(port, b"GET /d HTTP/1.0\r\n\r\n").endswith(b"GET /d ")
    assert exchange(port, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 Bad Request")
