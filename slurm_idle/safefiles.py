"""Opening the files the agent writes (lock, journal, scrape state, textfile) so that nobody
else can redirect or hold them.

The agent runs as root from cron. A file it opens by path in a directory another user can
write (`/run/lock` is 1777, and `fs.protected_symlinks` may be 0) can be a symlink planted to
make root truncate or append to any file, or a file someone else created and holds. So:

- the directory is reached component by component with `openat` and O_NOFOLLOW; a symlink on
  the way is followed only when root or we own it (what `fs.protected_symlinks` would enforce);
  every directory on the way is owned by root or us, and the last one is writable by nobody
  else (an ancestor may be world-writable only with the sticky bit, like /tmp);
- missing directories are created with the mode asked for (0700 for the lock's);
- the file is opened relative to that directory's fd with O_NOFOLLOW, and must be a regular
  file we own with one link (a hard link to /etc/shadow is refused too);
- replacing a file is a temp file made with O_EXCL in the same directory, then a rename:
  the rename replaces whatever name was there, symlink included, and never follows it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from slurm_idle.errors import ConfigError, SlurmIdleError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40


class UnsafePath(SlurmIdleError):
    """A path the agent will not write through: someone else could redirect or replace it."""


def _trusted_owner(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def _check_dir(st: os.stat_result, where: str, last: bool) -> None:
    if not _trusted_owner(st):
        raise UnsafePath(f"{where} is owned by uid {st.st_uid}, not root or this user")
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if others_write and (last or not st.st_mode & stat.S_ISVTX):
        raise UnsafePath(
            f"{where} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
            "another user could plant a symlink or a file there; use a root-owned directory"
        )


@contextmanager
def checked_dir(path: str | os.PathLike[str], mode: int = 0o755) -> Iterator[int]:
    """An fd of directory `path`, created (with `mode`) if missing, after the checks above."""
    try:
        fd = _walk(path, mode)
    except OSError as exc:
        raise UnsafePath(f"cannot use directory {path}: {exc.strerror or exc}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _walk(path: str | os.PathLike[str], mode: int | None, sticky_last_ok: bool = False) -> int:
    """`mode` None: a missing directory is an error, not created. `sticky_last_ok`: the last
    directory may be a sticky world-writable one like /tmp (a user's output file goes there)."""
    parts = list(Path(os.path.abspath(path)).parts[1:])
    fd = os.open("/", _DIR_FLAGS)
    where = "/"
    links = 0
    try:
        _check_dir(os.fstat(fd), where, not parts and not sticky_last_ok)
        while parts:
            name = parts.pop(0)
            if name in ("", "."):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if mode is None:
                    raise
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                except FileExistsError:
                    pass  # made by another thread or process just now: checked like any other
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if not _trusted_owner(st) or links > _MAX_LINKS:
                    raise UnsafePath(
                        f"{os.path.join(where, name)} is a symlink owned by uid {st.st_uid}: "
                        "not followed (only root's or this user's symlinks are)"
                    )
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd, where = os.open("/", _DIR_FLAGS), "/"
                    parts[:0] = list(Path(target).parts[1:])
                else:
                    parts[:0] = list(Path(target).parts)
                continue
            new = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd, where = new, os.path.join(where, name)
            _check_dir(os.fstat(fd), where, not parts and not sticky_last_ok)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(fd: int, where: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        raise UnsafePath(
            f"{where} is not a regular file of this user with a single link (uid {st.st_uid}, "
            f"{st.st_nlink} links): refusing to write it; remove it and let slurm-idle recreate it"
        )


def open_in(dir_fd: int, name: str, flags: int, mode: int, where: str) -> int:
    """Open `name` in a checked directory without following a symlink; check what it is."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the name is a symlink
            raise UnsafePath(f"{where} is a symlink: refusing to follow it") from None
        raise
    try:
        _check_file(fd, where)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_line(path: str | os.PathLike[str], data: bytes, dir_mode: int = 0o755) -> None:
    """Append `data` in one write() (O_APPEND), creating the file 0644 if missing."""
    p = Path(path)
    with checked_dir(p.parent, dir_mode) as dfd:
        fd = open_in(dfd, p.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, str(p))
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def read_text(path: str | os.PathLike[str]) -> str | None:
    """A file's text read without following a symlink (None if missing)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as fh:
        return fh.read()


def atomic_write(
    path: str | os.PathLike[str],
    text: str,
    mode: int = 0o644,
    before_replace: Callable[[str], None] | None = None,
) -> None:
    """Replace `path` with `text`: readers see the old or the new file, never a mix.

    The temp name (`.<name>.<pid>.<n>.tmp`) does not end like the target, so a textfile
    collector ignores it; it is made with O_EXCL, so a planted name makes us fail, not follow.
    `before_replace` gets the temp file's path just before the rename (tests look at it).
    """
    p = Path(path)
    with checked_dir(p.parent) as dfd:
        for n in range(100):
            tmp = f".{p.name}.{os.getpid()}.{n}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        else:
            raise UnsafePath(f"cannot make a temp file beside {p}: 100 names taken")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fchmod(fh.fileno(), mode)  # node_exporter may run as another user
                os.fsync(fh.fileno())
            if before_replace is not None:
                before_replace(str(p.parent / tmp))
            os.replace(tmp, p.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise


def check_output(path: str | os.PathLike[str], option: str) -> None:
    """Refuse up front, before any work, an output `open_output` would refuse (ConfigError)."""
    p = Path(os.path.abspath(path))
    try:
        os.close(_walk(p.parent, None, sticky_last_ok=True))
        st = os.stat(p, follow_symlinks=False)
    except FileNotFoundError:
        if not os.path.isdir(p.parent):
            raise ConfigError(f"{option} {path}: no such directory {p.parent}") from None
        return
    except UnsafePath as exc:
        raise ConfigError(f"{option} {path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{option} {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{option} {path}: is a symlink: refusing to follow it")


def open_output(path: str | os.PathLike[str], option: str) -> int:
    """An fd for an output file a user named (`report --csv`, `simulate --timeline`, a plot):
    truncated, never through someone else's symlink or directory, never someone else's file.

    Root runs these commands in shared places: a user's symlink at `/tmp/x.csv` or a user's
    directory (or symlink to one) on the way could make root truncate any file. The directory
    is walked like the agent's (a sticky, world-writable one like /tmp is fine); the file is
    opened without following a symlink. Refusals are ConfigError (exit 2) naming `option`.
    """
    p = Path(os.path.abspath(path))
    try:
        dfd = _walk(p.parent, None, sticky_last_ok=True)
        try:
            # O_NONBLOCK: a FIFO planted under the name fails (ENXIO) instead of hanging.
            fd = open_in(dfd, p.name, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644, str(path))
        finally:
            os.close(dfd)
    except UnsafePath as exc:
        raise ConfigError(f"{option} {path}: {exc}") from None
    except OSError as exc:
        if os.path.islink(p):  # the kernel's protected_symlinks may say EACCES before ELOOP
            raise ConfigError(f"{option} {path}: is a symlink: refusing to follow it") from None
        raise ConfigError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None
    try:
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
