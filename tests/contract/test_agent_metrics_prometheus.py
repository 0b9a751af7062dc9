"""Contract: a real Prometheus ingests the agent's textfile and evaluates the shipped alert rules.

The textfile is served the production way, by Debian's `prometheus-node-exporter` with only the
textfile collector on; where that package is missing, a tiny 127.0.0.1 HTTP server serves the
same file instead (the test id says which). Every daemon gets its own tmp dir and free port and
is stopped by pid. Also: `promtool check rules` and `systemd-analyze verify` on etc/.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.agent_metrics import write_textfile
from slurm_idle.model import Phase
from slurm_idle.testing import procs

ETC = Path(__file__).resolve().parents[2] / "etc"
RULES = ETC / "prometheus" / "slurm-idle-alerts.yml"
MODEL = "meta-llama/Llama-3.1-70B-Instruct"


def free_port() -> int:
    """A port for this test's own server, leased (ports.free_port): an ephemeral port found
    free could be taken by an outgoing connection before the server binds it."""
    from slurm_idle.testing import ports

    return ports.free_port()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=3) as r:
        return json.loads(r.read())


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    data = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    return list(data["data"]["result"])


def wait(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    pytest.fail(f"{what} not seen within {timeout_s:.0f} s (last: {last!r})")


class FileServer:
    """Serves one file as /metrics on 127.0.0.1 (stand-in for node_exporter's collector)."""

    def __init__(self, path: Path, port: int) -> None:
        served = path

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = served.read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_prometheus(tmp_path: Path, port: int, target_port: int, pids: list[int],
                     rules: str | None = None, metrics_path: str = "/metrics") -> str:
    """A Prometheus on 127.0.0.1:`port` scraping 127.0.0.1:`target_port` every second (job
    `agent`), its pid appended to `pids` (the caller stops it); its URL once it listens."""
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        + (f"rule_files: [{rules}]\n" if rules else "")
        + "scrape_configs:\n"
        "  - job_name: agent\n"
        f"    metrics_path: {metrics_path}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    pids.append(procs.spawn(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        tmp_path / "prometheus.log", {**os.environ, procs.MARKER: str(tmp_path)},
        procs.PidFile(tmp_path / "prom.pid")))
    procs.wait_for(lambda: procs.port_open(port), 30, "prometheus")
    return f"http://127.0.0.1:{port}"


# SLURM_IDLE_TEST_EXPORTER=http-server forces the fallback (to test it where node_exporter exists).
EXPORTERS = [
    os.environ.get("SLURM_IDLE_TEST_EXPORTER")
    or ("node_exporter" if shutil.which("prometheus-node-exporter") else "http-server")
]


