"""Completion is final: a job id whose work finished never starts its container again."""

from __future__ import annotations

import io
import json
from pathlib import Path

from slurm_idle import completion
from slurm_idle.runner import (
    EXIT_MAX_RESTARTS,
    EXIT_PREEMPTED,
    Reporter,
    RunSettings,
    Signals,
    SlurmContext,
    run_container,
    slurm_context,
)
from tests.unit.test_runner import FakeClient, run, spec

CTX = SlurmContext(job_id="42", restart_count=1, cluster="c1")


def test_a_finished_job_started_again_exits_0_without_running_its_work(tmp_path: Path) -> None:
    """Run 1 exits 0 and records it; Slurm's extra run (24.11) of the same job id exits 0 at
    once, saying why, and creates no container."""
    first = FakeClient(on_start=lambda c: c.exit(0))
    code, log = run(first, spec(tmp_path), ctx=CTX)
    assert code == 0 and len(first.containers.created) == 1
    assert "completion recorded in" in log
    again = FakeClient(on_start=lambda c: c.exit(0))
    code, log = run(again, spec(tmp_path), ctx=SlurmContext(job_id="42", restart_count=2,
                                                           cluster="c1"))
    assert code == 0 and again.containers.created == []
    assert "job 42 already completed" in log and "not running the work again" in log


def test_the_marker_is_written_before_the_runner_exits_and_holds_the_exit_status(
    tmp_path: Path,
) -> None:
    """The marker is a whole JSON document in the checkpoint dir, no temp file left beside it."""
    run(FakeClient(on_start=lambda c: c.exit(0)), spec(tmp_path), ctx=CTX)
    marker = completion.marker_path(tmp_path / "ck", "42", "c1")
    data = json.loads(marker.read_text())
    assert data["exit_code"] == 0 and data["job_id"] == "42" and data["restart_count"] == 1
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [marker.name]


def test_a_failed_or_preempted_run_records_nothing_and_runs_again(tmp_path: Path) -> None:
    """Only success is final: a failure stays retryable, a preempted run resumes."""
    run(FakeClient(on_start=lambda c: c.exit(3)), spec(tmp_path), ctx=CTX)
    signals = Signals()
    code, _ = run(FakeClient(on_start=lambda c: signals.term.set()), spec(tmp_path), signals,
                  ctx=CTX)
    assert code == EXIT_PREEMPTED
    again = FakeClient(on_start=lambda c: c.exit(0))
    assert run(again, spec(tmp_path), ctx=CTX)[0] == 0 and len(again.containers.created) == 1


def test_another_job_id_or_cluster_sharing_the_checkpoint_dir_still_runs(tmp_path: Path) -> None:
    """A new submission that reuses the checkpoint dir (or a job id reused by another cluster)
    is not the finished job."""
    run(FakeClient(on_start=lambda c: c.exit(0)), spec(tmp_path), ctx=CTX)
    for ctx in (SlurmContext(job_id="43", cluster="c1"), SlurmContext(job_id="42", cluster="c2")):
        client = FakeClient(on_start=lambda c: c.exit(0))
        assert run(client, spec(tmp_path), ctx=ctx)[0] == 0
        assert len(client.containers.created) == 1


def test_the_marker_is_checked_before_the_restart_limit(tmp_path: Path) -> None:
    """A finished job that Slurm restarts past max_restarts still ends 0, not 64 (FAILED)."""
    run(FakeClient(on_start=lambda c: c.exit(0)), spec(tmp_path, max_restarts=1), ctx=CTX)
    late = SlurmContext(job_id="42", restart_count=5, cluster="c1")
    client = FakeClient(on_start=lambda c: c.exit(0))
    code, _ = run(client, spec(tmp_path, max_restarts=1), ctx=late)
    assert code == 0 and code != EXIT_MAX_RESTARTS


def test_a_spec_without_checkpoint_dir_keeps_its_marker_in_the_state_dir(tmp_path: Path) -> None:
    """No checkpoint mount: the marker goes to $SLURM_IDLE_STATE_DIR/completed."""
    from slurm_idle.jobs import parse_job_spec

    sp = parse_job_spec({"name": "t", "image": "img:1"})
    env = {"SLURM_IDLE_STATE_DIR": str(tmp_path / "state")}
    settings = RunSettings(grace_s=1.0, uid=1000, gid=1000, poll_s=0.01)
    for expected_containers in (1, 0):
        client = FakeClient(on_start=lambda c: c.exit(0))
        code = run_container(client, sp, CTX, settings, Signals(), Reporter(io.BytesIO()),
                             environ=env)
        assert code == 0 and len(client.containers.created) == expected_containers
    assert completion.marker_path(tmp_path / "state" / "completed", "42", "c1").is_file()


def test_outside_slurm_nothing_is_recorded(tmp_path: Path) -> None:
    """Without a job id there is nothing to key a marker on: every run runs."""
    for _ in range(2):
        client = FakeClient(on_start=lambda c: c.exit(0))
        assert run(client, spec(tmp_path), ctx=SlurmContext())[0] == 0
        assert len(client.containers.created) == 1
    assert list((tmp_path / "ck").iterdir()) == []


def test_an_unreadable_marker_still_means_finished(tmp_path: Path) -> None:
    path = completion.marker_path(tmp_path, "7")
    path.write_text("{not json")
    done = completion.read_completion(path)
    assert done is not None and done.exit_code == 0


def test_slurm_context_reads_the_cluster_name() -> None:
    assert slurm_context({"SLURM_JOB_ID": "1", "SLURM_CLUSTER_NAME": "x"}).cluster == "x"
