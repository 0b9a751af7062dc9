"""Contract: `slurm-idle jobs` against the sandbox's real sacct/slurmdbd (job history).

A job preempted and finished, a job that failed with exit 3 and one killed by a signal are
read back from accounting: runs, preemptions and failures apart, exit code, reason, nulls. The
sandbox is shared, so each test looks only at its own jobs.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from slurm_idle.commands import SubprocessRunner
from slurm_idle.job_history import job_rows
from slurm_idle.slurm import CliBackend
from slurm_idle.testing.sandbox import Sandbox
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox


def ok(sb: Sandbox, argv: list[str]) -> str:
    r = sb.run(argv)
    assert r.returncode == 0, f"{argv} failed: {r.stderr}"
    return r.stdout


def jobs_json(sb: Sandbox, *args: str) -> dict[int, dict[str, Any]]:
    r = sb.run(["slurm-idle", "jobs", "--json", *args])
    assert r.returncode == 0, r.stderr
    return {row["job_id"]: row for row in json.loads(r.stdout)["jobs"]}


def finished(sb: Sandbox, job: str) -> list[str]:
    """The job's runs' states once its last run has ended (sacct -D)."""
    out = ok(sb, ["sacct", "-n", "-X", "-D", "-P", "-j", job, "-o", "State"])
    states = [line.split()[0] for line in out.splitlines() if line.strip()]
    return states if states and states[-1] in {"COMPLETED", "FAILED", "CANCELLED"} else []


def test_jobs_lists_runs_preemptions_and_failures_from_accounting(sandbox: Sandbox) -> None:
    """A requeued-then-finished job: 2 runs, 1 preemption, 0 failures, exit 0, reason null;
    a job that exited 3: FAILED, 1 failure, exit code 3 named as its reason."""
    script = 'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 300; else sleep 1; fi'
    resumed = ok(sandbox, ["sbatch", "--parsable", "-p", "idle", "--requeue", "-J", "hist-ok",
                           "-o", "/dev/null", "--wrap", script]).strip()
    failed = ok(sandbox, ["sbatch", "--parsable", "-p", "idle", "-J", "hist-fail",
                          "-o", "/dev/null", "--wrap", "exit 3"]).strip()
    try:
        poll(lambda: ok(sandbox, ["squeue", "-h", "-j", resumed, "-o", "%T"]).strip() == "RUNNING",
             60, f"job {resumed} running")
        time.sleep(2)
        ok(sandbox, ["scontrol", "requeue", resumed])
        poll(lambda: finished(sandbox, resumed), 120, f"job {resumed} finished in sacct")
        poll(lambda: finished(sandbox, failed), 60, f"job {failed} finished in sacct")
    finally:
        sandbox.run(["scancel", resumed, failed])
    rows = jobs_json(sandbox, "--all", "--since", "now-1hour")
    ok_row, bad_row = rows[int(resumed)], rows[int(failed)]
    assert (ok_row["state"], ok_row["runs"], ok_row["preemptions"], ok_row["failures"]) == (
        "COMPLETED", 2, 1, 0), ok_row
    assert ok_row["exit_code"] == 0 and ok_row["reason"] is None and ok_row["user"] == "root"
    assert (bad_row["state"], bad_row["failures"], bad_row["preemptions"]) == ("FAILED", 1, 0)
    assert bad_row["exit_code"] == 3 and bad_row["reason"] == "exit code 3", bad_row

    # Filters: by state (any run's end counts) and by user.
    assert int(resumed) in jobs_json(sandbox, "--all", "--since", "now-1hour",
                                     "--state", "PREEMPTED,REQUEUED")
    assert int(failed) not in jobs_json(sandbox, "--all", "--since", "now-1hour",
                                        "--state", "COMPLETED")
    assert int(failed) not in jobs_json(sandbox, "-u", "nobody", "--since", "now-1hour")

    # Once Slurm has forgotten them (MinJobAge), accounting alone gives the same rows.
    acct = CliBackend(runner=SubprocessRunner(env=sandbox.env()), timeout_s=30).accounting(time.time() - 3600, None, "idle")
    alone = {r["job_id"]: r for r in job_rows([], acct, tag="slurm-idle", partition="idle",
                                              root=sandbox.root, now=time.time())}
    for job, row in ((resumed, ok_row), (failed, bad_row)):
        keep = ("state", "runs", "preemptions", "failures", "exit_code", "reason", "start", "end")
        assert {k: alone[int(job)][k] for k in keep} == {k: row[k] for k in keep}


def test_sacct_date_words_reach_jobs_and_report_and_bad_ones_are_exit_2(sandbox: Sandbox) -> None:
    """`yesterday` and `now-1day` (sacct's forms) work in both commands; a date in no known
    form is bad input (exit 2) naming the forms, before Slurm is asked."""
    for argv in (["report", "--json", "--since", "yesterday", "--until", "now"],
                 ["jobs", "--json", "--since", "now-1day"]):
        r = sandbox.run(["slurm-idle", *argv])
        assert r.returncode == 0, (argv, r.stderr)
        json.loads(r.stdout)
    r = sandbox.run(["slurm-idle", "jobs", "--since", "last tuesday"])
    assert r.returncode == 2 and "now-1day" in r.stderr, r.stderr
    r = sandbox.run(["slurm-idle", "jobs", "-u", "root", "--all"])
    assert r.returncode == 2 and "not both" in r.stderr, r.stderr