@pytest.fixture(params=EXPORTERS)
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A textfile dir, an exporter serving it, and a Prometheus scraping it every second."""
    if not shutil.which("prometheus"):
        pytest.fail("prometheus is not installed (Debian package `prometheus`)")
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    prom_file = textdir / "slurm_idle.prom"
    exporter_port, prom_port = free_port(), free_port()
    pids: list[int] = []
    server: FileServer | None = None
    env = {**os.environ, procs.MARKER: str(tmp_path)}
    try:
        if request.param == "node_exporter":
            pids.append(procs.spawn(
                ["prometheus-node-exporter", "--collector.disable-defaults",
                 "--collector.textfile", f"--collector.textfile.directory={textdir}",
                 f"--web.listen-address=127.0.0.1:{exporter_port}"],
                tmp_path / "node_exporter.log", env, procs.PidFile(tmp_path / "ne.pid")))
            metrics_path = "/metrics"
        else:
            server = FileServer(prom_file, exporter_port)
            metrics_path = "/metrics"
        shutil.copy(RULES, tmp_path / "rules.yml")
        prom = start_prometheus(tmp_path, prom_port, exporter_port, pids, rules="rules.yml",
                                metrics_path=metrics_path)
        procs.wait_for(lambda: procs.port_open(exporter_port), 30, "exporter")
        yield {"prom": prom, "file": prom_file, "exporter": request.param}
    finally:
        if server is not None:
            server.stop()
        left = procs.terminate(pids)
        assert not left, f"had to SIGKILL {left}"


def test_prometheus_ingests_the_textfile(stack: dict[str, Any]) -> None:
    """Counters written by three separate ticks arrive in Prometheus with their labels."""
    now = time.time()
    for i, moved in enumerate(([("lent", "reclaiming")], [("lent", "reclaiming")], [])):
        write_textfile(
            stack["file"], phases={"serving": 3, "lent": 1}, needed={MODEL: 3},
            serving={MODEL: 3}, tick_duration_s=0.5, tick_ts=now + i, transitions=moved,
            tick_error=(i == 2), floors={MODEL: 1},
        )
    prom = stack["prom"]
    series = wait(lambda: query(prom, 'slurm_idle_transitions_total{from="lent",to="reclaiming"}'),
                  40, "slurm_idle_transitions_total in Prometheus")
    assert float(series[0]["value"][1]) == 2
    lent = query(prom, 'slurm_idle_nodes{phase="lent"}')
    assert float(lent[0]["value"][1]) == 1
    assert len(query(prom, "slurm_idle_nodes")) == len(Phase)  # every phase, zeros included
    needed = query(prom, "slurm_idle_needed_replicas")
    assert needed[0]["metric"]["model"] == MODEL and float(needed[0]["value"][1]) == 3
    assert float(query(prom, "slurm_idle_tick_errors_total")[0]["value"][1]) == 1
    assert float(query(prom, "slurm_idle_last_tick_timestamp_seconds")[0]["value"][1]) == \
        pytest.approx(now + 2)
    if stack["exporter"] == "node_exporter":
        # node_exporter flags a textfile it cannot parse with node_textfile_scrape_error 1.
        assert float(query(prom, "node_textfile_scrape_error")[0]["value"][1]) == 0


def test_alert_rules_load_and_fire_on_a_sick_agent(stack: dict[str, Any]) -> None:
    """A stale tick, a node stuck reclaiming, serving below floor/need, a node handed over for a
    held GPU and one for failed wakes raise their alerts."""
    from slurm_idle.handover import HeldEntry, WakeFailedEntry

    write_textfile(
        stack["file"], phases={"serving": 1, "reclaiming": 1, "lent": 2}, needed={MODEL: 3},
        serving={MODEL: 1}, tick_duration_s=0.5, tick_ts=time.time() - 1000, transitions=[],
        tick_error=False, floors={MODEL: 2},
        gpu_held=[HeldEntry("gpu2", 0, 20480, "job 123")],
        wake_failed=[WakeFailedEntry("gpu3", "gpu3", "POST /wake_up answered 500 CUDA error")],
    )
    prom = stack["prom"]
    shipped = {"SlurmIdleTickStale", "SlurmIdleReclaimTooSlow", "SlurmIdleServingBelowFloor",
               "SlurmIdleTickErrors", "SlurmIdleGpuHeld", "SlurmIdleWakeFailed",
               "SlurmIdleNoLeader"}

    def loaded() -> set[str] | None:
        # Prometheus answers on its port before it has read its rule files (and answers 503
        # until its TSDB is ready): under load the first reads see no rules yet.
        groups = get_json(f"{prom}/api/v1/rules")["data"]["groups"]
        names = {r["name"] for g in groups for r in g["rules"]}
        return names if shipped <= names else None

    wait(loaded, 40, f"rules {sorted(shipped)} loaded")
    expected = {"SlurmIdleTickStale", "SlurmIdleReclaimTooSlow", "SlurmIdleServingBelowFloor",
                "SlurmIdleServingBelowNeed", "SlurmIdleGpuHeld", "SlurmIdleWakeFailed"}

    def active() -> set[str] | None:
        alerts = get_json(f"{prom}/api/v1/alerts")["data"]["alerts"]
        names = {a["labels"]["alertname"] for a in alerts if a["state"] in {"pending", "firing"}}
        return names if expected <= names else None

    names = wait(active, 40, f"alerts {sorted(expected)}")
    assert "SlurmIdleNodesUnknown" not in names and "SlurmIdleMetricsMissing" not in names
    assert "SlurmIdleNoLeader" not in names  # no leadership series here: nothing to say
    groups = get_json(f"{prom}/api/v1/rules")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}  # evaluated by now
    assert all(r["health"] == "ok" for r in rules.values()), {n: r.get("lastError")
                                                              for n, r in rules.items()}


def test_promtool_accepts_the_alert_rules() -> None:
    """`promtool check rules etc/prometheus/slurm-idle-alerts.yml` succeeds."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (Debian package `prometheus`)")
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    """systemd accepts the service and timer with no unknown keys (ExecStart pointed at our CLI)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: tests/unit/test_etc_files.py checks structure")
    cli = shutil.which("slurm-idle") or "/bin/true"
    service = (ETC / "systemd" / "slurm-idle-tick.service").read_text()
    (tmp_path / "slurm-idle-tick.service").write_text(
        service.replace("/usr/local/bin/slurm-idle", cli))
    shutil.copy(ETC / "systemd" / "slurm-idle-tick.timer", tmp_path / "slurm-idle-tick.timer")
    r = subprocess.run(
        [analyze, "verify", str(tmp_path / "slurm-idle-tick.timer"),
         str(tmp_path / "slurm-idle-tick.service")],
        capture_output=True, text=True, check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "Unknown" not in r.stderr and "ignoring" not in r.stderr, r.stderr
