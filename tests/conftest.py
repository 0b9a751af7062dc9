"""Shared fixtures: one real sandbox cluster per test session, started only when asked for.

The `sandbox` fixture brings up `slurm_idle.testing.sandbox.Sandbox` under
/tmp/slurm-idle-sandbox-test-<pid> on free ports the first time a test requests it, and
always stops it (by pid) at the end of the session, also on failure or Ctrl-C. Set
SLURM_IDLE_KEEP_SANDBOX=1 to keep its directory (logs) afterwards.
"""

from __future__ import annotations

import atexit
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_report_header() -> str:
    """Which Slurm release the contract and e2e tests run against (some differ by release)."""
    import subprocess

    try:
        out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=10,
                             check=False).stdout.strip()
    except OSError:
        out = ""
    return f"slurm: {out or 'not installed'}"


@pytest.fixture(scope="session")
def sandbox() -> Iterator[object]:
    """A running sandbox (Slurm, slurmdbd, dockerd, Prometheus, 4 emulators) for the session."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox starts Slurm/dockerd daemons and needs root")
    from slurm_idle.testing.sandbox import Sandbox

    root = Path(f"/tmp/slurm-idle-sandbox-test-{os.getpid()}")
    sb = Sandbox(root)
    done = False

    def stop() -> dict[str, object]:
        nonlocal done
        done = True
        return sb.down()

    # Belt and braces: if pytest dies before fixture teardown (e.g. a second Ctrl-C).
    atexit.register(lambda: None if done else stop())
    try:
        sb.up()
        yield sb
    finally:
        result = stop()
        if result["left"] or result["mounts_left"]:
            pytest.fail(f"sandbox down left processes {result['left']} / mounts {result['mounts_left']}")
        if not os.environ.get("SLURM_IDLE_KEEP_SANDBOX"):
            shutil.rmtree(root, ignore_errors=True)
