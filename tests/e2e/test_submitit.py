"""submitit as researchers use it, on the idle partition, through a reclaim, in both placements.

A real submitit (from the package index) submits a `Checkpointable` to `idle`. Node placement:
on a lent node, the admin's reclaim sends the job its own signal (submitit's `--signal=USR2@90`).
Jobs placement: on gpu8 beside a serving replica job, the load rises, the agent submits the
replica job again and Slurm preempts the idle job, sending its own signal at once (the
sandbox's slurm.conf has send_user_signal, as `doctor` asks of such a site; without it Slurm
sends SIGTERM, which submitit ignores, and the work since the start is lost). Either way
submitit checkpoints and requeues itself, the GPUs are lent again and the job returns its
result, no step done twice but the one the signal cut. `slurm-idle jobs` then lists it with a
preemption and no failure.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.testing import sandboxconf
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

submitit = pytest.importorskip("submitit")

pytestmark = pytest.mark.sandbox

STEPS, STEP_S = 40, 0.5
REPO = Path(__file__).resolve().parents[2]


def cli(sb: Any, *args: str) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args])
    assert proc.returncode == 0, (args, proc.stderr)
    return proc


def progress_lines(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    return [(int(a), int(b)) for a, b in (line.split() for line in path.read_text().splitlines())]


def point_submitit_at(sb: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """submitit runs sbatch/scontrol from this process: point them at the sandbox; the job
    imports the callable's module, as a researcher's job imports theirs."""
    for key, value in sb.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    from tests.e2e.submitit_work import Counter

    return Counter


def check_resumed(job: Any, progress: Path, sb: Any, *cli_args: str) -> None:
    """The result is whole, the second run started where the checkpoint was, and `jobs`
    lists one preemption, no failure."""
    assert "Caught signal SIGUSR2" in (job.stderr() or ""), "the reclaim sent not submitit's signal"
    result = job.result()  # raises if the job failed
    assert result["sum"] == STEPS * (STEPS + 1) // 2
    starts = result["starts"]
    assert len(starts) >= 2 and starts[0] == 0 and starts[1] >= 8, starts
    # Checkpoints are per step: at most the step the signal interrupted is done again.
    steps = [n for _run, n in progress_lines(progress)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and len(steps) <= STEPS + 1, steps

    def row() -> dict[str, Any]:
        rows = json.loads(cli(sb, *cli_args, "jobs", "--json", "--since", "now-1hour").stdout)
        return dict({r["job_id"]: r for r in rows["jobs"]}[int(job.job_id)])

    if sb.slurm_version.startswith("22."):
        # The result is written before the run ends: wait for Slurm's end of it.
        done = poll(lambda: (r := row())["state"] == "COMPLETED" and r, 120, "the job COMPLETED")
        assert done["runs"] == len(starts) and done["exit_code"] == 0, done
    else:
        # Measured on 24.11 (docs/slurm-releases.md): a job that requeued itself in its
        # preemption's GraceTime and then finished is recorded PREEMPTED, or started once more.
        done = row()
    assert done["preemptions"] >= 1 and done["failures"] == 0, done
    assert done["partition"] == "idle" and done["state"] not in {"FAILED", "CANCELLED"}, done


@pytest.mark.slow
def test_a_submitit_checkpointable_survives_a_reclaim(
    sandbox: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = sandbox
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    cli(sb, "tick")  # every pool node serving
    others = ["gpu2", "gpu3", "gpu4"]
    for node in others:
        cli(sb, "pin", node)
    closed = ",".join(getattr(sb, "all_nodes", sb.nodes)[len(sb.nodes):])
    if closed:  # the 8-GPU nodes are plain idle nodes: keep the job on gpu1
        sb.run(["scontrol", "update", f"nodename={closed}", "state=DRAIN",
                "reason=test_submitit: the job stays on gpu1"])
    counter = point_submitit_at(sb, monkeypatch)
    try:
        cli(sb, "lend", "gpu1")
        executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
        executor.update_parameters(slurm_partition="idle", timeout_min=30, cpus_per_task=1,
                                   slurm_additional_parameters={"requeue": True})
        progress = tmp_path / "progress.txt"
        job = executor.submit(counter(), STEPS, STEP_S, str(progress))
        poll(lambda: len(progress_lines(progress)) >= 8, 120, "the job to do 8 steps",
             interval_s=0.5)
        doc = json.loads(cli(sb, "reclaim", "gpu1", "--json").stdout)
        assert all(s["outcome"] == "ok" for s in doc["steps"]), doc
        cli(sb, "lend", "gpu1")
        poll(job.done, 240, f"submitit job {job.job_id} to finish", interval_s=1.0)
    finally:
        for node in others:
            sb.run([sys.executable, "-m", "slurm_idle.cli", "unpin", node])
        if closed:
            sb.run(["scontrol", "update", f"nodename={closed}", "state=RESUME"])
    check_resumed(job, progress, sb)


def tick_jobs(sb: Any) -> dict[str, str]:
    """One tick of the jobs-placement agent; the replicas' phases after it."""
    config = str(sb.layout.jobs_config_path)
    r = sb.run(["slurm-idle", "--config", config, "tick", "--json"], timeout=120)
    assert r.returncode in (0, 1), r.stderr
    r = sb.run(["slurm-idle", "--config", config, "status", "--json"])
    return {row["name"]: row["phase"] for row in json.loads(r.stdout)["replicas"]}


