"""Local users the tests act as (a researcher, an attacker), made once and race-free.

Several test modules need the same unprivileged account (`sidle-ci`, a researcher who submits
rootless container jobs; `sidle-attacker`), and with the suite sharded over workers two of
them may ask at the same moment: a plain "getpwnam, else useradd" would let both run useradd
and one fail on "user already exists". A lock file (root's, in /run) orders them.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import subprocess

LOCK = "/run/slurm-idle-test-users.lock"


def ensure_user(name: str) -> pwd.struct_passwd:
    """The account `name`, made (with a home and /bin/sh) if missing; its home made if an
    older run made the account without one."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True,
                           capture_output=True)
            pw = pwd.getpwnam(name)
        if not os.path.isdir(pw.pw_dir):
            os.makedirs(pw.pw_dir, mode=0o755)
            os.chown(pw.pw_dir, pw.pw_uid, pw.pw_gid)
        return pw
    finally:
        os.close(fd)
