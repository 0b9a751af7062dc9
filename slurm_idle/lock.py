"""A non-blocking flock so two ticks (cron overlap, an admin's manual run) never act at once."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def try_lock(path: str | os.PathLike[str]) -> Iterator[bool]:
    """Yield True holding an exclusive flock on `path`, or False if another process holds it.

    The kernel drops the lock when the holder dies, so a killed tick never leaves it stale.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def lock_holder(path: str | os.PathLike[str]) -> str:
    """The pid written by the current holder, for messages ('' if unknown)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
