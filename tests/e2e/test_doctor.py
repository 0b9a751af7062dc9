"""`slurm-idle doctor` on the sandbox: passes when healthy, fails naming what an admin broke.

Every change is undone before the test ends (`scontrol update` back, `scontrol reconfigure`
reloads the gres from slurm.conf), so the session's other tests see the usual cluster.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox


def doctor(sb: Any) -> tuple[int, dict[str, dict[str, str]]]:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", "doctor", "--json"], timeout=120)
    assert proc.returncode in {0, 1}, proc.stderr
    return proc.returncode, {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


def failing(checks: dict[str, dict[str, str]]) -> dict[str, str]:
    return {name: c["detail"] for name, c in checks.items() if c["status"] == "fail"}


def test_doctor_healthy_then_misconfigured(sandbox: Any) -> None:
    """Healthy: exit 0, no failure. Idle PreemptMode=OFF: fails naming preemption. A pool
    node's gres emptied: fails naming that node."""
    sb = sandbox
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    assert sb.run([sys.executable, "-m", "slurm_idle.cli", "tick"], timeout=120).returncode == 0

    rc, checks = doctor(sb)
    assert rc == 0, failing(checks)
    assert failing(checks) == {}
    assert {"slurm.preemption", "slurm.job_submit", "slurm.nodes", "metrics", "engine",
            "paths"} <= set(checks)

    sb.run(["scontrol", "update", "partitionname=idle", "preemptmode=off"], check=True)
    try:
        rc, checks = doctor(sb)
        assert rc == 1
        assert "slurm.preemption" in failing(checks)
        assert "PreemptMode=OFF" in failing(checks)["slurm.preemption"]
    finally:
        sb.run(["scontrol", "update", "partitionname=idle", "preemptmode=requeue"], check=True)

    # With File= in gres.conf Slurm only lets an update take a node's GPUs to 0.
    sb.run(["scontrol", "update", "nodename=gpu2", "gres=gpu:0"], check=True)
    try:
        rc, checks = doctor(sb)
        assert rc == 1
        assert set(failing(checks)) == {"slurm.nodes"}
        assert "gpu2 has 0 GPU(s)" in failing(checks)["slurm.nodes"]
    finally:
        sb.run(["scontrol", "reconfigure"], check=True)

        def gres_back() -> bool:
            out = sb.run(["scontrol", "show", "node", "gpu2"]).stdout
            return "Gres=gpu:4" in out

        poll(gres_back, 30, "gpu2's gres to come back after reconfigure", interval_s=0.5)
    rc, checks = doctor(sb)
    assert rc == 0, failing(checks)
