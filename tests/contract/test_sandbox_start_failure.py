"""A sandbox start that fails leaves nothing running and says why in one line (no traceback)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_idle.testing import procs
from slurm_idle.testing.sandbox import Sandbox, pick_base_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox starts daemons: needs root"),
              pytest.mark.slurm]  # starts a Slurm of its own (no sandbox fixture)


@pytest.fixture
def sb_root() -> Iterator[Path]:
    # Short: MariaDB's and munge's unix socket paths must fit in 108 bytes.
    root = Path(f"/tmp/slurm-idle-sbfail-{os.getpid()}")
    yield root
    Sandbox(root).down()  # belt and braces: the tests assert there is nothing to stop
    shutil.rmtree(root, ignore_errors=True)


def listen_on(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_up_with_a_port_taken_prints_one_line_and_starts_nothing(sb_root: Path) -> None:
    """`scripts/sandbox up` (its Python entry point) with Prometheus's port taken: exit 1, one
    line on stderr naming the port, no process of this sandbox left."""
    base = pick_base_port()
    port = Sandbox(sb_root, base).layout.prometheus_port
    with listen_on(port):
        r = subprocess.run([sys.executable, "-m", "slurm_idle.testing.sandbox", "--root",
                            str(sb_root), "--base-port", str(base), "up"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"port {port}" in lines[0] and "Traceback" not in r.stderr
    assert procs.pids_with_env(lambda env: env.get(procs.MARKER) == str(sb_root)) == []


def test_a_start_failing_midway_stops_every_daemon_it_started(sb_root: Path) -> None:
    """Prometheus cannot bind (its port taken after the port check): by then munged, MariaDB,
    slurmdbd, slurmctld, 4 slurmd, dockerd and 4 emulators run. up() stops all of them and
    raises one error carrying Prometheus's own message from its log."""
    sb = Sandbox(sb_root, pick_base_port())
    sb._check_ports = lambda: None  # type: ignore[method-assign]  # the port check passed earlier
    with listen_on(sb.layout.prometheus_port), pytest.raises(RuntimeError) as err:
        sb.up(timeout_s=60)
    msg = str(err.value)
    assert "prometheus" in msg and "address already in use" in msg, msg
    assert sb._recorded() == {}
    assert procs.pids_with_env(sb._ours) == []
    assert procs.mounts_under(sb_root) == []


def test_demo_with_a_port_taken_prints_one_line_and_leaves_nothing(sb_root: Path) -> None:
    """`scripts/demo` (its Python entry point) on a sandbox whose port is taken: exit 1, one
    error line on stderr, no traceback, no process of that sandbox left."""
    base = pick_base_port()
    sb_root.mkdir(parents=True)
    (sb_root / "sandbox.json").write_text(f'{{"base_port": {base}}}')  # the ports `up` will use
    port = Sandbox(sb_root).layout.prometheus_port
    with listen_on(port):
        r = subprocess.run([sys.executable, "-m", "slurm_idle.testing.demo", "--root", str(sb_root)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"port {port}" in lines[0] and "Traceback" not in r.stderr
    assert procs.pids_with_env(lambda env: env.get(procs.MARKER) == str(sb_root)) == []
