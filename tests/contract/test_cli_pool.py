"""The admin commands against the real sandbox: status, tick, pin/unpin, lend/reclaim, explain.

Each test starts from a plain cluster (no jobs, nodes undrained, emulators up) and drives the
real `slurm-idle` command line with the sandbox's environment, as an admin or cron would.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox


@pytest.fixture()
def sb(sandbox: Any) -> Any:
    reset_cluster(sandbox, load_config(sandbox.config_path).paths.journal)
    return sandbox


def cli(sb: Any, *args: str) -> Any:
    return sb.run([sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True, text=True)


def cli_json(sb: Any, *args: str) -> Any:
    proc = cli(sb, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def phases(sb: Any) -> dict[str, str]:
    return {n["name"]: n["phase"] for n in cli_json(sb, "status")["nodes"]}


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 90) -> None:
    poll(cond, timeout_s, what, interval_s=1.0)


def test_status_json_shape_on_a_fresh_cluster(sb: Any) -> None:
    """`status --json` lists every pool node with the documented keys; unmanaged nodes are unknown."""
    doc = cli_json(sb, "status")
    assert [n["name"] for n in doc["nodes"]] == ["gpu1", "gpu2", "gpu3", "gpu4"]
    for node in doc["nodes"]:
        assert {"name", "phase", "slurm_state", "reason", "gpus_total", "gpus", "jobs"} <= node.keys()
        assert node["phase"] == "unknown" and node["gpus_total"] == 4
        # each GPU's memory, as the sandbox's GPU exporter reports it for every node (the
        # engine's weights where it runs: 70,000 MiB of the 81,559 of a fake H100)
        assert [g["index"] for g in node["gpus"]] == [0, 1, 2, 3], node["gpus"]
        assert {(g["total_mib"], g["holder"]) for g in node["gpus"]} == {(81559, None)}
        assert all(isinstance(g["used_mib"], int) for g in node["gpus"])
    assert doc["models"][0]["model"] == "sandbox-model"
    assert {"serving", "needed"} <= doc["models"][0].keys()


def test_tick_dry_run_changes_nothing(sb: Any) -> None:
    """`tick --dry-run --json` plans the adoption of every node but drains none."""
    doc = cli_json(sb, "tick", "--dry-run")
    assert doc["dry_run"] is True
    assert sorted(a["node"] for a in doc["actions"] if a["kind"] == "adopt") == ["gpu1", "gpu2", "gpu3", "gpu4"]
    assert doc["steps"] == []
    assert set(phases(sb).values()) == {"unknown"}


def test_tick_adopts_and_second_tick_is_locked_out(sb: Any) -> None:
    """A tick adopts every node into serving, printing each transition once (stdout, no log
    line repeating it on stderr); a tick started while another holds the lock exits 0 and
    prints nothing (cron mails only news), `-v` says why."""
    proc = cli(sb, "tick")
    assert proc.returncode == 0, proc.stderr
    assert set(phases(sb).values()) == {"serving"}
    lines = proc.stdout.splitlines()
    assert lines and all(ln.startswith("adopt gpu") for ln in lines), proc.stdout
    assert len(set(lines)) == len(lines) and " INFO " not in proc.stderr, proc.stderr
    lock = load_config(sb.config_path).paths.lock
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = cli(sb, "tick")
        verbose = cli(sb, "tick", "-v")
    finally:
        os.close(fd)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert verbose.returncode == 0 and "another tick is running" in verbose.stderr


def test_pin_lend_reclaim_explain(sb: Any) -> None:
    """pin blocks lend; unpin releases; lend and reclaim walk the full path; explain tells why."""
    assert cli(sb, "tick").returncode == 0
    assert cli(sb, "pin", "gpu1").returncode == 0
    node = next(n for n in cli_json(sb, "status")["nodes"] if n["name"] == "gpu1")
    assert node["reason"].startswith("slurm-idle:serving") and node["reason"].endswith("pinned")
    refused = cli(sb, "lend", "gpu1")
    assert refused.returncode == 3 and "pinned" in refused.stderr  # a safety rule refused it
    assert cli(sb, "unpin", "gpu1").returncode == 0
    doc = cli_json(sb, "lend", "gpu1")
    assert [s["to"] for s in doc["steps"]] == ["retiring", "lending", "lent"]
    assert phases(sb)["gpu1"] == "lent"
    with pytest.raises(OSError):  # the engine is stopped on a lent node: nothing answers
        urllib.request.urlopen(sb.emulator_url("gpu1") + "/health", timeout=2)
    doc = cli_json(sb, "reclaim", "gpu1")
    assert [s["to"] for s in doc["steps"]] == ["reclaiming", "starting", "serving"]
    assert phases(sb)["gpu1"] == "serving"
    doc = cli_json(sb, "explain", "gpu1")
    assert [t["to"] for t in doc["transitions"]][-6:] == [
        "retiring", "lending", "lent", "reclaiming", "starting", "serving"]
    assert all(t["reason"] for t in doc["transitions"])


def test_admin_node_refused_by_commands(sb: Any) -> None:
    """lend/reclaim/pin refuse a node an admin drained, and leave its Reason alone."""
    assert cli(sb, "tick").returncode == 0
    sb.run(["scontrol", "update", "nodename=gpu2", "state=DRAIN", "reason=admin: disk check"], check=True)
    for cmd in ("lend", "reclaim", "pin"):
        proc = cli(sb, cmd, "gpu2")
        assert proc.returncode == 3 and "admin" in proc.stderr, (cmd, proc.stderr)
    assert cli(sb, "tick").returncode == 0
    node = next(n for n in cli_json(sb, "status")["nodes"] if n["name"] == "gpu2")
    assert (node["phase"], node["reason"]) == ("admin", "admin: disk check")


@pytest.mark.slow
def test_needed_replicas_follow_the_load(sb: Any) -> None:
    """Through real Prometheus, the needed replica count rises with the load and falls back."""
    def needed() -> int:
        return int(cli_json(sb, "status")["models"][0]["needed"])

    sb.load(0.2)
    wait_for("needed == 1 at 0.2 req/s", lambda: needed() == 1)
    sb.load(10)  # 10 req/s x (100 + 0.1 x 200) tokens = 1200 tok/s: 3 replicas at 480 tok/s each
    wait_for("needed >= 3 at 10 req/s", lambda: needed() >= 3)
    sb.load(0.2)
    wait_for("needed back to 1", lambda: needed() == 1, timeout_s=120)
