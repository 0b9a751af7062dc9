"""Output files a user names (`report --csv`, `simulate --timeline`) are never written through
another user's symlink or directory: root runs these commands in shared places like /tmp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_idle.errors import ConfigError
from slurm_idle.report_io import make_report, write_csv
from slurm_idle.safefiles import open_output

from .test_report_io import CONFIG, parse_config

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _victim(tmp_path: Path) -> Path:
    secret = tmp_path / "root-only" / "victim"
    secret.parent.mkdir()
    secret.write_text("keep me\n")
    secret.chmod(0o600)
    return secret


def _shared(tmp_path: Path) -> Path:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    return shared


@needs_root
def test_a_users_symlink_as_the_file_is_not_followed(tmp_path: Path) -> None:
    """`simulate --timeline /tmp/x.csv` where a user made x.csv a symlink: exit 2, target intact."""
    secret, shared = _victim(tmp_path), _shared(tmp_path)
    link = shared / "x.csv"
    link.symlink_to(secret)
    os.lchown(link, NOBODY, NOBODY)
    done = subprocess.run([sys.executable, "-m", "slurm_idle.cli", "simulate", "--synthetic",
                           "--days", "1", "--timeline", str(link)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "--timeline" in done.stderr and "symlink" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert secret.read_text() == "keep me\n"


@needs_root
def test_a_users_symlinked_directory_is_not_followed(tmp_path: Path) -> None:
    """`report --csv /tmp/dir/victim` through a user's symlink to root's directory: refused."""
    secret, shared = _victim(tmp_path), _shared(tmp_path)
    (shared / "dir").symlink_to(secret.parent)
    os.lchown(shared / "dir", NOBODY, NOBODY)
    report = make_report(parse_config(CONFIG), 0.0, 86400.0, 86400.0, [],
                         journal_path=str(tmp_path / "none.jsonl"))
    with pytest.raises(ConfigError, match="--csv .*symlink owned by uid 65534"):
        write_csv(report, str(shared / "dir" / "victim"))
    assert secret.read_text() == "keep me\n"


@needs_root
def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    """A user's own directory on the way could be swapped under root: refused, nothing made."""
    shared = _shared(tmp_path)
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        open_output(theirs / "out.csv", "--csv")
    assert not (theirs / "out.csv").exists()


def test_a_file_in_a_sticky_shared_directory_is_written(tmp_path: Path) -> None:
    """/tmp itself is fine: a new file there, or our own old one (truncated)."""
    out = _shared(tmp_path) / "out.csv"
    out.write_text("old old old\n")
    with os.fdopen(open_output(out, "--csv"), "w") as fh:
        fh.write("new\n")
    assert out.read_text() == "new\n"
