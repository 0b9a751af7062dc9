"""Files the agent writes, attacked by an unprivileged local user (issue 11, items 3 and 4).

Run as root (like cron's ticks), with the attacker's steps run as `nobody` through setpriv:
- item 3: any user could take the 0644 lock in /run/lock through a read-only fd and freeze
  every tick; a holder that is not a tick was obeyed silently for ever;
- item 4: a symlink planted in a world-writable directory made root truncate (lock) or append
  to (journal) a file of root's choosing; a CSV output through a symlink likewise.
`fs.protected_symlinks` is 0 on these machines, so nothing but the agent itself stops it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_idle import safefiles
from slurm_idle.lock import try_lock

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="plays root (the agent) against nobody (the attacker): needs root and setpriv",
)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
CONFIG = """
engine: {{kind: command, start_command: "true {{node}}", stop_command: "true {{node}}"}}
models:
  - name: m
    nodes: gpu[1-2]
    url: "http://127.0.0.1:1/{{node}}"
slurm: {{bin_dir: {root}/no-slurm-here}}
timeouts: {{tick_budget_s: 1}}
paths:
  journal: {journal}
  lock: {lock}
  textfile: {textfile}
"""


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /run/lock: root-owned, mode 1777 (everyone may create names)."""
    path = Path(tempfile.mkdtemp(prefix="h11-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def private() -> Iterator[Path]:
    """A root-owned 0755 directory: where the agent's files belong."""
    path = Path(tempfile.mkdtemp(prefix="h11-private-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim(private: Path) -> Path:
    """A root-owned 0600 file the attacker wants root to overwrite."""
    path = private / "secret"
    path.write_text("root's secret\n")
    path.chmod(0o600)
    return path


def as_nobody(*argv: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60,
                          check=False, **kw)


def write_config(where: Path, **paths: Path) -> Path:
    values = {"journal": where / "j" / "journal.jsonl", "lock": where / "run" / "tick.lock",
              "textfile": where / "t" / "slurm_idle.prom", **paths}
    cfg = where / "c.yaml"
    cfg.write_text(CONFIG.format(root=where, **values))
    return cfg


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


HOLD = ("import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")


def test_another_user_cannot_take_the_tick_lock(private: Path) -> None:
    """The lock a root tick made is 0600 in a 0700 directory: `nobody` cannot open it, so
    cannot flock it, so the next tick still gets it. (Before: a 0644 file, read-only flock.)"""
    lock = private / "run" / "tick.lock"
    with try_lock(lock) as got:
        assert got
    assert lock.parent.stat().st_mode & 0o777 == 0o700
    assert lock.stat().st_mode & 0o777 == 0o600
    # Even with the directory opened up (an admin's chmod), the file alone keeps them out.
    lock.parent.chmod(0o755)
    proc = as_nobody(sys.executable, "-c", HOLD, str(lock))
    assert proc.returncode != 0 and "Permission denied" in proc.stderr
    with try_lock(lock) as got:
        assert got


def test_a_stranger_holding_the_lock_past_the_budget_is_reported(private: Path) -> None:
    """A process that is not a tick (here root's `python -c flock`) holds the lock: the first
    locked-out tick notes it; once it has held it longer than the tick budget (1 s here) the
    tick exits 1 with one line naming the pid, the textfile says so (alert
    SlurmIdleTickLockHeld) and `status` warns. Before, every tick exited 0 for ever."""
    cfg = write_config(private)
    lock = private / "run" / "tick.lock"
    with try_lock(lock) as got:
        assert got
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        first = cli("--config", str(cfg), "tick", "-v")  # locked out: silent without -v
        assert first.returncode == 0 and "another tick is running" in first.stderr
        time.sleep(1.5)
        second = cli("--config", str(cfg), "tick")
        assert second.returncode == 1, second.stderr
        assert "Traceback" not in second.stderr
        line = second.stderr.strip().splitlines()[-1]
        assert f"pid {holder.pid}" in line and "NOT a slurm-idle tick" in line
        text = (private / "t" / "slurm_idle.prom").read_text()
        assert f'slurm_idle_lock_blocked_seconds{{pid="{holder.pid}"' in text
        from slurm_idle.cli.tick_cmd import _lock_warning

        (warning,) = _lock_warning(str(lock), time.time())
        assert f"pid {holder.pid}" in warning and "NOT a slurm-idle tick" in warning
    finally:
        holder.kill()
        holder.wait()
    third = cli("--config", str(cfg), "tick")  # released: ticks run again (and fail on Slurm)
    assert "another tick" not in third.stderr and "NOT a slurm-idle" not in third.stderr


def test_a_lock_symlink_in_a_world_writable_directory_is_refused(
    shared: Path, private: Path, victim: Path
) -> None:
    """The old default (/run/lock, 1777) with `nobody`'s symlink to a root 0600 file: the tick
    refuses the directory in one line, and the file is untouched (before: truncated)."""
    assert as_nobody("ln", "-s", str(victim), str(shared / "slurm-idle.lock")).returncode == 0
    cfg = write_config(private, lock=shared / "slurm-idle.lock")
    proc = cli("--config", str(cfg), "tick")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "writable by group or others" in proc.stderr.strip().splitlines()[-1]
    assert victim.read_text() == "root's secret\n"


def test_a_journal_symlink_is_never_appended_to(shared: Path, private: Path, victim: Path) -> None:
    """A journal path in a shared directory, symlinked by `nobody`: refused, victim intact."""
    assert as_nobody("ln", "-s", str(victim), str(shared / "journal.jsonl")).returncode == 0
    cfg = write_config(private, journal=shared / "journal.jsonl")
    proc = cli("--config", str(cfg), "tick")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "unsafe journal" in proc.stderr
    assert victim.read_text() == "root's secret\n"


def test_a_symlink_at_a_name_in_a_safe_directory_is_not_followed(private: Path, victim: Path) -> None:
    """A symlink already sitting at the journal's or lock's name (owned by anyone) is refused
    (O_NOFOLLOW); the textfile's rename replaces such a name instead of writing through it."""
    (private / "j").mkdir()
    (private / "j" / "journal.jsonl").symlink_to(victim)
    (private / "run").mkdir(mode=0o700)
    (private / "run" / "tick.lock").symlink_to(victim)
    (private / "t").mkdir()
    (private / "t" / "slurm_idle.prom").symlink_to(victim)
    with pytest.raises(safefiles.UnsafePath, match="symlink"):
        safefiles.append_line(private / "j" / "journal.jsonl", b"x\n")
    from slurm_idle.errors import SlurmIdleError

    with pytest.raises(SlurmIdleError, match="symlink"), try_lock(private / "run" / "tick.lock"):
        pass
    from slurm_idle.agent_metrics import add_transitions

    add_transitions(private / "t" / "slurm_idle.prom", [("serving", "retiring")])
    assert not (private / "t" / "slurm_idle.prom").is_symlink()
    assert victim.read_text() == "root's secret\n"


def test_a_hard_link_to_a_root_file_is_refused(private: Path, victim: Path) -> None:
    """A name that is a second link to another file (e.g. made while the dir was open) is not
    written either."""
    (private / "j").mkdir()
    os.link(victim, private / "j" / "journal.jsonl")
    with pytest.raises(safefiles.UnsafePath, match="single link"):
        safefiles.append_line(private / "j" / "journal.jsonl", b"x\n")
    assert victim.read_text() == "root's secret\n"


def test_a_directory_owned_by_another_user_is_refused(private: Path) -> None:
    """A journal directory `nobody` made first (e.g. in /tmp) is not used."""
    theirs = private / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(safefiles.UnsafePath, match="owned by uid 65534"):
        safefiles.append_line(theirs / "journal.jsonl", b"x\n")


def test_a_report_csv_through_a_symlink_is_refused(shared: Path, victim: Path) -> None:
    """root's `report --csv /shared/out.csv` where `nobody` planted out.csv -> victim."""
    assert as_nobody("ln", "-s", str(victim), str(shared / "out.csv")).returncode == 0
    from slurm_idle.errors import SlurmIdleError
    from slurm_idle.report_io import write_csv

    with pytest.raises(SlurmIdleError, match="--csv .*symlink"):
        write_csv(object(), str(shared / "out.csv"))  # type: ignore[arg-type]
    assert victim.read_text() == "root's secret\n"


def test_files_are_still_written_in_checked_directories(private: Path) -> None:
    """The ordinary case: missing directories are created (lock's 0700) and files written."""
    safefiles.append_line(private / "a" / "b" / "journal.jsonl", b"x\n")
    safefiles.atomic_write(private / "c" / "state.json", "{}")
    assert (private / "a" / "b" / "journal.jsonl").read_text() == "x\n"
    assert (private / "c" / "state.json").stat().st_mode & 0o777 == 0o644
    link = private / "link"
    link.symlink_to(private / "a")  # root's own symlink on the way is followed
    safefiles.append_line(link / "b" / "journal.jsonl", b"y\n")
    assert (private / "a" / "b" / "journal.jsonl").read_text() == "x\ny\n"
