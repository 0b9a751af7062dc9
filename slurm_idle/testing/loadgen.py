"""Client traffic through the sandbox's router, counted on the client side.

`scripts/sandbox load RPS` runs this as a sandbox process: an open-loop generator sending
`RPS` completions a second to the router (HAProxy) and appending one JSON line per request to
`--out`: `{"t": start, "d": seconds, "ok": bool, "why": ...}`.

It is bounded so that it measures the service, not itself: one asyncio loop (one thread) with
at most `--concurrency` requests in flight (a thread per request once made it run 15,501
threads at 500 req/s). A request whose turn comes while every slot is busy, and that finds
none free before the next one is due, is not sent: it is recorded as `client_overload` (the
generator's limit, not a failure of the service). SIGTERM stops it at once: requests still in
flight are cancelled and recorded as `cancelled`.

A sent request fails on a connection error, a timeout (`--timeout-s` for the whole request),
a non-200 answer, a truncated answer or one the engine aborted (finish_reason `abort`).
`summarize` turns the lines into `{"requests", "ok", "failed", "p50_s", "p99_s", "failures",
"client_overload", "cancelled", "drain_failures"}` (optionally for a time window): `failed`
and `failures` (by reason) are the service's; `drain_failures` counts those that a replica
stopped or put to sleep under its clients causes (`DRAIN_REASONS`: aborted, reset, refused,
truncated, 502/503), as opposed to a request queued too long (`OVERLOAD_REASONS`: `timeout`,
HAProxy's 504), which is load.

Run: python -m slurm_idle.testing.loadgen --url http://127.0.0.1:P --rps R --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

PROMPT_WORDS = 200  # the emulator's simulated request shape (engine_model.Capacity)
MAX_TOKENS = 100
CONCURRENCY = 200
CLIENT_OVERLOAD = "client_overload"
CANCELLED = "cancelled"
TIMEOUT = "timeout"
#: Reasons that are the client's, not the service's: never counted as failed.
CLIENT_SIDE = frozenset({CLIENT_OVERLOAD, CANCELLED})
#: What a replica stopped or put to sleep under its clients looks like to them.
DRAIN_REASONS = frozenset({
    "aborted", "truncated", "http 502", "http 503", "connection: ConnectionResetError",
    "connection: ConnectionRefusedError", "connection: RemoteDisconnected",
    "connection: IncompleteReadError", "connection: BrokenPipeError",
})
#: What a request queued longer than its client (or HAProxy's `timeout server`) waits is.
OVERLOAD_REASONS = frozenset({TIMEOUT, "http 504"})


def failure_kind(why: str) -> str:
    """`drain`, `overload` or `other`: what a failure of the service says about its cause."""
    if why in DRAIN_REASONS:
        return "drain"
    return "overload" if why in OVERLOAD_REASONS else "other"


def request_bytes(host: str, port: int, model: str, max_tokens: int) -> bytes:
    body = json.dumps({"model": model, "prompt": "word " * PROMPT_WORDS,
                       "max_tokens": max_tokens}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


def judge(status: int, data: bytes) -> tuple[bool, str]:
    """A completion's answer as the client sees it: (ok, why-not)."""
    if status != 200:
        return False, f"http {status}"
    try:
        choice = json.loads(data)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return False, "truncated"
    if choice.get("finish_reason") == "abort":
        return False, "aborted"
    return True, ""