def tick_until(sb: Any, phases: list[str], timeout_s: float = 300) -> None:
    poll(lambda: sorted(tick_jobs(sb).values()) == sorted(phases), timeout_s,
         f"replica jobs {phases}", interval_s=1.0)


@pytest.mark.slow
def test_a_submitit_checkpointable_survives_slurms_preemption_in_jobs_placement(
    sandbox: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = sandbox
    counter = point_submitit_at(sb, monkeypatch)
    sb.load_jobs(20.0)
    sb.jobs_node(True)
    try:
        tick_until(sb, ["serving", "serving"])
        sb.load_jobs(0.5)
        tick_until(sb, ["lent", "serving"])  # 4 of gpu8's GPUs lent
        executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
        executor.update_parameters(
            slurm_partition="idle", timeout_min=30, cpus_per_task=1, slurm_gres="gpu:4",
            slurm_additional_parameters={"requeue": True, "nodelist": sandboxconf.JOBS_NODE})
        progress = tmp_path / "progress.txt"
        job = executor.submit(counter(), STEPS, STEP_S, str(progress))
        poll(lambda: len(progress_lines(progress)) >= 8, 120, "the job to do 8 steps",
             interval_s=0.5)
        sb.load_jobs(20.0)  # the replica job comes back: Slurm preempts the idle job
        tick_until(sb, ["serving", "serving"])
        sb.load_jobs(0.5)  # lent again: the requeued job resumes there
        tick_until(sb, ["lent", "serving"])
        poll(job.done, 240, f"submitit job {job.job_id} to finish", interval_s=1.0)
        # Before the cleanup below cancels what is left on gpu8 (on 24.11 the job may be
        # queued for a run more: see check_resumed).
        states = sb.run(["sacct", "-j", str(job.job_id), "-X", "-D", "-n", "-o", "State"]
                        ).stdout.split()
        assert {"PREEMPTED", "REQUEUED"} & set(states), states
        assert not {"FAILED", "CANCELLED"} & set(states), states
        check_resumed(job, progress, sb)
    finally:
        ids = sb.run(["squeue", "-h", "-w", sandboxconf.JOBS_NODE, "-o", "%A"]).stdout.split()
        ids += sb.run(["squeue", "-h", "-p", sandboxconf.JOBS_PARTITION, "-o", "%A"]).stdout.split()
        if ids:
            sb.run(["scancel", *sorted(set(ids))])
        sb.load_jobs(0.0)
        sb.jobs_node(False)
