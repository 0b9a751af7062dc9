"""What a job's rows read from files: its checkpoint's age and its log's tail (job_history.py
builds the rows of `slurm-idle jobs` and the web view)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


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


def users(rows: Sequence[dict[str, Any]]) -> list[str]:
    return sorted({r["user"] for r in rows if r.get("user")})
