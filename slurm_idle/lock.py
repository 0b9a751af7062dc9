"""The tick's lock: a non-blocking flock so two ticks (cron overlap, an admin's manual run)
never act at once, which nobody else can take or redirect.

The lock file lives in a directory of its own, created 0700 by the agent's user (root under
cron, default `/run/slurm-idle/`), is created 0600 and opened without following symlinks
(safefiles). Another user can neither open it (flock needs only a read-only fd: a 0644 file in
`/run/lock` let any user freeze every tick) nor plant a symlink in its place.

A holder that is not one of our ticks (another root process, a stuck tool) is not obeyed
silently: `inspect` finds the holder in /proc/locks, and once it has held the lock longer than
the tick budget the locked-out tick reports it (exit 1, log, textfile metric, alert).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slurm_idle.errors import SlurmIdleError
from slurm_idle.safefiles import UnsafePath, checked_dir, open_in

LOCK_DIR_MODE = 0o700
#: Beside the lock: the first time a locked-out tick saw a foreign holder ("pid unix_ts").
BLOCKED_NAME = ".blocked"


@contextmanager
def try_lock(path: str | os.PathLike[str], clock: float | None = None) -> Iterator[bool]:
    """Yield True holding an exclusive flock on `path`, or False if another process holds it.

    The kernel drops the lock when the holder dies, so a killed tick never leaves it stale.
    The holder writes `pid start_ts` into the file, so others can tell a tick from a stranger.
    """
    p = Path(path)
    fd = _open(p)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {time.time() if clock is None else clock:.0f}\n".encode())
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open(p: Path) -> int:
    try:
        with checked_dir(p.parent, LOCK_DIR_MODE) as dfd:
            fd = open_in(dfd, p.name, os.O_RDWR | os.O_CREAT, 0o600, str(p))
            os.fchmod(fd, 0o600)  # a file left 0644 by an older version: nobody else opens it
            return fd
    except UnsafePath as exc:
        raise SlurmIdleError(f"unsafe lock file {p}: {exc} (paths.lock in the config)") from None
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
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as fh:
            return fh.read().split(" ", 1)[0].strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Holder:
    """Who holds the lock, and since when (as far as can be told)."""

    pid: int | None
    command: str  # the holder's command line ('' if unknown)
    is_tick: bool  # it wrote its pid into the file, as our ticks and commands do
    held_s: float | None  # at least this long (None: unknown)

    def describe(self) -> str:
        who = f"pid {self.pid}" if self.pid else "an unknown process"
        cmd = f" ({self.command[:80]})" if self.command else ""
        held = f" for at least {self.held_s:.0f} s" if self.held_s is not None else ""
        kind = "a slurm-idle tick" if self.is_tick else "NOT a slurm-idle tick"
        return f"the tick lock is held by {who}{cmd}{held}: {kind}"


def flock_holders(path: str | os.PathLike[str], proc_locks: str | None = None) -> list[int]:
    """Pids holding a FLOCK on `path`, from /proc/locks (`proc_locks` is its text, for tests)."""
    st = os.stat(path)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    if proc_locks is None:
        proc_locks = Path("/proc/locks").read_text()
    pids = []
    for line in proc_locks.splitlines():
        words = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 fe:00:2156165 0 EOF" ("->" marks a waiter)
        if len(words) >= 6 and words[1] == "FLOCK" and words[5] == key and words[4].isdigit():
            pids.append(int(words[4]))
    return pids


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    # One line whatever it holds (a `python -c` script has newlines), printable only.
    text = raw.replace(b"\0", b" ").decode(errors="replace")
    return " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())


def inspect(path: str | os.PathLike[str], now: float, record: bool = True) -> Holder | None:
    """The holder of a lock we could not take, or None if it is free or cannot be told.

    A tick wrote `pid start_ts` in the file: held_s is exact. For anyone else the first
    sighting is kept beside the lock (BLOCKED_NAME), so held_s is a lower bound that grows
    across ticks; a different holder restarts it. `record=False` (status) only reads it.
    """
    p = Path(path)
    try:
        pids = flock_holders(p)
    except OSError:
        return None
    if not pids:
        return None
    pid = pids[0]
    words = lock_holder_text(p).split()
    if words and words[0] == str(pid):
        started = float(words[1]) if len(words) > 1 and _is_number(words[1]) else None
        return Holder(pid, _command(pid), True, None if started is None else now - started)
    seen = _first_seen(p, pid, now) if record else _seen_before(p, pid)
    return Holder(pid, _command(pid), False, None if seen is None else now - seen)


def _seen_before(p: Path, pid: int) -> float | None:
    words = lock_holder_text(p.parent / BLOCKED_NAME).split()
    if len(words) == 2 and words[0] == str(pid) and _is_number(words[1]):
        return float(words[1])
    return None


def lock_holder_text(p: Path) -> str:
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as fh:
            return fh.read(200)
    except OSError:
        return ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _first_seen(p: Path, pid: int, now: float) -> float:
    """When a locked-out tick first saw `pid` holding the lock (now, if this is the first)."""
    try:
        with checked_dir(p.parent, LOCK_DIR_MODE) as dfd:
            fd = open_in(dfd, BLOCKED_NAME, os.O_RDWR | os.O_CREAT, 0o600, str(p.parent / BLOCKED_NAME))
            with os.fdopen(fd, "r+") as fh:
                words = fh.read(100).split()
                if len(words) == 2 and words[0] == str(pid) and _is_number(words[1]):
                    return min(float(words[1]), now)
                fh.seek(0)
                fh.truncate()
                fh.write(f"{pid} {now:.0f}\n")
                return now
    except (OSError, SlurmIdleError):
        return now
