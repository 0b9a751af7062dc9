"""`slurm-idle metrics scrape` against a local HTTP server serving captured-style vLLM pages."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest

PAGES = Path(__file__).resolve().parents[1] / "data" / "vllm"
KEYS = {"url", "model", "engine", "version", "engine_index", "running", "waiting", "kv_cache_usage", "sleeping",
        "generation_tokens_per_s", "prompt_tokens_per_s", "ttft_p95_s", "queue_time_p95_s"}


class Pages(http.server.BaseHTTPRequestHandler):
    """/<name>/metrics serves tests/data/vllm/<name>.txt; /seq/metrics serves recent then later."""

    hits: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        name = self.path.strip("/").split("/")[0]
        n = Pages.hits[name] = Pages.hits.get(name, 0) + 1
        if name == "seq":
            name = "v1_recent" if n == 1 else "v1_recent_10s_later"
        if name == "version":  # vLLM's GET /version
            body, ctype = b'{"version": "0.32.0"}', "application/json"
        elif name == "html":
            body, ctype = b"<html><body>vLLM API server</body></html>", "text/html"
        else:
            path = PAGES / f"{name}.txt"
            if not path.exists():
                self.send_error(404)
                return
            body, ctype = path.read_bytes(), "text/plain; version=0.0.4"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_idle.cli", "metrics", *args],
                          check=False, capture_output=True, text=True, timeout=60)


def test_scrape_json_has_the_documented_keys(server: str) -> None:
    """--json prints one entry per model/engine pair with exactly the issue's keys (and more)."""
    res = cli("scrape", f"{server}/v1_recent/metrics", "--json", "--interval", "0.1")
    assert res.returncode == 0, res.stderr
    [entry] = json.loads(res.stdout)["replicas"]
    assert KEYS <= set(entry)
    assert entry["model"] == "meta-llama/Llama-3.1-8B-Instruct" and entry["engine_index"] == "0"
    # The server: vLLM, its version read from GET /version beside the page.
    assert entry["engine"] == "vllm" and entry["version"] == "0.32.0"
    assert (entry["running"], entry["waiting"], entry["kv_cache_usage"]) == (7.0, 2.0, 0.4213)
    assert entry["sleeping"] is False
    assert entry["generation_tokens_per_s"] == 0.0  # same page twice: no tokens in between
    assert entry["ttft_p95_s"] is None  # and no requests


def test_scrape_rates_from_two_scrapes(server: str) -> None:
    """Two scrapes --interval apart turn counter growth into positive token rates and a p95."""
    res = cli("scrape", f"{server}/seq/metrics", "--json", "--interval", "0.5")
    assert res.returncode == 0, res.stderr
    [entry] = json.loads(res.stdout)["replicas"]
    assert entry["generation_tokens_per_s"] > 1000  # 11500 tokens in ~0.5 s
    assert entry["prompt_tokens_per_s"] > entry["generation_tokens_per_s"]
    assert entry["ttft_p95_s"] is not None and entry["ttft_p95_s"] > 0


def test_scrape_legacy_dp_and_sleeping_pages(server: str) -> None:
    """Legacy names, two DP engines and a slept engine all come out right."""
    legacy = json.loads(cli("scrape", f"{server}/v0_legacy/metrics", "--json", "--interval", "0").stdout)
    assert legacy["replicas"][0]["kv_cache_usage"] == 0.1875
    dp = json.loads(cli("scrape", f"{server}/v1_dp2/metrics", "--json", "--interval", "0").stdout)
    assert [e["engine_index"] for e in dp["replicas"]] == ["0", "1"]
    slept = json.loads(cli("scrape", f"{server}/v1_sleeping/metrics", "--json", "--interval", "0").stdout)
    assert slept["replicas"][0]["sleeping"] is True


def test_scrape_table_without_json(server: str) -> None:
    """Without --json the output is a readable table with a header line."""
    res = cli("scrape", f"{server}/v1_dp2/metrics", "--interval", "0")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["URL", "MODEL", "ENGINE"] and len(lines) == 3


def test_scrape_non_metrics_page_fails_clearly(server: str) -> None:
    """An HTML page gives one error line and a non-zero exit, no traceback."""
    res = cli("scrape", f"{server}/html/metrics", "--json")
    assert res.returncode != 0
    assert "not a vLLM metrics page" in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_scrape_closed_port_fails_clearly() -> None:
    """A port nobody listens on gives 'did not answer (connection refused)' and exit 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = cli("scrape", f"http://127.0.0.1:{port}", "--json")
    assert res.returncode == 1
    assert "did not answer (connection refused)" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_query_needs_prometheus(tmp_path: Path) -> None:
    """`metrics query` with Prometheus down says how to fix it in one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f'metrics: {{prometheus_url: "http://127.0.0.1:{port}"}}\n'
        'engine: {kind: command, start_command: "a", stop_command: "b"}\n'
        'models: [{name: m, nodes: "n1", url: "http://{node}:8000"}]\n'
    )
    res = subprocess.run([sys.executable, "-m", "slurm_idle.cli", "--config", str(cfg), "metrics", "query"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "cannot connect to Prometheus" in res.stderr and "metrics.prometheus_url" in res.stderr


def test_server_version_is_none_when_the_server_does_not_say() -> None:
    """No /version (an old vLLM: 404), a refused connection or a body without a version: None,
    and the scrape goes on without it."""
    from slurm_idle.httpdeadline import HttpResponse
    from slurm_idle.metrics.scrape import server_version

    asked: list[str] = []

    def answer(status: int, body: bytes) -> Callable[[str, float], HttpResponse]:
        def get(url: str, timeout_s: float) -> HttpResponse:
            asked.append(url)
            return HttpResponse(status, body)
        return get

    def refused(url: str, timeout_s: float) -> HttpResponse:
        raise ConnectionRefusedError(url)

    assert server_version("http://gpu1:8000/metrics", answer(200, b'{"version": "0.17.1"}')) == "0.17.1"
    assert asked == ["http://gpu1:8000/version"]
    assert server_version("gpu1:8000", answer(404, b"Not Found")) is None
    assert server_version("gpu1:8000", answer(200, b"{}")) is None
    assert server_version("gpu1:8000", refused) is None
