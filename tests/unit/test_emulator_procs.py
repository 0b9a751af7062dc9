"""The sandbox's pid handling: liveness from /proc (zombies are dead), recycled pids refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from slurm_idle.testing import procs


def test_zombie_counts_as_dead() -> None:
    """A child that exited but was not reaped (as under a PID 1 that never reaps) is not alive."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while procs.proc_state(child.pid) not in ("Z", None) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert procs.proc_state(child.pid) == "Z"
    os.kill(child.pid, 0)  # kill -0 still succeeds on a zombie ...
    assert not procs.alive(child.pid)  # ... but it is dead for us
    child.wait()


def test_pidfile_refuses_a_recycled_pid(tmp_path: Path) -> None:
    """A pid file whose recorded start time differs from the live process is treated as stale."""
    pf = procs.PidFile(tmp_path / "x.pidj")
    pf.write(os.getpid())
    assert pf.read() == os.getpid()
    data = json.loads(pf.path.read_text())
    pf.path.write_text(json.dumps({"pid": data["pid"], "start": data["start"] - 1}))
    assert pf.read() is None


def test_terminate_stops_by_pid_and_escalates(tmp_path: Path) -> None:
    """terminate() SIGTERMs, then SIGKILLs a process that ignores SIGTERM, and reports it."""
    code = ("import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    assert procs.terminate([stubborn.pid], timeout_s=0.5) == [stubborn.pid]
    stubborn.wait(5)
    assert not procs.alive(stubborn.pid)


def test_pids_with_env_finds_marked_processes() -> None:
    """Processes carrying a sandbox's marker are found by their environment, others are not."""
    marker = f"/tmp/unit-marker-{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         env={**os.environ, procs.MARKER: marker})
    try:
        found = procs.pids_with_env(lambda e: e.get(procs.MARKER) == marker)
        assert found == [p.pid]
    finally:
        p.kill()
        p.wait()
