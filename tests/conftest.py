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
        if starts_real_vllm(item) or item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


def starts_real_vllm(item: Any) -> bool:
    """Whether the test starts a real vLLM: it needs its venv (the `real_vllm_python` fixture,
    directly or through another), so `-m vllm` selects by what a test really starts."""
    return "real_vllm_python" in getattr(item, "fixturenames", ())


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


REAL_VLLM_TURN = Path("/tmp/slurm-idle-real-vllm.lock")


@pytest.fixture(scope="module")
def real_vllm_turn() -> Iterator[None]:
    """One module that runs real vLLM servers at a time on this machine (an flock held for the
    module): sharded, two such modules on two workers would each load a model and answer
    seconds late on two cores, which the contract tests would read as the server's behaviour.
    A module waits its turn and says how long it waited."""
    import fcntl
    import time

    with REAL_VLLM_TURN.open("a") as lock:
        t0 = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.monotonic() - t0
        if waited > 1:
            print(f"real vLLM: waited {waited:.0f}s for another module's servers to stop")
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def real_vllm_python() -> Path:
    """The python of the real vLLM's venv, made on first use (minutes; scripts/lib/vllm-env.sh).
    Skipped with the reason where it cannot be made, a failure instead when
    SLURM_IDLE_REAL_VLLM_REQUIRED=1 (CI); SLURM_IDLE_REAL_VLLM_TESTS=0 skips (the Debian 13
    lane: a real vLLM does not depend on the Slurm release and runs in the Debian 12 lane)."""
    if os.environ.get("SLURM_IDLE_REAL_VLLM_TESTS") == "0":
        pytest.skip("SLURM_IDLE_REAL_VLLM_TESTS=0: the real vLLM runs in another lane")
    from slurm_idle.testing.real_vllm import RealVllmUnavailable, ensure_venv

    try:
        return ensure_venv()
    except RealVllmUnavailable as exc:
        if os.environ.get("SLURM_IDLE_REAL_VLLM_REQUIRED") == "1":
            pytest.fail(f"no real vLLM: {exc}")
        pytest.skip(f"no real vLLM: {exc}")
