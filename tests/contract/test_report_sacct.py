"""Contract: `slurm-idle report --json` against the sandbox's real sacct/slurmdbd.

The sandbox is shared by the session, so other tests' jobs may fall into the period: each test
checks its own job's row (`per_job`) against what `sacct` says for that job, and that the
totals include it.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from slurm_idle.testing.sandbox import Sandbox
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox


def ok(sb: Sandbox, argv: list[str]) -> str:
    r = sb.run(argv)
    assert r.returncode == 0, f"{argv} failed: {r.stderr}"
    return r.stdout


def sacct_runs(sb: Sandbox, job: str) -> list[dict[str, str]]:
    """Every run of a job per `sacct -D` text output: State, ElapsedRaw, AllocTRES."""
    out = ok(sb, ["sacct", "-n", "-X", "-D", "-P", "-j", job, "-o", "State,ElapsedRaw,AllocTRES"])
    runs = []
    for line in out.splitlines():
        state, elapsed, tres = line.split("|")
        gpus = 0
        for item in tres.split(","):
            key, _, value = item.partition("=")
            if key == "gres/gpu":
                gpus = int(value)
        runs.append({"state": state.split()[0], "elapsed": int(elapsed), "gpus": gpus})
    return runs


def report(sb: Sandbox, since: float) -> dict[str, Any]:
    since_iso = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    r = sb.run(["slurm-idle", "report", "--json", "--since", since_iso])
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_report_matches_sacct_for_a_finished_gpu_job(sandbox: Sandbox) -> None:
    """A 1-GPU job on idle shows in the report with the GPU-hours sacct gives it."""
    t0 = time.time() - 60
    job = ok(sandbox, ["sbatch", "--parsable", "--wait", "-p", "idle", "--gres=gpu:1",
                       "-o", "/dev/null", "--wrap", "sleep 3"]).strip()
    runs = poll(lambda: [r for r in sacct_runs(sandbox, job) if r["state"] == "COMPLETED"],
                30, f"job {job} COMPLETED in sacct")
    expected = sum(r["elapsed"] * r["gpus"] for r in runs) / 3600
    assert runs[0]["gpus"] == 1 and expected > 0

    out = report(sandbox, t0)
    rows = {row["job_id"]: row for row in out["per_job"]}
    assert int(job) in rows, f"job {job} missing from report: {sorted(rows)}"
    row = rows[int(job)]
    assert row["gpu_hours"] == pytest.approx(expected, abs=2e-6)
    assert (row["runs"], row["preemptions"], row["state"]) == (1, 0, "COMPLETED")
    assert out["jobs"] >= 1 and out["gpu_hours"] >= row["gpu_hours"] - 1e-6
    assert out["savings"] == pytest.approx(out["gpu_hours"] * out["price_per_gpu_hour"], abs=0.01)
    assert {"gpu_hours", "jobs", "preemptions", "lost_gpu_hours", "reclaim_latency_s_p95",
            "savings", "currency", "days"} <= set(out)


def test_requeued_job_counts_as_a_preemption_with_its_lost_work(sandbox: Sandbox) -> None:
    """A job requeued while running (as a reclaim does) shows 2 runs, 1 preemption, lost work."""
    t0 = time.time() - 60
    # First run sleeps long (it gets requeued); the rerun (SLURM_RESTART_COUNT=1) ends quickly.
    script = 'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 300; else sleep 2; fi'
    job = ok(sandbox, ["sbatch", "--parsable", "-p", "idle", "--requeue", "--gres=gpu:2",
                       "-o", "/dev/null", "--wrap", script]).strip()
    try:
        poll(lambda: ok(sandbox, ["squeue", "-h", "-j", job, "-o", "%T"]).strip() == "RUNNING",
             30, f"job {job} running")
        time.sleep(3)  # give the first run some GPU-seconds to lose
        ok(sandbox, ["scontrol", "requeue", job])
        runs = poll(
            lambda: (rs := sacct_runs(sandbox, job))
            and any(r["state"] == "COMPLETED" for r in rs) and rs,
            90, f"job {job} rerun COMPLETED in sacct",
        )
    finally:
        sandbox.run(["scancel", job])
    interrupted = [r for r in runs if r["state"] in {"REQUEUED", "PREEMPTED"}]
    assert len(interrupted) == 1, runs
    expected = sum(r["elapsed"] * r["gpus"] for r in runs) / 3600
    lost = interrupted[0]["elapsed"] * interrupted[0]["gpus"] / 3600

    out = report(sandbox, t0)
    row = {r["job_id"]: r for r in out["per_job"]}[int(job)]
    assert (row["runs"], row["preemptions"], row["state"]) == (2, 1, "COMPLETED")
    assert row["gpu_hours"] == pytest.approx(expected, abs=2e-6)
    assert row["lost_gpu_hours"] == pytest.approx(lost, abs=2e-6)  # no checkpoint interval set
    assert out["preemptions"] >= 1 and out["jobs_requeued"] >= 1
    assert out["lost_gpu_hours"] >= row["lost_gpu_hours"] - 1e-6
