"""policy.min_job_runtime_s on the sandbox: a job started under the minimum run time is left
running while another lent node (with an older job) can be reclaimed.

gpu3/gpu4 are pinned serving; gpu1 and gpu2 are lent. gpu2 runs a job older than the minimum,
gpu1 one that just started (by work lost, the cheaper reclaim). Raising the model's floor to 3
makes the service need one node back: the tick reclaims gpu2 and leaves gpu1's job running.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

MIN_RUNTIME_S = 20


def cli(sb: Any, *args: str) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], timeout=180)
    assert proc.returncode == 0, (args, proc.stderr)
    return proc


def job_state(sb: Any, job_id: int) -> dict[str, str]:
    out = sb.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def submit_on(sb: Any, node: str) -> int:
    proc = sb.run(["sbatch", "--parsable", "-p", "idle", "--requeue", "-w", node, "--gres=gpu:4",
                   "-o", "/dev/null", "--wrap", "sleep 600"])
    assert proc.returncode == 0, proc.stderr
    job_id = int(proc.stdout.strip().split(";")[0])
    poll(lambda: job_state(sb, job_id).get("JobState") == "RUNNING", 60,
         f"job {job_id} to run on {node}", interval_s=0.5)
    return job_id


@pytest.mark.slow
def test_young_job_left_running_while_another_lent_node_is_reclaimed(sandbox: Any, tmp_path: Path) -> None:
    """Needing one node back reclaims the node of the older job, not the 2-second-old one."""
    sb = sandbox
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    cli(sb, "tick")  # adopt every node into serving
    for node in ("gpu3", "gpu4"):
        cli(sb, "pin", node)
    for node in ("gpu1", "gpu2"):
        cli(sb, "lend", node)
    old = submit_on(sb, "gpu2")
    time.sleep(MIN_RUNTIME_S + 2)
    young = submit_on(sb, "gpu1")

    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["models"][0]["min_serving_replicas"] = 3
    doc["policy"]["min_job_runtime_s"] = MIN_RUNTIME_S
    cfg = tmp_path / "slurm-idle.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    result = json.loads(cli(sb, "--config", str(cfg), "tick", "--json").stdout)

    reclaims = [a["node"] for a in result["actions"] if a["kind"] == "reclaim"]
    assert reclaims == ["gpu2"], result["actions"]
    assert job_state(sb, young)["JobState"] == "RUNNING"
    assert job_state(sb, young)["NodeList"] == "gpu1"
    assert job_state(sb, young)["Restarts"] == "0"
    assert int(job_state(sb, old)["Restarts"]) >= 1 or job_state(sb, old)["JobState"] == "PENDING"
    assert job_state(sb, old)["JobState"] != "RUNNING" or job_state(sb, old)["NodeList"] != "gpu2"
    status = json.loads(cli(sb, "--config", str(cfg), "status", "--json").stdout)
    phase = {n["name"]: n["phase"] for n in status["nodes"]}
    assert phase["gpu1"] == "lent" and phase["gpu2"] == "serving"
