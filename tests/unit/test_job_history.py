"""`slurm-idle jobs` rows (job_history.py): the queue joined with accounting's runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurm_idle import runlog
from slurm_idle.job_history import job_rows
from slurm_idle.model import SlurmJob
from slurm_idle.slurm.protocol import AcctJob

T0 = 1_796_000_000.0
TAG = "slurm-idle"


def run(job_id: int, state: str, start: float | None, end: float | None, **kw: Any) -> AcctJob:
    fields: dict[str, Any] = {"name": f"job{job_id}", "partition": "idle", "user": "ada",
                              "elapsed_s": (end or 0) - (start or 0), "gpus": 1,
                              "nodes": ("gpu1",)}
    fields.update(kw)
    return AcctJob(job_id=job_id, state=state, start=start, end=end, **fields)


def rows(tmp_path: Path, live: list[SlurmJob], runs: list[AcctJob], **kw: Any) -> list[dict[str, Any]]:
    out = job_rows(live, runs, tag=TAG, partition="idle", root=tmp_path, now=T0 + 9000, **kw)
    json.dumps(out)  # every row is JSON as it stands
    return out


def by_id(out: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["job_id"]: r for r in out}


def test_a_job_slurm_forgot_is_listed_from_its_runs(tmp_path: Path) -> None:
    """Preempted once, then finished: gone from the queue, still a row with both runs."""
    (row,) = rows(tmp_path, [], [run(7, "PREEMPTED", T0, T0 + 600, restarts=0),
                                 run(7, "COMPLETED", T0 + 700, T0 + 1300, restarts=1,
                                     exit_code=0)])
    assert row["state"] == "COMPLETED" and row["runs"] == 2 and row["restarts"] == 1
    assert row["preemptions"] == 1 and row["failures"] == 0 and row["exit_code"] == 0
    assert row["reason"] is None and row["start"] == "2026-11-30T00:53:20Z"
    assert row["end"] == "2026-11-30T01:15:00Z" and row["node"] == "gpu1"


def test_a_requeue_at_the_time_limit_is_not_a_preemption(tmp_path: Path) -> None:
    """report.py's rule, written once: requeued near its limit = the job's own continuation."""
    out = by_id(rows(tmp_path, [], [
        run(1, "REQUEUED", T0, T0 + 3540, time_limit_s=3600.0),  # at its limit
        run(1, "COMPLETED", T0 + 3600, T0 + 3700, restarts=1),
        run(2, "REQUEUED", T0, T0 + 600, time_limit_s=3600.0),  # a reclaim's requeue
        run(2, "COMPLETED", T0 + 700, T0 + 800, restarts=1)]))
    assert out[1]["preemptions"] == 0 and out[2]["preemptions"] == 1
    assert out[1]["failures"] == out[2]["failures"] == 0


def test_a_failure_says_why_and_none_is_null(tmp_path: Path) -> None:
    """A FAILED job without Slurm's reason names its exit code or signal; Slurm's "None" is null."""
    out = by_id(rows(tmp_path, [SlurmJob(job_id=9, name="q", partition="idle", state="PENDING",
                                         user="ada", state_reason="None")], [
        run(3, "FAILED", T0, T0 + 5, exit_code=3),
        run(4, "FAILED", T0, T0 + 5, exit_code=0, signal=9),
        run(5, "CANCELLED", T0, T0 + 5, exit_code=0),
        run(6, "TIMEOUT", T0, T0 + 5, reason="TimeLimit")]))
    assert out[3]["reason"] == "exit code 3" and out[3]["failures"] == 1 and out[3]["exit_code"] == 3
    assert out[4]["reason"] == "killed by signal 9" and out[4]["signal"] == 9
    assert out[5]["reason"] is None and out[5]["failures"] == 0
    assert out[6]["reason"] == "TimeLimit" and out[6]["failures"] == 1
    assert out[9]["reason"] is None and out[9]["runs"] is None and out[9]["exit_code"] is None


def test_the_queue_wins_for_a_job_it_still_holds(tmp_path: Path) -> None:
    """A requeued job pending again: the queue's state, reason and restarts; runs from sacct."""
    live = [SlurmJob(job_id=7, name="job7", partition="idle", state="PENDING", user="ada",
                     restart_count=1, state_reason="BeginTime")]
    (row,) = rows(tmp_path, live, [run(7, "PREEMPTED", T0, T0 + 600),
                                   run(7, "PENDING", None, None, restarts=1)])
    assert row["state"] == "PENDING" and row["reason"] == "BeginTime" and row["restarts"] == 1
    assert row["runs"] == 1 and row["preemptions"] == 1 and row["exit_code"] is None
    assert row["end"] is None


def test_which_jobs_the_idle_partitions_and_ours(tmp_path: Path) -> None:
    """Untagged jobs of the idle partition (submitit, sbatch -p idle) and tagged ones anywhere;
    not an untagged job of another partition; one user or all."""
    runs = [run(1, "COMPLETED", T0, T0 + 1),  # submitit
            run(2, "COMPLETED", T0, T0 + 1, partition="batch"),
            run(3, "COMPLETED", T0, T0 + 1, partition="batch", comment=f"{TAG}:job"),
            run(4, "COMPLETED", T0, T0 + 1, user="bob")]
    assert sorted(by_id(rows(tmp_path, [], runs))) == [1, 3, 4]
    assert sorted(by_id(rows(tmp_path, [], runs, user="ada"))) == [1, 3]
    assert sorted(by_id(rows(tmp_path, [], runs, user="bob"))) == [4]


def test_state_filter_matches_the_state_or_any_runs_end(tmp_path: Path) -> None:
    """`--state PREEMPTED` finds a job preempted once and finished since."""
    runs = [run(1, "PREEMPTED", T0, T0 + 1), run(1, "COMPLETED", T0 + 2, T0 + 3, restarts=1),
            run(2, "COMPLETED", T0, T0 + 1), run(3, "FAILED", T0, T0 + 1, exit_code=1)]
    assert sorted(by_id(rows(tmp_path, [], runs, states=["preempted"]))) == [1]
    assert sorted(by_id(rows(tmp_path, [], runs, states=["COMPLETED"]))) == [1, 2]
    assert sorted(by_id(rows(tmp_path, [], runs, states=["FAILED", "PREEMPTED"]))) == [1, 3]


def test_the_runners_ledger_tells_a_retry_from_a_reclaim(tmp_path: Path) -> None:
    """A failed run the runner requeued for a retry is REQUEUED in sacct, like a reclaim: its
    ledger, when readable, counts it a failure and names the container's exit code."""
    runlog.append(tmp_path, 8, {"event": "start", "run": 0})
    runlog.append(tmp_path, 8, {"event": "end", "run": 0, "why": "failed", "exit_code": 3,
                                "retry": True})
    runlog.append(tmp_path, 8, {"event": "start", "run": 1})
    runlog.append(tmp_path, 8, {"event": "end", "run": 1, "why": "failed", "exit_code": 3})
    (row,) = rows(tmp_path, [], [run(8, "REQUEUED", T0, T0 + 60, time_limit_s=3600.0),
                                 run(8, "FAILED", T0 + 90, T0 + 150, restarts=1, exit_code=3)])
    assert row["preemptions"] == 0 and row["failures"] == 2
    assert row["reason"] == "the container exited 3"
