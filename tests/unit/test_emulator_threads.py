"""The emulator process serves queued completions without a thread each (`sandbox load 500`
once made one emulator run 1,690 threads), its queue still shows in vLLM's metrics, and a
client that goes away gets its request aborted (as vLLM does), not kept in the queue."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

QUEUED = 150
REPO = Path(__file__).resolve().parents[2]


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def gauge(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        page = r.read().decode()
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return float(s.value)
    raise AssertionError(f"no {name}")


def waiting(url: str) -> float:
    return gauge(url, "vllm:num_requests_waiting")


def until(cond: object, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def completion_request(max_tokens: int) -> bytes:
    body = json.dumps({"model": "m", "prompt": "a b", "max_tokens": max_tokens}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


@pytest.fixture
def emulator() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_idle.testing.emulator", "--port", "0", "--model", "m",
         "--max-num-seqs", "2"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    port = int(line.rsplit(":", 1)[1].split()[0])
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_queued_completions_cost_no_thread_each(emulator: tuple[subprocess.Popen[str], str]) -> None:
    """150 completions held open: the engine reports them waiting, the process stays at a few
    threads; SIGTERM then answers each with finish_reason abort."""
    proc, url = emulator
    port = int(url.rsplit(":", 1)[1])
    request = completion_request(100_000)
    clients = []
    try:
        for _ in range(QUEUED):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(request)
            clients.append(s)
        until(lambda: waiting(url) >= QUEUED - 2)  # 2 run, the rest queue as in vLLM
        assert threads_of(proc.pid) <= 10
        proc.send_signal(signal.SIGTERM)
        answers = [c.makefile("rb").read() for c in clients]
    finally:
        for c in clients:
            c.close()
    assert all(b'"finish_reason": "abort"' in a for a in answers)
    assert proc.wait(10) == 0


def test_a_client_that_goes_away_leaves_the_queue(emulator: tuple[subprocess.Popen[str], str]) -> None:
    """Clients whose requests wait give up and close: the requests are aborted (vLLM aborts a
    disconnected request), the queue empties and the two running ones go on."""
    _, url = emulator
    port = int(url.rsplit(":", 1)[1])
    clients = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(12)]
    try:
        for c in clients:
            c.sendall(completion_request(100_000))
        until(lambda: waiting(url) == 10)
        for c in clients[2:]:
            c.close()
        until(lambda: waiting(url) == 0)
        assert gauge(url, "vllm:num_requests_running") == 2
        assert gauge(url, "vllm:request_success_total", finished_reason="abort") == 10
    finally:
        for c in clients:
            c.close()
