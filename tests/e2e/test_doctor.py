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
    """Healthy: exit 0, no failure, GPU memory series for every pool node. One node's GPU
    exporter silent: fails naming that node in `gpus`. Idle PreemptMode=OFF: fails naming
    preemption. A pool node's gres emptied: fails naming that node."""
    from slurm_idle.testing import gpu_exporter
    from slurm_idle.testing.waiting import poll

    sb = own_sandbox
    assert sb.run([sys.executable, "-m", "slurm_idle.cli", "tick"], timeout=120).returncode == 0

    # A brand-new sandbox: Prometheus needs two scrapes of a replica inside the rate window
    # before its series count as fresh, so "healthy" is a state reached, not the first
    # second's (issue 36: on 24.11 doctor ran before that and named gpu1, gpu3). Wait for it.
    metrics: dict[str, str] = {}

    def fresh() -> bool:
        metrics.update(doctor(sb)[1]["metrics"])
        return metrics["status"] == "ok"

    try:
        poll(fresh, 120, "fresh series for every serving replica", interval_s=2.0)
    except AssertionError:
        pytest.fail(f"doctor's metrics check never passed within 120 s: {metrics}")
    rc, checks = doctor(sb)
    assert rc == 0, failing(checks)
    assert failing(checks) == {}
    assert {"slurm.preemption", "slurm.job_submit", "slurm.nodes", "metrics", "gpus", "engine",
            "paths"} <= set(checks)
    assert checks["gpus"]["status"] == "ok" and "all 4 node(s)" in checks["gpus"]["detail"]

    # gpu3's exporter answers nothing (fakegpu's exporter-off file): its series go stale.
    off = sb.layout.node_dev("gpu3") / gpu_exporter.OFF_FILE
    off.touch()
    try:
        def missed() -> dict[str, dict[str, str]] | None:
            checks = doctor(sb)[1]
            return checks if "gpus" in failing(checks) else None

        silent = poll(missed, 60, "doctor to miss gpu3's GPU series", interval_s=1.0)
        assert set(failing(silent)) == {"gpus"}, failing(silent)
        assert "for node(s) gpu3:" in failing(silent)["gpus"], failing(silent)
    finally:
        off.unlink()
    poll(lambda: doctor(sb)[1]["gpus"]["status"] == "ok", 60, "gpu3's GPU series back",
         interval_s=1.0)

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


def test_a_stopped_engine_is_named_by_status_and_doctor(own_sandbox: Any) -> None:
    """One serving replica's engine stopped: `status` shows it unhealthy with its /health URL
    and an `attention:` line (text and --json); `doctor`'s engine check fails naming that URL,
    and the metrics check does not blame the scrape config. No tick runs between the stop and
    the looking (this sandbox runs no agent): a tick would repair the replica (restart its
    engine, action `repair`) and there would be nothing left to see. The engine is started
    again at the end."""
    from slurm_idle.testing.waiting import poll

    sb = own_sandbox

    def cli(*args: str) -> Any:
        return sb.run([sys.executable, "-m", "slurm_idle.cli", *args], timeout=180)

    assert cli("tick").returncode == 0  # adopts the pool (or carries on the test before's)
    # gpu3 (a whole-node replica, its emulator stopped by node name; not gpu2, whose GPUs the
    # test before took away) kept serving whatever a tick decides: pinned, then ticks until it
    # serves. Unpinned, a tick may lend it, and on a loaded machine the adopting tick can end
    # with its engine still starting (CI once found no serving whole-node replica here).
    name = "gpu3"
    assert cli("pin", name).returncode == 0

    def replica() -> dict[str, Any]:
        rows = json.loads(cli("status", "--json").stdout)["replicas"]
        return next(r for r in rows if r["name"] == name)

    def pinned_serving() -> bool:
        assert cli("tick").returncode in (0, 1)
        return bool(replica()["phase"] == "serving")

    poll(pinned_serving, 300, f"{name} pinned and serving", interval_s=2.0)
    # Every serving replica's series fresh first (at once after the test above; alone, on a
    # brand-new sandbox, Prometheus needs a few scrapes), so that a stale series below can only
    # be the stopped engine's.
    metrics: dict[str, str] = {}

    def fresh() -> bool:
        metrics.update(doctor(sb)[1]["metrics"])
        return metrics["status"] == "ok"

    try:
        poll(fresh, 120, "fresh series for every serving replica", interval_s=2.0)
    except AssertionError:
        pytest.fail(f"doctor's metrics check never passed within 120 s: {metrics}")
    row = replica()
    assert row["phase"] == "serving" and row["placement"] == "nodes" and row["nodes"] == [name], row
    url = row["url"].rstrip("/")
    assert sb.engine_stop(name)
    try:
        text = cli("status").stdout
        assert f"{name} serving (unhealthy: engine not answering GET {url}/health" in text, text
        assert f"attention: {name} engine not answering /health" in text, text
        doc = json.loads(cli("status", "--json").stdout)
        mine = next(r for r in doc["replicas"] if r["name"] == name)
        assert mine["phase"] == "serving" and mine["healthy"] is False, mine
        assert f"GET {url}/health" in mine["health_reason"], mine
        assert f"{name} engine not answering /health" in doc["attention"], doc["attention"]
        rc, checks = doctor(sb)
        assert rc == 1
        assert checks["engine"]["status"] == "fail"
        assert f"{name}: engine not answering GET {url}/health" in checks["engine"]["detail"]
        assert "scrape config" not in checks["metrics"]["detail"], checks["metrics"]
    finally:
        sb.engine_start(name)
        poll(lambda: sb.status()["emulators"][name]["healthy"], 60, f"{name} healthy again")
        cli("unpin", name)


