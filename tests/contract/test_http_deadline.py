"""Every HTTP call has a total deadline (issue 11: 9), checked against a real server on loopback
that trickles its answer one byte every 2 s: a per-read timeout never fires on it (measured
before: 81 s for `metrics scrape --timeout 5`)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slurm_idle import httpdeadline
from slurm_idle.config import parse_config
from slurm_idle.engine import CommandEngine, EngineConfig, HttpTimeout, UrllibClient
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.metrics.prometheus import PrometheusSource
from slurm_idle.metrics.scrape import urllib_get


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
