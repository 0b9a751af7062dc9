"""A non-blocking flock so two ticks (cron overlap, an admin's manual run) never act at once."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slurm_idle.errors import SlurmIdleError


@contextmanager
def try_lock(path: str | os.PathLike[str]) -> Iterator[bool]:
    """Yield True holding an exclusive flock on `path`, or False if another process holds it.

    The kernel drops the lock when the holder dies, so a killed tick never leaves it stale.
    """
    p = Path(path)
    fd, writable = _open(p)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        if writable:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open(p: Path) -> tuple[int, bool]:
    """The lock file's fd, and whether we may write our pid into it.

    cron's ticks run as root and own the file (0644); an admin's `tick --dry-run` or `status`
    as another user can still take the flock through a read-only fd (flock needs no write
    access), so they wait for, and exclude, each other all the same.
    """
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        return os.open(p, os.O_RDWR | os.O_CREAT, 0o644), True
    except PermissionError:
        try:
            return os.open(p, os.O_RDONLY), False
        except OSError as exc:
            raise _lock_error(p, exc) from None
    except OSError as exc:
        raise _lock_error(p, exc) from None


def _lock_error(p: Path, exc: OSError) -> SlurmIdleError:
    return SlurmIdleError(
        f"cannot open the lock file {p}: {exc.strerror or exc} (paths.lock in the config; "
        "its directory must exist or be creatable by this user)"
    )


def lock_holder(path: str | os.PathLike[str]) -> str:
    """The pid written by the current holder, for messages ('' if unknown)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
