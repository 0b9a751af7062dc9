"""A job of the serve partition on a lent node, on the real sandbox (issue 24, item 3).

The serve partition outranks the lend partition, so a job submitted there may take a lent node
and, ignoring SIGTERM, would hold that node's reclaim up for as long as it runs. The shipped
slurm.conf (etc/slurm.conf.snippet, which the sandbox runs) closes the partition to users
(AllowGroups=root): the unprivileged `sidle-ci` is refused by Slurm. Root still may, and a
reclaim then signals its job, waits slurm.requeue_grace_s, cancels it (journaled as
`foreign_job`), and the node serves again within the grace plus one tick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

USER = "sidle-ci"  # an unprivileged user (test_rootless_job makes the same one)
NODE = "gpu1"


def cli(sb: Any, *args: str) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True, text=True,
                  timeout=180)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def running_on(sb: Any, node: str, partition: str) -> list[int]:
    out = sb.run(["squeue", "-h", "-t", "RUNNING", "-p", partition, "-w", node, "-o", "%i"]).stdout
    return [int(x) for x in out.split()]


@pytest.mark.slow
def test_a_foreign_job_on_a_lent_node_is_cancelled_within_the_grace(sandbox: Any) -> None:
    """Root's `srun -p inference -w gpu1 bash -c "trap '' TERM; sleep 290"` on lent gpu1:
    `slurm-idle reclaim gpu1` signals it, cancels it after the grace, and gpu1 serves again
    within requeue_grace_s + one tick; the journal has the job as foreign_job."""
    sb = sandbox
    cfg = load_config(sb.config_path)
    reset_cluster(sb, cfg.paths.journal)
    cli(sb, "tick")  # adopt every node into serving
    cli(sb, "lend", NODE)
    srun = subprocess.Popen(
        ["srun", "-p", cfg.slurm.serve_partition, "-w", NODE, "-N1", "-n1", "bash", "-c",
         "trap '' TERM; sleep 290"],
        env={**os.environ, **sb.env()},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        poll(lambda: bool(running_on(sb, NODE, cfg.slurm.serve_partition)), 60,
             "the inference job to run on the lent node", interval_s=1.0)
        [job_id] = running_on(sb, NODE, cfg.slurm.serve_partition)
        started = time.monotonic()
        doc = json.loads(cli(sb, "reclaim", NODE, "--json").stdout)
        took = time.monotonic() - started
        assert [s["to"] for s in doc["steps"]] == ["reclaiming", "starting", "serving"], doc
        assert all(s["outcome"] == "ok" for s in doc["steps"]), doc
        budget = cfg.slurm.requeue_grace_s + cfg.timeouts.tick_budget_s
        assert took <= budget, f"reclaim took {took:.1f} s > grace + a tick ({budget:g} s)"
        assert took >= cfg.slurm.requeue_grace_s  # it was given its grace first
        print(f"MEASURE foreign job reclaim: {took:.1f} s (grace {cfg.slurm.requeue_grace_s:g} s)")
        assert job_id not in running_on(sb, NODE, cfg.slurm.serve_partition)
        srun.wait(timeout=60)  # Slurm ended the job: srun returns
        records = [json.loads(line) for line in Path(cfg.paths.journal).read_text().splitlines()]
        foreign = [r for r in records if r.get("event") == "foreign_job" and r["job_id"] == job_id]
        assert [r["action"] for r in foreign][:2] == ["signalled", "cancelled"], foreign
        assert foreign[0]["partition"] == cfg.slurm.serve_partition and foreign[0]["node"] == NODE
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait(timeout=30)
        sb.run(["scancel", "-p", cfg.slurm.serve_partition])


def test_an_unprivileged_user_is_refused_the_serve_partition(sandbox: Any) -> None:
    """`sidle-ci` may not use the serve partition (AllowGroups=root, as shipped): Slurm 22.05
    refuses the job at submission; 24.11 checks AllowGroups at submission only under
    EnforcePartLimits (partition_mgr.c validate_group) and otherwise accepts the job and never
    starts it ("uid N not in group permitted to use this partition", node_scheduler.c). Either
    way it can never take a lent node."""
    from slurm_idle.testing.users import ensure_user

    ensure_user(USER)
    part = load_config(sandbox.config_path).slurm.serve_partition
    env = [f"{k}={v}" for k, v in sandbox.env().items()]
    proc = subprocess.run(
        ["runuser", "-u", USER, "--", "env", *env, "sbatch", "-p", part, "-w", NODE,
         "--parsable", "--wrap", "sleep 290"],
        capture_output=True, text=True, timeout=60, check=False, cwd="/tmp")
    if proc.returncode == 0:  # accepted (24.11): it must stay pending, never run
        job_id = proc.stdout.strip().split(";")[0]
        def refused() -> str | None:
            out = sandbox.run(["scontrol", "show", "job", job_id]).stdout
            assert "JobState=RUNNING" not in out, out
            # scontrol writes the reason with underscores for spaces
            text = out.replace("_", " ")
            return out if "not in group permitted to use this partition" in text else None

        try:
            out = poll(refused, 60, f"job {job_id} of {USER} held for its partition")
            assert "JobState=PENDING" in out, out
        finally:
            sandbox.run(["scancel", job_id])
    else:
        assert "not permitted" in proc.stderr or "denied" in proc.stderr.lower(), proc.stderr
    lend = load_config(sandbox.config_path).slurm.lend_partition
    test_only = subprocess.run(
        ["runuser", "-u", USER, "--", "env", *env, "sbatch", "--test-only", "-p", lend,
         "--wrap", "true"], capture_output=True, text=True, timeout=60, check=False, cwd="/tmp")
    assert test_only.returncode == 0, test_only.stderr  # the lend partition stays open


def test_doctor_fails_while_the_serve_partition_is_open_to_every_user(sandbox: Any) -> None:
    """As shipped the serve partition is closed (slurm.serve_access ok); opened by an admin
    (`scontrol update ... allowgroups=ALL`), doctor fails naming it and the fix."""
    part = load_config(sandbox.config_path).slurm.serve_partition

    def serve_access() -> dict[str, str]:
        proc = sandbox.run([sys.executable, "-m", "slurm_idle.cli", "doctor", "--json"], timeout=180)
        assert proc.returncode in {0, 1}, proc.stderr
        return next(c for c in json.loads(proc.stdout)["checks"] if c["name"] == "slurm.serve_access")

    assert serve_access()["status"] == "ok"
    opened = sandbox.run(["scontrol", "update", f"partitionname={part}", "allowgroups=ALL"])
    assert opened.returncode == 0, opened.stderr
    try:
        check = serve_access()
        assert check["status"] == "fail" and f"{part} open to every user" in check["detail"]
        assert "AllowGroups=root" in check["detail"]
    finally:
        sandbox.run(["scontrol", "update", f"partitionname={part}", "allowgroups=root"])
