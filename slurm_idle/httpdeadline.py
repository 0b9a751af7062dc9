"""The one HTTP client of engine, scrape and warm-up calls: a total deadline, bounded bodies,
no proxies.

urllib's `timeout` bounds each socket operation, so a page trickled one byte every 2 s never
times out (measured: 81 s for a `--timeout 5` scrape). Here the whole exchange runs in a worker
thread and the caller waits at most `timeout_s`; at the deadline the socket is shut down, which
ends the worker's blocked read at once, and `DeadlineExceeded` (a TimeoutError, so an OSError as
urllib's own errors are) is raised. Bodies are read up to a ceiling (`max_bytes`). No proxies,
whatever `http_proxy`/`HTTPS_PROXY` say: replicas are on the cluster network, and a site proxy
would see (and could hold) every probe. `DeadlineClient` is that client behind the small
`HttpClient` protocol the engine probes, the scrape source, the doctor and the router's
warm-up take (tests inject fakes); `call_within` bounds any other blocking call (the
Prometheus client, which has its own HTTP stack) the same way, abandoning it at the deadline.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

#: Ceiling of any body read (a metrics page of 10,000 series is a few MB).
MAX_BODY_BYTES = 32 * 1024 * 1024


class DeadlineExceeded(TimeoutError):
    """The call did not finish within its total deadline."""


class Disconnected(ConnectionError):
    """The server closed or reset the connection before answering: no answer at all, so an
    idempotent request may be sent again (a server that got it and then dropped the socket
    will get it twice)."""


class Refused(ConnectionError):
    """Nothing listens on the port (ECONNREFUSED): the one transport failure that proves the
    server is not there, as opposed to a slow or unreachable one."""


def _open(url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme == "https":
        return http.client.HTTPSConnection(host, parts.port or 443, timeout=timeout_s)
    if parts.scheme != "http":
        raise OSError(f"unsupported URL scheme in {url!r} (http or https)")
    return http.client.HTTPConnection(host, parts.port or 80, timeout=timeout_s)


@dataclass(frozen=True)
class HttpResponse:
    """An answer: any status, the body as read (cut at the client's ceiling)."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class HttpClient(Protocol):
    """One request within `timeout` seconds in all. DeadlineClient raises OSError when no
    answer came (DeadlineExceeded at the deadline); the engine's wrapper (engine.UrllibClient)
    raises EngineError instead, which is what the engine adapters expect of the client given."""

    def request(self, method: str, url: str, timeout: float) -> HttpResponse: ...


@dataclass(frozen=True)
class DeadlineClient:
    """The real HttpClient: `request` below, bodies cut at `max_bytes`."""

    max_bytes: int = MAX_BODY_BYTES

    def request(self, method: str, url: str, timeout: float, body: bytes | None = None,
                headers: Mapping[str, str] | None = None) -> HttpResponse:
        status, data = request(method, url, timeout, self.max_bytes, body=body, headers=headers)
        return HttpResponse(status, data)


def request(
    method: str, url: str, timeout_s: float, max_bytes: int = MAX_BODY_BYTES,
    body: bytes | None = None, headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    """(status, body) of one request, the whole of it within `timeout_s` seconds.

    Any status is returned; no answer raises OSError (DeadlineExceeded at the deadline). A body
    over `max_bytes` is cut there (a metrics page that big is refused by its parser anyway).
    """
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = _open(url, max(timeout_s, 0.001))
    results: list[tuple[int, bytes]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            payload = body if body is not None else (b"" if method == "POST" else None)
            conn.request(method, path, body=payload, headers={**(headers or {}), "Connection": "close"})
            resp = conn.getresponse()
            results.append((resp.status, resp.read(max_bytes)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=work, name=f"http {url[:60]}", daemon=True)
    worker.start()
    worker.join(max(timeout_s, 0.0))
    if worker.is_alive():
        _abort(conn)
        worker.join(1.0)
        raise DeadlineExceeded(f"{method} {url}: no complete answer within {timeout_s:g} s")
    conn.close()
    if errors:
        if isinstance(errors[0], TimeoutError):
            # The socket's own timeout (the same deadline) fired a moment before the join did.
            raise DeadlineExceeded(f"{method} {url}: no complete answer within {timeout_s:g} s")
        if isinstance(errors[0], ConnectionRefusedError):
            raise Refused(f"{method} {url}: {errors[0]}") from None
        if isinstance(errors[0], ConnectionResetError | ConnectionAbortedError | BrokenPipeError):
            # http.client.RemoteDisconnected ("Remote end closed connection without response")
            # is a ConnectionResetError too
            raise Disconnected(f"{method} {url}: {errors[0]}") from None
        if isinstance(errors[0], OSError | http.client.HTTPException):
            raise OSError(f"{method} {url}: {errors[0]}") from None
        raise errors[0]
    return results[0]


def _abort(conn: http.client.HTTPConnection) -> None:
    """Wake a read blocked on this connection's socket (shutdown), then close it."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    conn.close()


def call_within(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()`'s result if it returns within `timeout_s`, else DeadlineExceeded (the call is left
    to finish on its own daemon thread; its own timeouts end it)."""
    results: list[T] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=work, name=what[:60], daemon=True)
    worker.start()
    worker.join(max(timeout_s, 0.0))
    if worker.is_alive():
        raise DeadlineExceeded(f"{what}: no answer within {timeout_s:g} s")
    if errors:
        raise errors[0]
    return results[0]
