"""A researcher's state per ClusterName: records, ledgers and paths of two clusters sharing a
home directory never meet (job ids restart at 1 on every cluster)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_idle import runlog
from slurm_idle.errors import BadInput
from slurm_idle.job_history import job_rows
from slurm_idle.jobs import load_job_spec
from slurm_idle.jobs_spec import parse_job_spec
from slurm_idle.pipeline import (
    job_record,
    load_pipeline,
    pipeline_records,
    read_pipeline_record,
    record_job,
    record_pipeline,
)
from slurm_idle.slurm.protocol import AcctJob

EXAMPLES = Path(__file__).resolve().parents[2] / "etc" / "examples"
SPEC = {"name": "t", "image": "img:1", "log": "/tmp/x/%j.out",
        "mounts": {"checkpoint": {"source": "/tmp/ck/{cluster}-{job_id}", "target": "/ck"}}}


def test_job_records_of_two_clusters_with_the_same_job_id_stay_apart(tmp_path: Path) -> None:
    spec = parse_job_spec(SPEC)
    record_job(tmp_path, 1, spec, 10.0, cluster="alpha")
    record_job(tmp_path, 1, spec, 20.0, cluster="beta")
    a, b = job_record(tmp_path, 1, "alpha"), job_record(tmp_path, 1, "beta")
    assert a is not None and b is not None
    assert (a["submitted_at"], b["submitted_at"]) == (10.0, 20.0)
    assert (a["checkpoint"], b["checkpoint"]) == ("/tmp/ck/alpha-1", "/tmp/ck/beta-1")
    assert job_record(tmp_path, 1, "gamma") is None and job_record(tmp_path, 1) is None


def test_pipeline_records_of_two_clusters_stay_apart(tmp_path: Path) -> None:
    pipe = load_pipeline(EXAMPLES / "pipeline.yaml")
    ids = {s.name: 10 + i for i, s in enumerate(pipe.steps)}
    record_pipeline(tmp_path, pipe, ids, now=1.0, cluster="alpha")
    assert read_pipeline_record(tmp_path, pipe.name, "alpha")["steps"][0]["job_id"] == 10
    with pytest.raises(BadInput, match="no record"):
        read_pipeline_record(tmp_path, pipe.name, "beta")
    assert pipeline_records(tmp_path, "beta") == [] and len(pipeline_records(tmp_path, "alpha")) == 1


def test_jobs_reads_only_its_own_clusters_ledger(tmp_path: Path) -> None:
    """Job 1 of another cluster preempted 3 times must not be counted for this cluster's job 1
    (it was, reading the newest ledger of any cluster)."""
    for n in range(3):
        runlog.append(tmp_path, 1, {"event": "end", "run": n, "why": "preempted"}, "other")
    run = AcctJob(job_id=1, name="j", partition="idle", state="COMPLETED", start=1.0, end=2.0,
                  elapsed_s=1.0, gpus=1, user="ada")
    mine = job_rows([], [run], tag="slurm-idle", partition="idle", root=tmp_path, now=3.0,
                    cluster="here")
    theirs = job_rows([], [run], tag="slurm-idle", partition="idle", root=tmp_path, now=3.0,
                      cluster="other")
    assert mine[0]["preemptions"] == 0 and theirs[0]["preemptions"] == 3


def test_a_spec_path_under_home_is_the_submitting_users(tmp_path: Path) -> None:
    """`~/...` in a mount source and the log: the user's own directory, not a shared path."""
    spec = parse_job_spec({**SPEC, "log": "~/runs/%j.out", "mounts": {
        "checkpoint": {"source": "~/ck/{cluster}-{job_id}", "target": "/ck"}}})
    home = os.path.expanduser("~")
    assert spec.log == f"{home}/runs/%j.out"
    ck = spec.for_job("7", "alpha").mounts.checkpoint
    assert ck is not None and ck.source == f"{home}/ck/alpha-7"
    assert spec.for_job("7").mounts.checkpoint.source == f"{home}/ck/default-7"  # type: ignore[union-attr]


def test_the_demo_example_writes_under_the_users_home_per_cluster() -> None:
    spec = load_job_spec(EXAMPLES / "demo-job.yaml")
    home = os.path.expanduser("~")
    assert spec.log.startswith(home + "/")
    ck = spec.for_job("3", "c1").mounts.checkpoint
    assert ck is not None and ck.source.startswith(home + "/") and "c1" in ck.source
