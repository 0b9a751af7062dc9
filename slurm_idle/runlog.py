"""Why each run of a job ended: the runner's ledger, read by max_restarts, retries and the views.

Slurm counts every requeue in `SLURM_RESTART_COUNT` (Restarts=): a nightly preemption and a
crash look the same there. A long pre-training reclaimed every morning would hit
`max_restarts` after ~20 nights. So the runner appends one JSON line per run start and end
to `<state dir>/runs/<cluster>.<job_id>.jsonl` (the submitting user's state dir, see
pipeline.state_dir; shared storage on a cluster, like the checkpoints), with the reason the
run ended:

- `completed`  the container exited 0
- `failed`     the container exited non-zero (or could not start); `retry` says a retry follows
- `preempted`  stopped by SIGTERM (preemption, reclaim, `scontrol requeue`): never the job's fault
- `time_limit` stopped by SIGUSR1 near the time limit; the job requeues itself
- `max_restarts` refused to run again

A run with a start but no end was killed before it could write one (SIGKILL, node failure):
it counts as a failure for max_restarts (conservative), but not as a failed retry.

Reading is pure (`summarize` over parsed lines); writing appends one short line with
O_APPEND and without following symlinks, so two runs of a job never interleave a line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

EndReason = Literal["completed", "failed", "preempted", "time_limit", "max_restarts"]
END_REASONS: tuple[str, ...] = ("completed", "failed", "preempted", "time_limit", "max_restarts")


def cluster_key(cluster: str) -> str:
    """A ClusterName as a file name part (Slurm's names are plain; anything else becomes `_`)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", cluster)


def ledger_path(root: Path, job_id: str | int, cluster: str = "") -> Path:
    """`runs/<cluster>.<job_id>.jsonl` (`runs/<job_id>.jsonl` without a cluster name): two
    clusters sharing a home directory reach the same job ids."""
    safe = cluster_key(cluster)
    return root / "runs" / (f"{safe}.{job_id}.jsonl" if safe else f"{job_id}.jsonl")


def append(root: Path, job_id: str | int, record: Mapping[str, Any], cluster: str = "") -> None:
    """Append one record; OSError is the caller's to report (the run itself goes on)."""
    path = ledger_path(root, job_id, cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(dict(record), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(root: Path, job_id: str | int, cluster: str | None = None) -> list[dict[str, Any]]:
    """Every parseable record of the job ([] when there is no ledger).

    `cluster` None (a reader that does not know it, e.g. on a login node): the newest ledger
    of that job id of any cluster.
    """
    if cluster is not None:
        paths = [ledger_path(root, job_id, cluster)]
    else:
        found = [*(root / "runs").glob(f"*.{job_id}.jsonl"), ledger_path(root, job_id)]
        paths = sorted((p for p in found if p.is_file()), key=_mtime)[-1:]
    out = []
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        # Line by line, bytes first: a torn last line of a killed run, a non-UTF-8 or too
        # deeply nested line (the ledger is the user's own file) loses that line, not the job's
        # restart count (and not the runner with a traceback).
        for line in data.splitlines():
            try:
                rec = json.loads(line.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@dataclass(frozen=True)
class RunSummary:
    """What the ledger says about a job's runs so far."""

    runs: int = 0  # runs that started
    completed: int = 0
    failures: int = 0  # runs that ended `failed` (the container's fault)
    retried: int = 0  # of those, the ones the runner requeued for a retry (`retries:`)
    preemptions: int = 0
    time_limits: int = 0
    killed: int = 0  # started, never ended (SIGKILL, node failure): before the latest run
    last_end: dict[str, Any] | None = None

    def counted_restarts(self, restart_count: int) -> int:
        """Restarts that count against max_restarts: Slurm's count without the preemptions
        (never the job's fault) and without the retries of failures (`retries:` bounds those).
        What is left: time-limit continuations and runs killed before they could say why."""
        return max(restart_count - self.preemptions - self.retried, 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs, "completed": self.completed, "failures": self.failures,
            "retried": self.retried, "preemptions": self.preemptions,
            "time_limits": self.time_limits,
            "killed": self.killed,
        }


def summarize(records: Iterable[Mapping[str, Any]], before_run: int | None = None) -> RunSummary:
    """Count run ends per reason; with `before_run`, only runs numbered below it.

    Runs are numbered by SLURM_RESTART_COUNT; a run recorded twice (a retried write) counts once.
    """
    starts: set[int] = set()
    ends: dict[int, dict[str, Any]] = {}
    for rec in records:
        run = rec.get("run")
        if not isinstance(run, int) or (before_run is not None and run >= before_run):
            continue
        if rec.get("event") == "start":
            starts.add(run)
        elif rec.get("event") == "end" and rec.get("why") in END_REASONS:
            ends[run] = dict(rec)
    whys = [e["why"] for e in ends.values()]
    latest = max(starts | set(ends), default=None)
    killed = sum(1 for r in starts if r not in ends and r != latest)
    return RunSummary(
        runs=len(starts | set(ends)),
        completed=whys.count("completed"),
        failures=whys.count("failed"),
        retried=sum(1 for e in ends.values() if e["why"] == "failed" and e.get("retry")),
        preemptions=whys.count("preempted"),
        time_limits=whys.count("time_limit"),
        killed=killed,
        last_end=ends[max(ends)] if ends else None,
    )


def backoff_s(base_s: float, failure: int, cap_s: float = 600.0) -> float:
    """Exponential backoff before retry number `failure` (1, 2, ...): base, 2*base, ... capped."""
    if base_s <= 0 or failure < 1:
        return 0.0
    return float(min(base_s * 2 ** (failure - 1), cap_s))


def end_reason(code: int, preempted_code: int, requeue_code: int) -> EndReason:
    """The ledger's reason for a runner exit code (slurm_idle/runner documents the codes)."""
    if code == 0:
        return "completed"
    if code == preempted_code:
        return "preempted"
    if code == requeue_code:
        return "time_limit"
    return "failed"
