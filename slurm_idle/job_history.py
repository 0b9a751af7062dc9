"""A researcher's jobs on the idle partition, live and past: the queue joined with accounting.

`squeue` forgets a job minutes after it ends (MinJobAge), so a job preempted at 03:00 and
finished at 05:00 is gone by breakfast. Accounting (`sacct --duplicates`) keeps every run of
it: one row per job is built from its runs, with the queue's live state, node and reason on
top while Slurm still holds it.

- Which jobs: those in the lend partition (submitit's, plain `sbatch -p idle`) and those
  `slurm-idle submit` tagged (jobs.parse_job_comment), of one user or of all.
- Preemptions and failures apart: the runner's ledger (runlog.py) when this account can read
  it (it tells a retry's requeue from a reclaim's); else from the runs, with report.py's rule
  (is_preemption: PREEMPTED, or requeued other than at its time limit) and FAILURE_STATES.
- `reason`: Slurm's (why pending, why it ended) when it says one; for a failed job without
  one, its exit code or signal. Never the string "None": null.

Pure but for reading the small state files (jobview.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slurm_idle import runlog
from slurm_idle.jobs import parse_job_comment
from slurm_idle.jobview import checkpoint_age_s
from slurm_idle.leadership import LEASE_JOB_NAME
from slurm_idle.model import SlurmJob
from slurm_idle.pipeline import job_record
from slurm_idle.report import is_preemption
from slurm_idle.slurm.protocol import AcctJob

#: Run end states that are the job's own failure (a preemption or a cancel is not).
FAILURE_STATES = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL",
                            "DEADLINE"})
#: States of a run that has not ended.
UNENDED_STATES = frozenset({"PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING",
                            "RESIZING"})
#: Slurm's placeholders for "no reason".
NO_REASON = frozenset({"", "None", "none", "(null)"})


def job_rows(
    live: Iterable[SlurmJob],
    runs: Iterable[AcctJob],
    *,
    tag: str,
    partition: str,
    root: Path,
    now: float,
    user: str | None = None,
    states: Collection[str] = (),
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """One row per job of ours (see the module docstring), oldest job first.

    Keys (stable, `jobs --json`): job_id, name, user, state, restarts, runs, preemptions,
    failures, exit_code, signal, node, gpus, start, end, checkpoint_age_s, pipeline, step,
    reason, log, partition. runs/preemptions/failures are None when neither accounting nor a
    readable ledger knows the job (`runs` empty: the web view's queue-only rows). `user`
    None: everyone's. `states`: keep a job whose state, or the end state of any of its runs,
    is one of them (so `PREEMPTED` finds jobs preempted once).
    """
    by_id: dict[int, list[AcctJob]] = {}
    for run in runs:
        by_id.setdefault(run.job_id, []).append(run)
    queued = {job.job_id: job for job in live}
    wanted = {s.upper() for s in states}
    rows = []
    for job_id in sorted(set(by_id) | set(queued)):
        seen = Seen(job_id, queued.get(job_id), tuple(sorted(
            by_id.get(job_id, ()), key=lambda r: (r.start or float("inf"), r.restarts))))
        if seen.tags(tag) is None and not (partition and partition in seen.partition.split(",")):
            continue
        if seen.pick("name") == LEASE_JOB_NAME:  # the agents' leadership lease, not a job
            continue
        if (user and seen.owner != user) or (wanted and not wanted & seen.states):
            continue
        rows.append(_row(seen, tag, root, now, cluster))
    return rows


@dataclass(frozen=True)
class Seen:
    """One job as the queue (`job`, while Slurm holds it) and accounting (`history`, its runs
    oldest first) show it; the queue wins where both say something."""

    job_id: int
    job: SlurmJob | None
    history: tuple[AcctJob, ...]

    @property
    def latest(self) -> AcctJob | None:
        return self.history[-1] if self.history else None

    def pick(self, field: str, default: Any = "") -> Any:
        """`field` (both records have it) from the queue while Slurm holds the job, else from
        its latest run."""
        if self.job is not None:
            return getattr(self.job, field)
        return getattr(self.latest, field) if self.latest is not None else default

    def tags(self, tag: str) -> dict[str, str] | None:
        return parse_job_comment(self.pick("comment"), tag)

    @property
    def partition(self) -> str:
        return str(self.pick("partition"))

    @property
    def owner(self) -> str:
        return str(self.pick("user"))

    @property
    def state(self) -> str:
        return str(self.pick("state", "UNKNOWN"))

    @property
    def states(self) -> set[str]:
        """The state now and every run's end state."""
        return {self.state} | {r.state for r in self.history}

    @property
    def ended(self) -> list[AcctJob]:
        return [r for r in self.history if r.state not in UNENDED_STATES and r.end is not None]

    @property
    def last(self) -> AcctJob | None:
        """The last run's end, once the job has ended (not a requeued job's earlier run's)."""
        ended = self.ended
        return ended[-1] if ended and self.state not in UNENDED_STATES else None


def _row(seen: Seen, tag: str, root: Path, now: float, cluster: str | None) -> dict[str, Any]:
    job, history, last, ended = seen.job, seen.history, seen.last, seen.ended
    rec = job_record(root, seen.job_id, cluster or "") or {}
    ledger = runlog.read(root, seen.job_id, cluster)
    summary = runlog.summarize(ledger) if ledger else None
    tags = seen.tags(tag) or {}
    return {
        "job_id": seen.job_id,
        "name": seen.pick("name"),
        "user": seen.owner,
        "state": seen.state,
        "restarts": job.restart_count if job is not None else _restarts(history),
        "runs": (sum(1 for r in history if r.start is not None) if history
                 else summary.runs if summary else None),
        "preemptions": (summary.preemptions if summary
                        else sum(1 for r in ended if is_preemption(r)) if history else None),
        "failures": (summary.failures if summary
                     else sum(1 for r in ended if r.state in FAILURE_STATES) if history
                     else None),
        "exit_code": last.exit_code if last else None,
        "signal": last.signal if last else None,
        "node": ",".join(job.nodes if job is not None and job.nodes
                         else seen.latest.nodes if seen.latest else ()),
        "gpus": seen.pick("gpus", 0),
        "start": iso_utc(min((r.start for r in history if r.start), default=None)
                         or (job.start_time if job is not None else None)),
        "end": iso_utc(last.end) if last else None,
        "checkpoint_age_s": checkpoint_age_s(rec.get("checkpoint"), now),
        "pipeline": tags.get("pipeline"),
        "step": tags.get("step"),
        "reason": _reason(job, last, summary),
        "log": rec.get("log"),
        "partition": seen.partition,
    }


def _restarts(history: Sequence[AcctJob]) -> int:
    return max((r.restarts for r in history), default=0)


def _reason(job: SlurmJob | None, last: AcctJob | None, summary: Any) -> str | None:
    """Why the job is where it is. Not ended: the queue's reason (why it waits). Failed: the
    runner's recorded end, else the signal or exit code, else Slurm's reason. Ended otherwise
    (completed, cancelled, preempted): nothing to explain. A stale pending reason accounting
    keeps on a finished job (`BeginTime`) is never shown."""
    queue = None if job is None or job.state_reason in NO_REASON else job.state_reason
    if last is None:
        return queue
    if last.state not in FAILURE_STATES:
        return None
    end = summary.last_end if summary is not None else None
    if end and end.get("why") == "max_restarts":
        return "more restarts than its max_restarts"
    if end and end.get("why") == "failed" and end.get("exit_code") is not None:
        return f"the container exited {end['exit_code']}"
    if last.signal:
        return f"killed by signal {last.signal}"
    if last.exit_code:
        return f"exit code {last.exit_code}"
    return last.reason if last.reason not in NO_REASON else queue


def iso_utc(ts: float | None) -> str | None:
    """A unix time as ISO 8601 UTC (`2026-12-07T17:30:00Z`), None as None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
