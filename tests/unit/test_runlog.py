"""The run ledger: why each run ended, and what max_restarts and retries count from it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from slurm_idle import runlog
from slurm_idle.runner import (
    EXIT_MAX_RESTARTS,
    EXIT_PREEMPTED,
    EXIT_REQUEUE_ME,
    Reporter,
    RunSettings,
    Signals,
    SlurmContext,
    run_container,
)
from tests.unit.test_runner import FakeClient, spec


def run_in(tmp_path: Path, client: FakeClient, sp: Any, restart: int,
           signals: Signals | None = None) -> tuple[int, str]:
    out = io.BytesIO()
    settings = RunSettings(grace_s=0.5, uid=1000, gid=1000, poll_s=0.01, urgent_wait_s=0.1,
                           ledger_dir=tmp_path / "state")
    code = run_container(client, sp, SlurmContext(job_id="7", restart_count=restart), settings,
                         signals or Signals(), Reporter(out, clock=lambda: 0.0))
    return code, out.getvalue().decode()


def preempted_run(tmp_path: Path, sp: Any, restart: int) -> int:
    signals = Signals()
    client = FakeClient(on_start=lambda c: signals.term.set())
    client.exits_on_term = True
    return run_in(tmp_path, client, sp, restart, signals)[0]


def test_summary_counts_each_reason_once_per_run() -> None:
    """Ends are counted per run number; a start without an end before the latest is 'killed'."""
    recs = [
        {"run": 0, "event": "start"}, {"run": 0, "event": "end", "why": "preempted"},
        {"run": 1, "event": "start"},  # killed: no end
        {"run": 2, "event": "start"}, {"run": 2, "event": "end", "why": "failed", "retry": True},
        {"run": 2, "event": "end", "why": "failed", "retry": True},
        {"run": 3, "event": "start"},
    ]
    s = runlog.summarize(recs)
    assert (s.runs, s.preemptions, s.failures, s.retried, s.killed) == (4, 1, 1, 1, 1)
    assert s.counted_restarts(3) == 1  # the killed run
    assert runlog.summarize(recs, before_run=1).to_json()["preemptions"] == 1


def test_backoff_doubles_and_is_capped() -> None:
    """Retry 1 waits base, retry 2 twice that, never beyond the cap."""
    assert [runlog.backoff_s(10, k) for k in (1, 2, 3)] == [10, 20, 40]
    assert runlog.backoff_s(10, 20) == 600 and runlog.backoff_s(0, 3) == 0


def test_a_job_preempted_25_times_still_runs_with_max_restarts_2(tmp_path: Path) -> None:
    """Preemptions never count against max_restarts: run 26 of a max_restarts=2 job runs."""
    sp = spec(tmp_path, max_restarts=2)
    for restart in range(25):
        assert preempted_run(tmp_path, sp, restart) == EXIT_PREEMPTED
    code, _ = run_in(tmp_path, FakeClient(on_start=lambda c: c.exit(0)), sp, 25)
    assert code == 0
    s = runlog.summarize(runlog.read(tmp_path / "state", 7))
    assert (s.preemptions, s.completed, s.failures) == (25, 1, 0)


def test_unexplained_restarts_still_count(tmp_path: Path) -> None:
    """Runs killed before they could say why (no ledger end) count against max_restarts."""
    for restart in range(3):
        runlog.append(tmp_path / "state", 7, {"run": restart, "event": "start"})
    code, log = run_in(tmp_path, FakeClient(on_start=lambda c: c.exit(0)),
                       spec(tmp_path, max_restarts=2), 3)
    assert code == EXIT_MAX_RESTARTS and "max_restarts=2" in log


def test_a_failure_is_retried_then_the_next_failure_fails(tmp_path: Path) -> None:
    """retries: 1 -> the first failure asks for a requeue (75), the second returns its code."""
    sp = spec(tmp_path, retries=1, retry_backoff_s=0)
    code, log = run_in(tmp_path, FakeClient(on_start=lambda c: c.exit(3)), sp, 0)
    assert code == EXIT_REQUEUE_ME and "retry 1 of 1" in log
    assert run_in(tmp_path, FakeClient(on_start=lambda c: c.exit(3)), sp, 1)[0] == 3
    s = runlog.summarize(runlog.read(tmp_path / "state", 7))
    assert (s.failures, s.retried) == (2, 1)


def test_without_retries_a_failure_is_final(tmp_path: Path) -> None:
    """The default retries: 0 never requeues a failed container."""
    assert run_in(tmp_path, FakeClient(on_start=lambda c: c.exit(3)), spec(tmp_path), 0)[0] == 3


def test_preemptions_do_not_use_up_retries(tmp_path: Path) -> None:
    """Preempted runs between failures leave the retry budget alone."""
    sp = spec(tmp_path, retries=1, retry_backoff_s=0)
    for restart in range(3):
        assert preempted_run(tmp_path, sp, restart) == EXIT_PREEMPTED
    assert run_in(tmp_path, FakeClient(on_start=lambda c: c.exit(3)), sp, 3)[0] == EXIT_REQUEUE_ME


def test_a_stop_during_the_backoff_hands_over_to_slurm(tmp_path: Path) -> None:
    """SIGTERM in the backoff: exit 143 (Slurm requeues), the failure stays recorded."""
    signals = Signals()
    sp = spec(tmp_path, retries=2, retry_backoff_s=30)

    def fail_then_term(c: Any) -> None:
        c.exit(3)
        threading_timer(0.2, signals.term.set)

    code, _ = run_in(tmp_path, FakeClient(on_start=fail_then_term), sp, 0, signals)
    assert code == EXIT_PREEMPTED
    assert runlog.summarize(runlog.read(tmp_path / "state", 7)).failures == 1


def test_run_zero_sets_aside_an_older_jobs_ledger(tmp_path: Path) -> None:
    """A ledger left by an older job of the same id (slurmctld reset) is not counted."""
    for restart in range(5):
        runlog.append(tmp_path / "state", 7, {"run": restart, "event": "start"})
    assert run_in(tmp_path, FakeClient(on_start=lambda c: c.exit(0)),
                  spec(tmp_path, max_restarts=0), 0)[0] == 0
    assert runlog.summarize(runlog.read(tmp_path / "state", 7)).runs == 1


def threading_timer(delay: float, fn: Any) -> None:
    import threading

    t = threading.Timer(delay, fn)
    t.daemon = True
    t.start()


def test_a_time_limit_warning_during_the_backoff_requeues_at_once(tmp_path: Path) -> None:
    """SIGUSR1 in the backoff: nobody else will requeue the job, so the runner asks for it (75)."""
    signals = Signals()
    sp = spec(tmp_path, retries=1, retry_backoff_s=30)

    def fail_then_usr1(c: Any) -> None:
        c.exit(3)
        threading_timer(0.2, signals.usr1.set)

    code, _ = run_in(tmp_path, FakeClient(on_start=fail_then_usr1), sp, 0, signals)
    assert code == EXIT_REQUEUE_ME


def test_two_clusters_sharing_a_home_keep_apart_ledgers(tmp_path: Path) -> None:
    """Job 7 of cluster a and job 7 of cluster b: each runner counts only its own runs;
    a reader without the cluster name reads the newest ledger of that id."""
    root = tmp_path / "state"
    for restart in range(3):
        runlog.append(root, 7, {"run": restart, "event": "start"}, cluster="a")
    runlog.append(root, 7, {"run": 0, "event": "end", "why": "preempted"}, cluster="b")
    assert runlog.summarize(runlog.read(root, 7, "b")).to_json()["killed"] == 0
    assert runlog.summarize(runlog.read(root, 7, "a")).killed == 2
    assert runlog.ledger_path(root, 7, "a/../x").name == "a____x.7.jsonl"
    assert len(runlog.read(root, 7)) in {1, 3}  # one ledger, never both mixed
    out = io.BytesIO()
    code = run_container(
        FakeClient(on_start=lambda c: c.exit(0)), spec(tmp_path, max_restarts=1),
        SlurmContext(job_id="7", restart_count=3, cluster="b"),
        RunSettings(grace_s=0.5, uid=1000, gid=1000, poll_s=0.01, ledger_dir=root),
        Signals(), Reporter(out, clock=lambda: 0.0))
    assert code == EXIT_MAX_RESTARTS  # b's one preemption leaves 2 counted restarts > 1