@pytest.mark.slow
def test_power_saving_on_real_slurm(own_sandbox: Any, tmp_path: Path) -> None:
    """Slurm 22.05 powers a lent node down: it stays `lent`; status and doctor name the serving
    nodes power saving may suspend; reclaim drains it, asks POWER_UP and, the fake node never
    booting, leaves it `reclaiming` at the tick's deadline (not an admin's, not started)."""
    import yaml

    from slurm_idle.testing.waiting import poll

    sb = own_sandbox

    def cli(*args: str) -> Any:
        return sb.run([sys.executable, "-m", "slurm_idle.cli", *args], timeout=180)

    assert cli("tick").returncode == 0
    for node in ("gpu2", "gpu3", "gpu4"):
        assert cli("pin", node).returncode == 0
    phases = {n["name"]: n["phase"] for n in json.loads(cli("status", "--json").stdout)["nodes"]}
    if phases["gpu1"] != "lent":  # the tick may have lent it already
        assert cli("lend", "gpu1").returncode == 0
    conf = Path(sb.slurm_conf)
    conf.write_text(conf.read_text() + "SuspendProgram=/bin/true\nResumeProgram=/bin/true\n"
                    "SuspendTime=3600\nSuspendTimeout=5\nResumeTimeout=600\n")
    sb.run(["scontrol", "reconfigure"], check=True)
    sb.run(["scontrol", "update", "nodename=gpu1", "state=power_down"], check=True)

    def flags() -> str:
        return sb.run(["scontrol", "show", "node", "gpu1"]).stdout.split("State=", 1)[1].split()[0]

    poll(lambda: "POWERED_DOWN" in flags(), 60, "gpu1 to power down", interval_s=0.5)
    status = json.loads(cli("status", "--json").stdout)
    assert {n["name"]: n["phase"] for n in status["nodes"]}["gpu1"] == "lent"
    assert any("may suspend serving node(s) gpu2, gpu3, gpu4" in e for e in status["errors"])
    _, checks = doctor(sb)
    assert checks["slurm.power_save"]["status"] == "fail"
    assert "gpu1, gpu2, gpu3, gpu4" in checks["slurm.power_save"]["detail"]

    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["timeouts"]["tick_budget_s"] = 8
    short = tmp_path / "slurm-idle.yaml"
    short.write_text(yaml.safe_dump(doc))
    proc = cli("--config", str(short), "reclaim", "gpu1", "--json")
    steps = json.loads(proc.stdout)["steps"]
    assert [(s["to"], s["outcome"]) for s in steps] == [("reclaiming", "ok"), ("starting", "waiting")]
    assert "powering up" in steps[-1]["detail"]
    assert "POWER_UP" in flags() or "POWERING_UP" in flags()
    assert {n["name"]: n["phase"] for n in json.loads(cli("status", "--json").stdout)["nodes"]}["gpu1"] \
        == "reclaiming"
