"""Start, find and stop the sandbox's processes strictly by pid (never by name).

PID 1 on these machines does not reap orphans, so a stopped daemon lingers as <defunct>
and `kill -0` still succeeds: liveness is read from /proc/PID/status. A pid file holds the
pid and its start time, so a recycled pid is never mistaken for ours.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MARKER = "SLURM_IDLE_SANDBOX"  # env var set on every daemon we start: value = sandbox root


def proc_state(pid: int) -> str | None:
    """The one-letter State of a process, or None when it does not exist."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except (OSError, IndexError):
        return None
    return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def start_time(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class PidFile:
    path: Path

    def write(self, pid: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": pid, "start": start_time(pid)}))
        tmp.replace(self.path)

    def recorded(self) -> int | None:
        """The pid written, alive or not (the session its children still carry)."""
        try:
            return int(json.loads(self.path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def read(self) -> int | None:
        """The recorded pid if that very process is still alive."""
        try:
            data = json.loads(self.path.read_text())
            pid, start = int(data["pid"]), data.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not alive(pid) or (start is not None and start_time(pid) != start):
            return None
        return pid

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def spawn(argv: Sequence[str], log: Path, env: Mapping[str, str], pidfile: PidFile,
          cwd: Path | None = None, pass_fds: Sequence[int] = ()) -> int:
    """Start a foreground daemon detached from our session, logging to `log`; it inherits
    `pass_fds` (and no other descriptor of ours)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env=dict(env), cwd=cwd, start_new_session=True, close_fds=True,
                                pass_fds=tuple(pass_fds))
    pidfile.write(proc.pid)
    _children.append(proc)
    return proc.pid


_children: list[subprocess.Popen[bytes]] = []


def reap() -> None:
    """Collect exited children of this process (so they do not stay defunct)."""
    for p in list(_children):
        if p.poll() is not None:
            _children.remove(p)


def terminate(pids: Iterable[int], timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> list[int]:
    """SIGTERM the pids, wait, SIGKILL what is left; return pids that had to be killed."""
    pids = [p for p in pids if alive(p)]
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reap()
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.1)
    killed = [p for p in pids if alive(p)]
    for p in killed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in killed):
        reap()
        time.sleep(0.05)
    return killed


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def _other_pids() -> list[int]:
    """Every process on the machine but this one."""
    me = os.getpid()
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and int(d.name) != me]


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (state, ppid, pgrp, session, ...); [] if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def pids_with_env(match: Callable[[dict[str, str]], bool]) -> list[int]:
    """Live processes whose environment satisfies `match` (e.g. carries our marker)."""
    return [pid for pid in _other_pids() if alive(pid) and match(_environ(pid))]


def session_members(sid: int, cwd: Path) -> list[int]:
    """Live processes of session `sid` working in `cwd` or below (a process spawned here leads
    its own session, and its children stay in it unless they leave; the directory keeps a
    reused session id of someone else's out). Read from /proc/PID/stat and cwd, which a
    process cannot rewrite: vLLM's engine core and worker retitle themselves
    (setproctitle), which blanks their /proc/PID/environ, so an environment marker misses them."""
    root = cwd.resolve()
    found = []
    for pid in _other_pids():
        fields = _stat_fields(pid)
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] not in ("Z", "X"):
            try:
                where = Path(f"/proc/{pid}/cwd").resolve()
            except OSError:
                continue
            if where == root or root in where.parents:
                found.append(pid)
    return found


def wait_for(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1) -> float:
    """Poll `check` until true; return the seconds it took, raise TimeoutError naming `what`."""
    t0 = time.monotonic()
    while True:
        try:
            ready = bool(check())
        except (OSError, ValueError, subprocess.SubprocessError, http.client.HTTPException):
            ready = False  # a probe that cannot connect yet just means "not yet"
        if ready:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"sandbox: {what} not ready after {timeout_s:.0f}s")
        time.sleep(interval_s)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nobody listens on the port, checked as the sandbox's daemons bind (all of them with
    SO_REUSEADDR: Slurm, MariaDB, Prometheus, HAProxy, the emulators), so TIME_WAIT leftovers
    of our own last run do not count. Choosing a block for a new sandbox is stricter:
    ports.port_bindable."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return not port_open(port, host)


def dns_port_closed(host: str, tries: int = 5, pause_s: float = 0.2) -> bool:
    """Nothing serves DNS on host:53, UDP or TCP (nor on the wildcard address: a bind here then
    fails too), so a query sent there is refused at once.

    The test is a bind, and so is every other sandbox's same test: three test workers (and the
    other CI lane) starting sandboxes at once found each other's probe and failed their whole
    sandbox. A probe holds the port for microseconds, a server for good: it is asked `tries`
    times, `pause_s` apart, and only a port taken every time is a server's."""
    for attempt in range(tries):
        if attempt:
            time.sleep(pause_s)
        if _binds(host, 53):
            return True
    return False


def _binds(host: str, port: int) -> bool:
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def mounts_under(root: Path) -> list[str]:
    """Mount points below `root`, deepest first (to unmount dockerd's netns etc.)."""
    prefix = str(root).rstrip("/") + "/"
    points = []
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            mp = line.split()[1].replace("\\040", " ")
            if mp.startswith(prefix):
                points.append(mp)
    except OSError:
        return []
    return sorted(set(points), key=len, reverse=True)


def unmount_all(root: Path) -> list[str]:
    """Unmount everything below root (lazily if busy); return what is still mounted."""
    for mp in mounts_under(root):
        if subprocess.run(["umount", mp], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
    return mounts_under(root)
