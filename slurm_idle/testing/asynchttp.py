"""A small HTTP/1.1 server on one asyncio loop, for the vLLM emulator.

vLLM serves from uvicorn: a connection, and a request waiting in the engine's queue, costs a
coroutine, not a thread. http.server's ThreadingHTTPServer costs a thread per connection, and
`scripts/sandbox load 500` once made one emulator run 1,690 of them. This module speaks just
what the sandbox's clients send (HAProxy, Prometheus, urllib, http.client, curl):
Content-Length or chunked bodies, `Expect: 100-continue`, keep-alive unless the client says
`Connection: close`. A handler also learns when its client went away (`HttpRequest.gone`), as
vLLM does to abort the request of a client that disconnected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

#: (status, body, content type)
Reply = tuple[int, bytes, str]
MAX_HEADER_LINES = 100
MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True)
class HttpRequest:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    reader: asyncio.StreamReader

    def gone(self) -> bool:
        """True once the client closed its side: nobody is left to read an answer."""
        return self.reader.at_eof()


#: None: answer nothing (the client is gone).
Handler = Callable[[HttpRequest], Awaitable[Reply | None]]


class BadRequest(ValueError):
    pass


async def read_request(reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> HttpRequest | None:
    """The next request on the connection, None when the client closed it between two."""
    request_line = await reader.readline()
    if request_line in (b"\r\n", b"\n"):  # a stray line end after the last body: allowed
        request_line = await reader.readline()
    if not request_line.strip():
        return None
    try:
        method, target, version = request_line.decode("latin-1").split()
    except ValueError:
        raise BadRequest("bad request line") from None
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    else:
        raise BadRequest("too many header lines")
    if version == "HTTP/1.0" and "connection" not in headers:
        headers["connection"] = "close"
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _chunked(reader)
    else:
        length = int(headers.get("content-length") or 0)
        if not 0 <= length <= MAX_BODY:
            raise BadRequest("bad Content-Length")
        body = await reader.readexactly(length) if length else b""
    return HttpRequest(method, target, headers, body, reader)


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        if sum(map(len, parts)) + size > MAX_BODY:
            raise BadRequest("body too large")
        parts.append(await reader.readexactly(size))
        await reader.readline()


def response_bytes(reply: Reply, close: bool) -> bytes:
    code, body, ctype = reply
    head = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "")
            + "\r\n")
    return head.encode("latin-1") + body


async def serve_connection(handler: Handler, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
    """The requests of one connection in turn, until either side closes it."""
    try:
        while (request := await read_request(reader, writer)) is not None:
            reply = await handler(request)
            if reply is None:
                break
            close = request.headers.get("connection", "").lower() == "close"
            writer.write(response_bytes(reply, close))
            await writer.drain()
            if close:
                break
    except BadRequest as exc:
        writer.write(response_bytes((400, str(exc).encode(), "text/plain"), close=True))
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass  # a client gone or speaking nonsense: drop its connection
    finally:
        writer.close()


async def start(handler: Handler, host: str, port: int) -> asyncio.Server:
    """Listen on host:port (backlog as uvicorn's: queued connections, not refused ones)."""
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_connection(handler, reader, writer)

    return await asyncio.start_server(connection, host, port, reuse_address=True, backlog=2048)
