"""submitit as researchers use it, on the idle partition, through a reclaim (node placement).

A real submitit (from the package index) submits a `Checkpointable` to `idle` on a lent node;
the admin's reclaim sends the job its own signal (submitit's `--signal=USR2@90`), submitit
checkpoints and requeues itself, the node is lent again and the job returns its result, each
step done once. `slurm-idle jobs` then lists it with one preemption and no failure.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
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
    # submitit runs sbatch/scontrol from this process: point them at the sandbox; the job
    # imports the callable's module, as a researcher's job imports theirs.
    for key, value in sb.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    from tests.e2e.submitit_work import Counter

    try:
        cli(sb, "lend", "gpu1")
        executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
        executor.update_parameters(slurm_partition="idle", timeout_min=30, cpus_per_task=1,
                                   slurm_additional_parameters={"requeue": True})
        progress = tmp_path / "progress.txt"
        job = executor.submit(Counter(), STEPS, STEP_S, str(progress))
        poll(lambda: len(progress_lines(progress)) >= 8, 120, "the job to do 8 steps",
             interval_s=0.5)
        doc = json.loads(cli(sb, "reclaim", "gpu1", "--json").stdout)
        assert all(s["outcome"] == "ok" for s in doc["steps"]), doc
        cli(sb, "lend", "gpu1")
        poll(job.done, 240, f"submitit job {job.job_id} to finish", interval_s=1.0)
        result = job.result()  # raises if the job failed
    finally:
        for node in others:
            sb.run([sys.executable, "-m", "slurm_idle.cli", "unpin", node])
        if closed:
            sb.run(["scontrol", "update", f"nodename={closed}", "state=RESUME"])
    assert "Caught signal SIGUSR2" in (job.stderr() or ""), "the reclaim sent not submitit's signal"
    assert result["sum"] == STEPS * (STEPS + 1) // 2
    starts = result["starts"]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 8, starts
    # Checkpoints are per step: at most the step the signal interrupted is done again.
    steps = [n for _run, n in progress_lines(progress)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and len(steps) <= STEPS + 1, steps

    rows = {r["job_id"]: r for r in json.loads(cli(
        sb, "jobs", "--json", "--since", "now-1hour").stdout)["jobs"]}
    row = rows[int(job.job_id)]
    assert (row["state"], row["preemptions"], row["failures"]) == ("COMPLETED", 1, 0), row
    assert row["runs"] == 2 and row["partition"] == "idle"