async def one_request(host: str, port: int, payload: bytes, timeout_s: float) -> tuple[bool, str]:
    """One completion through the router (a fresh connection each): (ok, why-not)."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(payload)
            await writer.drain()
            status_line = await reader.readline()
            if not status_line:
                return False, "connection: RemoteDisconnected"
            status = int(status_line.split()[1])
            length = None
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            data = await (reader.readexactly(length) if length is not None else reader.read())
    except TimeoutError:  # before OSError: TimeoutError is one
        return False, TIMEOUT
    except (OSError, asyncio.IncompleteReadError) as exc:
        return False, f"connection: {type(exc).__name__}"
    except (ValueError, IndexError):
        return False, "truncated"
    finally:
        if writer is not None:
            writer.close()
    return judge(status, data)


async def run(url: str, rps: float, out: IO[str], model: str, max_tokens: int, timeout_s: float,
              stop: asyncio.Event, concurrency: int = CONCURRENCY) -> None:
    """Send `rps` requests a second until `stop` is set, then cancel those in flight."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = request_bytes(host, port, model, max_tokens)
    in_flight: set[asyncio.Task[None]] = set()
    busy = 0  # slots taken: a request holds one until its answer is in or it is cancelled
    freed = asyncio.Event()  # set whenever a slot is given back
    loop = asyncio.get_running_loop()

    def record(started: float, t0: float, ok: bool, why: str) -> None:
        out.write(json.dumps({"t": round(started, 3), "d": round(loop.time() - t0, 4),
                              "ok": ok, "why": why}) + "\n")
        out.flush()

    async def fire(started: float, t0: float) -> None:
        nonlocal busy
        try:
            ok, why = await one_request(host, port, payload, timeout_s)
        except asyncio.CancelledError:
            record(started, t0, False, CANCELLED)
            raise
        finally:
            busy -= 1
            freed.set()
        record(started, t0, ok, why)

    interval = 1.0 / rps
    next_at = loop.time()
    while not stop.is_set():
        started, t0 = time.time(), loop.time()
        next_at += interval
        while busy >= concurrency and loop.time() < next_at and not stop.is_set():
            freed.clear()
            await _wait(freed, next_at - loop.time())
        if stop.is_set():
            break
        if busy < concurrency:
            busy += 1
            task = asyncio.create_task(fire(started, t0))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        else:
            record(started, t0, False, CLIENT_OVERLOAD)
        await _wait(stop, next_at - loop.time())
    for task in list(in_flight):
        task.cancel()
    await asyncio.gather(*in_flight, return_exceptions=True)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passed, whichever comes first."""
    try:
        await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
    except TimeoutError:
        pass


def read_results(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))], 4)


def summarize(results: Iterable[dict[str, Any]], since: float | None = None,
              until: float | None = None) -> dict[str, Any]:
    """Counts and latency quantiles of the requests started in [since, until).

    `failed` and `failures` (by reason) are the service's; requests the generator did not send
    (`client_overload`) or cancelled when stopped (`cancelled`) are counted apart.
    """
    rows = [r for r in results if (since is None or r["t"] >= since)
            and (until is None or r["t"] < until)]
    ok = [r for r in rows if r["ok"]]
    why: dict[str, int] = {}
    client = {CLIENT_OVERLOAD: 0, CANCELLED: 0}
    for r in rows:
        if r["ok"]:
            continue
        if r["why"] in CLIENT_SIDE:
            client[r["why"]] += 1
        else:
            why[r["why"]] = why.get(r["why"], 0) + 1
    return {"requests": len(rows), "ok": len(ok), "failed": sum(why.values()),
            "p50_s": _quantile([r["d"] for r in ok], 0.5),
            "p99_s": _quantile([r["d"] for r in ok], 0.99), "failures": why, **client,
            "drain_failures": sum(n for k, n in why.items() if failure_kind(k) == "drain")}


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with args.out.open("a") as out:
        await run(args.url, args.rps, out, args.model, args.max_tokens, args.timeout_s, stop,
                  args.concurrency)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_idle.testing.loadgen",
                                description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the router's address, e.g. http://127.0.0.1:8080")
    p.add_argument("--rps", type=float, required=True)
    p.add_argument("--out", type=Path, required=True, help="results, one JSON line per request")
    p.add_argument("--model", default="sandbox-model")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=CONCURRENCY,
                   help="most requests in flight; one due while all are busy is client_overload")
    args = p.parse_args(argv)
    if args.rps <= 0:
        return 0
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
