"""Shared fixtures: one real sandbox cluster per test session, started only when asked for.

The `sandbox` fixture brings up `slurm_idle.testing.sandbox.Sandbox` under
/tmp/slurm-idle-sandbox-test-<pid> on free ports the first time a test requests it, and
always stops it (by pid) at the end of the session, also on failure or Ctrl-C. Set
SLURM_IDLE_KEEP_SANDBOX=1 to keep its directory (logs) afterwards.

Every test that touches a real Slurm gets the `slurm` marker here, at collection, so the Slurm
24.11 lane of CI can run exactly those (`-m slurm`; see .ci/run and docs/slurm-releases.md):
the tests that use the `sandbox` fixture (directly or through another fixture), every test
under tests/e2e, tests marked `slurm` by hand (those that start a Slurm of their own), and, as
a safety net, every test in a module that runs a Slurm command or daemon. Deriving it from
fixture use and source means a new contract test cannot drop out of that lane by a forgotten
marker; a test marked by mistake only costs the lane its run time.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

E2E_DIR = Path(__file__).resolve().parent / "e2e"
UNIT_DIR = Path(__file__).resolve().parent / "unit"
# A Slurm command, daemon or the sandbox class named in a test module's source.
SLURM_WORDS = re.compile(r"\b(sbatch|srun|salloc|scontrol|squeue|sinfo|sacct|scancel|slurmctld|"
                         r"slurmd|slurmdbd|Sandbox)\b")


@functools.cache
def runs_slurm(module: Path) -> bool:
    """The module's source names a Slurm command or daemon (unit tests excepted: they are pure
    and only parse captured output)."""
    if UNIT_DIR in module.parents:
        return False
    try:
        return SLURM_WORDS.search(module.read_text(errors="replace")) is not None
    except OSError:
        return False


def touches_slurm(item: Any) -> bool:
    """Whether the test's outcome can depend on the Slurm release: it uses the session sandbox
    (Slurm, slurmdbd), lives in tests/e2e, is marked `slurm` (starts a Slurm itself), or its
    module runs Slurm commands."""
    path = Path(str(item.path)).resolve()
    return ("sandbox" in getattr(item, "fixturenames", ())
            or E2E_DIR in path.parents
            or item.get_closest_marker("slurm") is not None
            or runs_slurm(path))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if touches_slurm(item):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(autouse=True, scope="module")
def _environment_as_found() -> Iterator[None]:
    """A module leaves the process environment as it found it. Sharded, the modules of a
    worker run one after the other in one process, in no fixed order: an in-process agent
    (the story's, the topology scenario's) sets the sandbox's SLURM_CONF, SLURM_IDLE_CONFIG,
    DOCKER_HOST and PATH, which a later module would otherwise inherit."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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
