"""Every HTTP call has a total deadline (issue 11: 9), checked against a real server on loopback
that trickles its answer one byte every 2 s: a per-read timeout never fires on it (measured
before: 81 s for `metrics scrape --timeout 5`). Engine, scrape and warm-up calls go through the
one client (httpdeadline): no proxy whatever the environment says, bodies cut at a ceiling."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from slurm_idle import httpdeadline
from slurm_idle.config import parse_config
from slurm_idle.engine import CommandEngine, EngineConfig, HttpTimeout, UrllibClient
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.metrics.prometheus import PrometheusSource
from slurm_idle.metrics.scrape import urllib_get
from slurm_idle.router.sync import urllib_post


class Trickle(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b'{"status": "success", "data": {"resultType": "vector", "result": []}}' * 4
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(2)
        except OSError:
            pass  # the client gave up: what we want


@pytest.fixture(scope="module")
def trickle() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class Echo(BaseHTTPRequestHandler):
    """Answers at once: POST records what it got; GET /big sends 64 KiB."""

    seen: ClassVar[list[tuple[str, bytes, str]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(b"x" * 65536 if self.path == "/big" else b"ok")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        Echo.seen.append((self.path, body, self.headers.get("Content-Type", "")))
        self._answer(b'{"choices": []}')


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_engine_scrape_and_warm_up_calls_ignore_proxies_and_bound_bodies(
    echo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With http_proxy pointing at nothing, every call still reaches the replica directly (the
    router's warm-up POST with its JSON body too), and a body past the ceiling is cut there."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # discard: nothing listens
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert urllib_post(f"{echo}/v1/completions", b'{"max_tokens": 1}', 5.0) == 200
    assert Echo.seen[-1] == ("/v1/completions", b'{"max_tokens": 1}', "application/json")
    assert urllib_get(f"{echo}/metrics", 5.0).status == 200
    assert UrllibClient().request("GET", f"{echo}/health", 5.0).body == b"ok"
    assert len(httpdeadline.DeadlineClient(max_bytes=1000).request("GET", f"{echo}/big", 5.0).body) == 1000


def test_a_trickled_page_ends_at_the_total_deadline(trickle: str) -> None:
    """The scrape client gives up at its timeout, not after the whole trickle."""
    start = time.monotonic()
    with pytest.raises(httpdeadline.DeadlineExceeded):
        urllib_get(f"{trickle}/metrics", 1.5)
    assert time.monotonic() - start < 3.0


def test_engine_probes_end_at_the_total_deadline(trickle: str) -> None:
    """The engine's HTTP client too (/health, /v1/models, /metrics of a replica)."""
    start = time.monotonic()
    with pytest.raises(HttpTimeout):
        UrllibClient().request("GET", f"{trickle}/health", 1.0)
    engine = CommandEngine(EngineConfig(kind="command", start_command="s", stop_command="t",
                                        http_timeout_s=1.0), "m")
    from slurm_idle.config import ReplicaConfig

    assert engine.health(ReplicaConfig(node="gpu1", url=trickle)).up is False
    assert time.monotonic() - start < 5.0


def test_a_trickling_prometheus_ends_within_the_callers_budget(trickle: str) -> None:
    """A Prometheus that trickles: each query ends within query_timeout_s and the caller's
    budget, as MetricsUnavailable (then the scrape fallback takes over)."""
    cfg = parse_config(f"""
engine: {{kind: command, start_command: s, stop_command: t}}
metrics: {{prometheus_url: "{trickle}", query_timeout_s: 30}}
models: [{{name: m, nodes: "gpu1", url: "http://127.0.0.1:1"}}]
""")
    src = PrometheusSource(cfg)
    start = time.monotonic()
    with pytest.raises(MetricsUnavailable, match="total deadline|observe budget"):
        src.replica_loads([("m", cfg.models[0].replicas[0])], budget_s=2.0)
    assert time.monotonic() - start < 4.0


def test_metrics_scrape_cli_honours_its_timeout(trickle: str) -> None:
    """`slurm-idle metrics scrape URL --timeout 2` fails in about 2 s with one line (exit 1)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slurm_idle.cli", "metrics", "scrape",
                           f"{trickle}/metrics", "--timeout", "2", "--interval", "0"],
                          capture_output=True, text=True, timeout=60, check=False)
    took = time.monotonic() - start
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert took < 10, took  # interpreter start-up included; 80 s before
