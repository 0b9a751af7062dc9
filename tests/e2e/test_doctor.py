"""`slurm-idle doctor` on a sandbox: passes when healthy, fails naming what an admin broke.

It runs on a sandbox of its own, not the session's: Slurm lets an update take a node's GPUs
only to 0 when gres.conf names device files, and neither `scontrol reconfigure` nor a slurmd
restart gives the scheduler its GPUs back (CfgTRES keeps no gres/gpu), so the broken cluster
is thrown away afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def own_sandbox() -> Iterator[Any]:
    """A second sandbox for this module only, stopped (by pid) and removed at its end."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox starts Slurm/dockerd daemons and needs root")
    from slurm_idle.testing.sandbox import Sandbox

    root = Path(f"/tmp/slurm-idle-sandbox-doctor-{os.getpid()}")
    sb = Sandbox(root)
    try:
        sb.up()
        yield sb
    finally:
        result = sb.down()
        if not os.environ.get("SLURM_IDLE_KEEP_SANDBOX"):
            shutil.rmtree(root, ignore_errors=True)
        assert not result["left"] and not result["mounts_left"], result


def doctor(sb: Any) -> tuple[int, dict[str, dict[str, str]]]:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", "doctor", "--json"], timeout=120)
    assert proc.returncode in {0, 1}, proc.stderr
    return proc.returncode, {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


def failing(checks: dict[str, dict[str, str]]) -> dict[str, str]:
    return {name: c["detail"] for name, c in checks.items() if c["status"] == "fail"}


def test_doctor_healthy_then_misconfigured(own_sandbox: Any) -> None:
    """Healthy: exit 0, no failure. Idle PreemptMode=OFF: fails naming preemption. A pool
    node's gres emptied: fails naming that node."""
    sb = own_sandbox
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
    rc, checks = doctor(sb)
    assert rc == 1
    assert set(failing(checks)) == {"slurm.nodes"}
    assert "gpu2 has 0 GPU(s)" in failing(checks)["slurm.nodes"]
