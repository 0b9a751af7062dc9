"""Lend groups against the real sandbox: a replica spanning gpu3 and gpu4 (its head, and its
emulator, on gpu3) is lent and reclaimed as one unit by the real CLI and Slurm; a job on both
nodes runs while they are lent and is requeued, never failed or cancelled, at reclaim."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox


@pytest.fixture()
def spanning(sandbox: Any, tmp_path: Path) -> tuple[Any, Path]:
    """The sandbox's config with gpu[3-4] as one 8-GPU replica (url: gpu3's emulator)."""
    doc = yaml.safe_load(Path(sandbox.config_path).read_text())
    model = doc["models"][0]
    model["gpus_per_replica"] = 4
    model["replicas"] = [
        {"node": "gpu1", "url": sandbox.emulator_url("gpu1")},
        {"node": "gpu2", "url": sandbox.emulator_url("gpu2")},
        {"nodes": "gpu[3-4]", "url": sandbox.emulator_url("gpu3")},
    ]
    doc["paths"] = {"journal": str(tmp_path / "journal.jsonl"), "lock": str(tmp_path / "lock")}
    path = tmp_path / "spanning.yaml"
    path.write_text(yaml.safe_dump(doc))
    reset_cluster(sandbox)
    # gpu4 is no replica's head here: its own emulator would hold its GPUs while the group is
    # lent (the lend measures what is left on them and would refuse it).
    sandbox.engine_stop("gpu4")
    return sandbox, path


def cli(sb: Any, config: Path, *args: str) -> Any:
    return sb.run([sys.executable, "-m", "slurm_idle.cli", "--config", str(config), *args],
                  timeout=240)


def cli_json(sb: Any, config: Path, *args: str) -> Any:
    proc = cli(sb, config, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def job_state(sb: Any, job: str) -> str:
    out = sb.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
    return out or sb.run(["sacct", "-n", "-X", "-j", job, "-o", "State"]).stdout.strip()


def test_a_spanning_replica_is_lent_and_reclaimed_with_both_nodes(spanning: tuple[Any, Path]) -> None:
    """lend gpu4 lends gpu3 and gpu4 (one group); a 2-node job runs there; reclaim gpu3 drains
    both, requeues the job and serves again; status shows the replica and group throughout."""
    sb, config = spanning
    assert cli(sb, config, "tick").returncode == 0  # adopt the pool: everything serving
    doc = cli_json(sb, config, "status")
    assert doc["groups"][-1] == {"nodes": ["gpu3", "gpu4"], "phase": "serving",
                                 "replicas": ["gpu3"], "gpus": 8}
    assert doc["replicas"][-1]["nodes"] == ["gpu3", "gpu4"]

    lent = cli_json(sb, config, "lend", "gpu4")
    assert lent["action"]["node"] == "gpu3"
    assert [s["to"] for s in lent["steps"]] == ["retiring", "lending", "lent"]
    doc = cli_json(sb, config, "status")
    assert {n["name"]: n["phase"] for n in doc["nodes"]}["gpu4"] == "lent"
    assert {n["name"]: n["phase"] for n in doc["nodes"]}["gpu3"] == "lent"
    assert doc["replicas"][-1]["phase"] == "lent"

    sub = sb.run(["sbatch", "--parsable", "-p", "idle", "-N", "2", "-w", "gpu[3-4]", "--requeue",
                  "-o", "/dev/null", "--wrap", "sleep 600"], check=True)
    job = sub.stdout.strip().split(";")[0]
    poll(lambda: job_state(sb, job) == "RUNNING", 60, f"job {job} running on gpu[3-4]")

    back = cli_json(sb, config, "reclaim", "gpu3")
    assert [s["to"] for s in back["steps"]] == ["reclaiming", "starting", "serving"], back
    assert all(s["nodes"] == ["gpu3", "gpu4"] for s in back["steps"])
    # No tick from here: at zero load the planner would (rightly) lend the group again.
    doc = cli_json(sb, config, "status")
    phases = {n["name"]: n["phase"] for n in doc["nodes"]}
    assert phases["gpu3"] == phases["gpu4"] == "serving"
    assert doc["replicas"][-1]["phase"] == "serving"
    poll(lambda: cli_json(sb, config, "status")["replicas"][-1]["healthy"] is True, 60,
         "the spanning replica healthy in status (fresh metrics after its start)", interval_s=2.0)
    time.sleep(1)
    state = job_state(sb, job)
    assert state not in ("FAILED", "CANCELLED", "COMPLETED"), state
    assert "PENDING" in state or "REQUEUED" in state, state
    sb.run(["scancel", job])
