"""etc/job_submit.lua inside the sandbox's real slurmctld (JobSubmitPlugins=lua)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.sandbox


def show(sandbox: Any, job_id: str, key: str) -> str | None:
    for word in sandbox.run(["scontrol", "show", "job", job_id]).stdout.split():
        k, _, v = word.partition("=")
        if k == key:
            return v
    return None


def submit(sandbox: Any, *args: str) -> Any:
    return sandbox.run(["sbatch", "--parsable", "-o", "/dev/null", "--hold", *args,
                        "--wrap", "sleep 1"])


def test_plugin_is_loaded(sandbox: Any) -> None:
    """The sandbox runs slurmctld with our job_submit.lua."""
    conf = sandbox.run(["scontrol", "show", "config"]).stdout
    line = next(x for x in conf.splitlines() if x.startswith("JobSubmitPlugins"))
    assert line.split("=", 1)[1].strip() in {"lua", "job_submit/lua"}


def test_no_requeue_on_idle_is_rejected_with_our_message(sandbox: Any) -> None:
    """`sbatch -p idle --no-requeue` fails and tells the user why and what to do."""
    r = submit(sandbox, "-p", "idle", "--no-requeue")
    assert r.returncode != 0
    assert "--no-requeue is not allowed" in r.stderr and "Drop --no-requeue" in r.stderr


@pytest.mark.parametrize("partition_args", [["-p", "idle"], []], ids=["explicit", "default"])
def test_idle_jobs_are_requeueable(sandbox: Any, partition_args: list[str]) -> None:
    """A job on idle without --requeue (explicit -p or the default partition) has Requeue=1."""
    r = submit(sandbox, *partition_args)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    try:
        assert show(sandbox, job, "Partition") == "idle"
        assert show(sandbox, job, "Requeue") == "1"
        upd = sandbox.run(["scontrol", "update", f"job={job}", "requeue=0"])
        assert upd.returncode != 0 and show(sandbox, job, "Requeue") == "1"
    finally:
        sandbox.run(["scancel", job])


def test_other_partitions_keep_no_requeue(sandbox: Any) -> None:
    """The rule is for idle only: an inference job may say --no-requeue."""
    r = submit(sandbox, "-p", "inference", "--no-requeue")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    try:
        assert show(sandbox, job, "Requeue") == "0"
    finally:
        sandbox.run(["scancel", job])


def test_interactive_jobs_on_idle_are_rejected(sandbox: Any) -> None:
    """`srun -p idle` and `salloc -p idle` (no batch script: Slurm could not requeue them) are
    refused with our message; an sbatch script that runs srun steps inside is accepted."""
    for command in (["srun", "--test-only", "-p", "idle", "true"], ["salloc", "-p", "idle", "true"]):
        r = sandbox.run(["timeout", "30", *command])
        assert r.returncode != 0, command
        assert "takes batch jobs only" in r.stderr, r.stderr
    r = sandbox.run(["sbatch", "--parsable", "-o", "/dev/null", "--hold", "-p", "idle",
                     "--wrap", "srun true"])
    assert r.returncode == 0, r.stderr
    sandbox.run(["scancel", r.stdout.strip().split(";")[0]])


def test_interactive_jobs_elsewhere_are_left_alone(sandbox: Any) -> None:
    """The batch-only rule is the lend partition's: `srun -p inference` passes the plugin
    (--test-only: whether a node is free now, serving nodes being drained, is not the point)."""
    r = sandbox.run(["timeout", "30", "srun", "--test-only", "-p", "inference", "true"])
    assert "takes batch jobs only" not in r.stderr, r.stderr
