"""Rows of `slurm-idle jobs` (and the web view's jobs): Slurm's view joined with ours.

Slurm gives state, node and its restart count; the submission record (pipeline.record_job)
gives the checkpoint dir and log file; the runner's ledger (runlog.py) says how many runs
were preempted and how many failed. Pure but for reading those small files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from slurm_idle import runlog
from slurm_idle.jobs import parse_job_comment
from slurm_idle.model import SlurmJob
from slurm_idle.pipeline import job_record


def checkpoint_age_s(path: str | None, now: float) -> float | None:
    """Seconds since the newest file under a local checkpoint dir was written (None: unknown)."""
    if not path or not os.path.isdir(path):
        return None
    newest = None
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                m = os.stat(os.path.join(root, f)).st_mtime
            except OSError:
                continue
            newest = m if newest is None else max(newest, m)
    return None if newest is None else round(max(now - newest, 0.0), 1)


def log_tail(path: str | None, lines: int = 20, max_bytes: int = 64 * 1024) -> list[str]:
    """The last lines of a job log (read from its end; [] when unreadable)."""
    if not path:
        return []
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - max_bytes, 0))
            data = fh.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


def job_rows(
    jobs: Iterable[SlurmJob], tag: str, root: Path, now: float, user: str | None = None,
) -> list[dict[str, Any]]:
    """One row per job of ours. Keys (stable, `jobs --json`): job_id, name, user, state,
    restarts, preemptions, failures, node, gpus, checkpoint_age_s, pipeline, step, reason,
    log. `preemptions`/`failures` are None when no run ledger of the job is readable here."""
    rows = []
    for job in jobs:
        tags = parse_job_comment(job.comment, tag)
        if tags is None or (user and job.user != user):
            continue
        rec = job_record(root, job.job_id) or {}
        records = runlog.read(root, job.job_id)
        summary = runlog.summarize(records) if records else None
        rows.append({
            "job_id": job.job_id,
            "name": job.name,
            "user": job.user,
            "state": job.state,
            "restarts": job.restart_count,
            "preemptions": summary.preemptions if summary else None,
            "failures": summary.failures if summary else None,
            "node": ",".join(job.nodes),
            "gpus": job.gpus,
            "checkpoint_age_s": checkpoint_age_s(rec.get("checkpoint"), now),
            "pipeline": tags.get("pipeline"),
            "step": tags.get("step"),
            "reason": job.state_reason,
            "log": rec.get("log"),
        })
    return rows


def users(rows: Sequence[dict[str, Any]]) -> list[str]:
    return sorted({r["user"] for r in rows if r.get("user")})
