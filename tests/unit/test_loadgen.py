"""The sandbox's load generator is bounded: at most `concurrency` requests in flight, the rest
counted as client_overload (not the service's failures), a few threads at any rate, and
SIGTERM stops it at once with the requests in flight counted as cancelled."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_idle.testing import loadgen

REPO = Path(__file__).resolve().parents[2]


class Holding:
    """A server that reads requests and never answers: every request stays in flight."""

    def __init__(self) -> None:
        self.open = 0
        self.most = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.most = max(self.most, self.open)
        try:
            await reader.read()  # until the client goes
        finally:
            self.open -= 1
            writer.close()


def test_the_cap_holds_and_the_excess_is_client_overload() -> None:
    """Concurrency 5 at 1,000 req/s: 5 connections at most, later requests are
    client_overload, and stopping cancels the 5; none counts as the service's failure."""
    held = Holding()
    out = io.StringIO()

    async def scenario() -> None:
        server = await asyncio.start_server(held.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stop = asyncio.Event()

        async def stop_after_overload() -> None:
            deadline = time.monotonic() + 10
            while out.getvalue().count(loadgen.CLIENT_OVERLOAD) < 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            stop.set()

        watcher = asyncio.create_task(stop_after_overload())
        # Stopping must not wait for the requests in flight (their timeout is 600 s).
        await asyncio.wait_for(loadgen.run(f"http://127.0.0.1:{port}", 1000, out, "m", 1, 600,
                                           stop, concurrency=5), 20)
        await watcher
        server.close()

    asyncio.run(scenario())
    st = loadgen.summarize(json.loads(line) for line in out.getvalue().splitlines())
    assert held.most == 5
    assert st["client_overload"] >= 20
    assert st["cancelled"] == 5
    assert (st["failed"], st["failures"], st["ok"]) == (0, {}, 0)


@pytest.fixture
def holding_server() -> Iterator[tuple[Holding, int]]:
    held = Holding()
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(held.handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield held, server.sockets[0].getsockname()[1]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_load_500_runs_in_few_threads_and_sigterm_cancels_at_once(
        holding_server: tuple[Holding, int], tmp_path: Path) -> None:
    """At 500 req/s against a server that never answers: 200 in flight, a handful of threads;
    SIGTERM ends it without waiting for them (each recorded as cancelled)."""
    held, port = holding_server
    out = tmp_path / "traffic.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_idle.testing.loadgen", "--url", f"http://127.0.0.1:{port}",
         "--rps", "500", "--out", str(out), "--timeout-s", "600"],
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 30
        while held.open < loadgen.CONCURRENCY and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.01)
        time.sleep(1)  # 500 more requests fall due meanwhile: client_overload, no new thread
        assert held.open == loadgen.CONCURRENCY
        assert threads_of(proc.pid) <= 10
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=20) == 0  # the 600 s request timeout is never waited for
        assert time.monotonic() - t0 < 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    st = loadgen.summarize(loadgen.read_results(out))
    assert st["cancelled"] == loadgen.CONCURRENCY
    assert st["client_overload"] >= 300
    assert st["failed"] == 0


def test_summary_keeps_the_client_side_apart_and_names_drain_failures() -> None:
    """failed/failures are the service's; client_overload and cancelled are counted apart;
    drain_failures counts aborts, resets and 503s but not timeouts or 504s (load)."""
    whys = ["", "", "aborted", "connection: ConnectionResetError", "timeout", "http 503",
            "http 504", loadgen.CLIENT_OVERLOAD, loadgen.CANCELLED]
    rows = [{"t": i, "d": 0.1, "ok": not w, "why": w} for i, w in enumerate(whys)]
    st = loadgen.summarize(rows)
    assert (st["requests"], st["ok"], st["failed"]) == (9, 2, 5)
    assert st["failures"] == {"aborted": 1, "connection: ConnectionResetError": 1,
                              "timeout": 1, "http 503": 1, "http 504": 1}
    assert (st["client_overload"], st["cancelled"], st["drain_failures"]) == (1, 1, 3)


def test_failure_kinds() -> None:
    """A stopping replica's marks are drain, a queue's timeouts overload, the rest other."""
    kinds = {why: loadgen.failure_kind(why) for why in (
        "aborted", "truncated", "http 503", "connection: RemoteDisconnected", "timeout",
        "http 504", "http 500", "http 404")}
    assert kinds == {"aborted": "drain", "truncated": "drain", "http 503": "drain",
                     "connection: RemoteDisconnected": "drain", "timeout": "overload",
                     "http 504": "overload", "http 500": "other", "http 404": "other"}
