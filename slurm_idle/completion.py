"""Completion markers: a job whose work finished never runs it again, whatever Slurm does.

Slurm can start a finished batch job once more. 24.05 and later (24.11 included, unfixed in
25.11 and master) requeue a job whose run ends while the GRACE_PREEMPT flag of an earlier
preemption is still set on the job record; the flag is cleared only when that preemption's
requeue came from the batch script ending during GraceTime, not from `scontrol requeue` or
from GraceTime running out (docs/slurm-releases.md has the source trail). A second run of a
finished evaluation or model push repeats its side effects, so the runner keeps its own record:
after the container exits 0 it writes a marker file (atomically: temp file, fsync, rename)
before it exits 0 itself, and a later run of the same job id that finds the marker exits 0 at
once, saying why.

The marker lives in the job's checkpoint dir (shared storage that survives requeues), or, for a
spec without one, in the submitting user's state dir (`$SLURM_IDLE_STATE_DIR/completed`). Its
name carries the cluster name and the job id, so a new job that reuses the checkpoint dir, or a
job id reused by another cluster, is not mistaken for the finished one. Only success is
recorded: a failed run stays retryable (`scontrol requeue` of a FAILED job runs it again).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER_PREFIX = ".slurm-idle-completed"


@dataclass(frozen=True)
class Completion:
    """What a finished run recorded."""

    job_id: str
    cluster: str
    exit_code: int
    restart_count: int  # SLURM_RESTART_COUNT of the run that finished
    finished_at: str  # UTC, ISO 8601


def marker_path(directory: Path, job_id: str, cluster: str = "") -> Path:
    """The marker of one job: <dir>/.slurm-idle-completed-[<cluster>-]<job id>.json."""
    key = f"{cluster}-{job_id}" if cluster else job_id
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
    return directory / f"{MARKER_PREFIX}-{safe}.json"


def marker_dir(checkpoint_source: str | None, environ: Mapping[str, str]) -> Path:
    """The checkpoint dir (host side) if the spec has one, else the user's state dir."""
    if checkpoint_source:
        return Path(checkpoint_source)
    from slurm_idle.pipeline import state_dir

    return state_dir(environ) / "completed"


def read_completion(path: Path) -> Completion | None:
    """The recorded completion, or None when there is no marker.

    A marker that exists but cannot be parsed (edited by hand) still means "finished": it is
    only ever created, by rename, after a run exited 0.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        return Completion(
            job_id=str(data["job_id"]), cluster=str(data.get("cluster", "")),
            exit_code=int(data["exit_code"]), restart_count=int(data.get("restart_count", 0)),
            finished_at=str(data.get("finished_at", "?")),
        )
    except (ValueError, KeyError, TypeError):
        return Completion(job_id="?", cluster="", exit_code=0, restart_count=-1,
                          finished_at="? (unreadable marker)")


def write_completion(path: Path, completion: Completion) -> None:
    """Write the marker atomically: a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-slurm-idle-completed-")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from `slurm-idle jobs` of others
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(completion), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def already_done_message(c: Completion, restart_count: int) -> str:
    return (
        f"job {c.job_id} already completed (exit {c.exit_code} at {c.finished_at}, run "
        f"{c.restart_count}); Slurm started it again (run {restart_count}): not running the "
        "work again, exiting 0"
    )
