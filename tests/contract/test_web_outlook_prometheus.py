"""The web view's outlook reads its history from a real Prometheus: with the history there,
no hour of the next seven is "unknown", whatever the minute of the hour.

`vector(time())` stands for the demand: Prometheus evaluates it at any moment without stored
samples, so the history is complete a day and a week back and only the subquery's shape (which
hours its points fall on) can leave an hour out.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import parse_config
from slurm_idle.testing import ports, procs
from slurm_idle.web.data import LiveData
from slurm_idle.web.outlook import outlook

CONFIG = """
engine: {kind: command, start_command: "true", stop_command: "true"}
models: [{name: m, nodes: "gpu[1-2]", tokens_per_s_per_replica: 1000}]
"""


def ready(url: str) -> bool:
    """Prometheus answers 503 to queries until its TSDB is open: wait for /-/ready, not the port
    (seen in the 24.11 lane: a query right after the port opened got 503s)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus on loopback that scrapes nothing, ready for queries: its URL."""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    if not shutil.which("prometheus"):
        pytest.fail("prometheus is not installed (Debian package `prometheus`)")
    (tmp_path / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n")
    port = ports.free_port()
    pids = [procs.spawn(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        tmp_path / "prometheus.log", {**os.environ, procs.MARKER: str(tmp_path)},
        procs.PidFile(tmp_path / "prom.pid"))]
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_for(lambda: ready(url), 60, "prometheus ready")
        yield url
    finally:
        assert not procs.terminate(pids), "had to SIGKILL prometheus"


@pytest.mark.parametrize("minute", [0, 10, 29, 31, 50])
def test_every_outlook_hour_is_known_when_prometheus_has_the_history(
    prometheus: str, minute: int
) -> None:
    """At :00, :10, :29, :31 and :50 past an hour, all 7 hours (now .. now + 6 h) are known."""
    from slurm_idle.metrics.prometheus import connect

    class Demand:
        def demand(self) -> str:
            return "vector(time())"

    class Live(LiveData):
        def _prom(self, cfg: Any) -> Any:
            return connect(prometheus, 10.0), Demand()

    cfg = parse_config(CONFIG)
    now = math.floor(time.time() / 3600) * 3600 - 3 * 3600 + minute * 60
    history, cause = Live(cfg, state_root=Path("/nonexistent"))._demand_history(cfg, now)
    assert cause is None
    rows = outlook(cfg, now, lambda t: history.get(round(t / 3600)))
    assert [r["lendable_gpus"] is not None for r in rows] == [True] * 7, sorted(history)
