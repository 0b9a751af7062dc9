"""Rootless podman for the runner: a private runtime directory, and an API service that outlives
Slurm's signal to the job step (the runner still needs it to stop and remove the container)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurm_idle import podman
from slurm_idle.podman import PodmanService, runtime_dir
from slurm_idle.testing.waiting import poll

UID = os.geteuid()
OTHER_UID = UID + 4242


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """runtime_dir's /tmp and /run/user, inside the test's own directory."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(podman, "SHARED_TMP", str(shared))
    monkeypatch.setattr(podman, "RUN_USER", str(tmp_path / "run-user"))
    return shared


def private_dir(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o700)
    return path


def test_a_private_xdg_runtime_dir_is_used(tmp_root: Path, tmp_path: Path) -> None:
    xdg = private_dir(tmp_path / "xdg")
    assert runtime_dir(UID, {"XDG_RUNTIME_DIR": str(xdg)}) == str(xdg)


@pytest.mark.parametrize("how", ["symlink", "open to others", "another uid's"])
def test_an_xdg_runtime_dir_not_private_to_the_user_is_not_used(
    tmp_root: Path, tmp_path: Path, how: str
) -> None:
    """lstat: a symlink (even to a private dir of ours), mode 0755 or another owner is passed over."""
    xdg = tmp_path / "xdg"
    if how == "symlink":
        xdg.symlink_to(private_dir(tmp_path / "mine"))
    elif how == "open to others":
        private_dir(xdg).chmod(0o755)
    else:
        if UID != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(private_dir(xdg), OTHER_UID, OTHER_UID)
    assert runtime_dir(UID, {"XDG_RUNTIME_DIR": str(xdg)}) == str(tmp_root / f"slurm-idle-runtime-{UID}")


@pytest.mark.parametrize("how", ["symlink", "another uid's", "open to others"])
def test_a_squatted_shared_runtime_dir_gives_a_fresh_private_one(
    tmp_root: Path, tmp_path: Path, how: str
) -> None:
    """Another user made /tmp/slurm-idle-runtime-UID first: the job still runs, in a fresh
    0700 directory with an unpredictable name, and says why (it used to fail every job, 70)."""
    squatted = tmp_root / f"slurm-idle-runtime-{UID}"
    if how == "symlink":
        squatted.symlink_to(private_dir(tmp_path / "theirs"))
    elif how == "open to others":
        squatted.mkdir()
        squatted.chmod(0o777)
    else:
        if UID != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(private_dir(squatted), OTHER_UID, OTHER_UID)
    said: list[str] = []
    path = Path(runtime_dir(UID, {}, said.append))
    assert path.parent == tmp_root and path != squatted
    assert path.name.startswith(f"slurm-idle-runtime-{UID}-")
    st = os.lstat(path)
    assert st.st_uid == UID and (st.st_mode & 0o777) == 0o700
    assert len(said) == 1 and str(squatted) in said[0] and str(path) in said[0]


def test_the_shared_runtime_dir_is_reused_when_it_is_ours(tmp_root: Path) -> None:
    first = runtime_dir(UID, {})
    assert runtime_dir(UID, {}) == first == str(tmp_root / f"slurm-idle-runtime-{UID}")


# ------------------------------------------------------ the API service and Slurm's signal

FAKE_PODMAN = """#!/bin/sh
# `podman system service --time=0 unix://SOCK`: the socket exists while it serves; SIGTERM
# ends it and removes the socket, as podman does.
sock=${4#unix://}
trap 'rm -f "$sock"; exit 0' TERM
: > "$sock"
while :; do sleep 0.05; done
"""

RUNNER = """
import os, signal, sys
from slurm_idle.podman import PodmanService
signal.signal(signal.SIGTERM, lambda *_: None)  # the runner handles Slurm's SIGTERM
service = PodmanService(sys.argv[1], dict(os.environ), podman=sys.argv[2])
service.start(timeout_s=20)
print(service.pid, flush=True)
sys.stdin.readline()
service.stop()
print("stopped", flush=True)
"""


def descendants(root: int) -> list[int]:
    """Every process under `root` by parent pid: what proctrack/linuxproc signals."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_fakes(sock: Path) -> None:
    """Whatever fake service of this test still runs (also when the runner failed early)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(sock).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_the_service_outlives_slurms_sigterm_to_the_job_step(tmp_path: Path) -> None:
    """Slurm SIGTERMs the step's process group and every descendant of it (proctrack/linuxproc):
    the API service is neither, so the socket is still there for the runner to stop and remove
    the container; the runner's stop ends it. (A child service died here, socket and all: the
    runner could not signal the container, exited 1, and the container outlived the job.)"""
    fake = tmp_path / "podman"
    fake.write_text(FAKE_PODMAN)
    fake.chmod(0o755)
    sock = tmp_path / "job.sock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(sock), str(fake)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    service_pid = 0
    try:
        assert runner.stdout is not None and runner.stdin is not None
        service_pid = int(runner.stdout.readline())
        assert sock.exists() and alive(service_pid)
        # What Slurm's signal reaches, by process tree and group: not the service.
        assert service_pid not in descendants(runner.pid)
        assert os.getpgid(service_pid) != runner.pid
        os.killpg(runner.pid, signal.SIGTERM)
        for pid in descendants(runner.pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        runner.stdin.write("go\n")
        runner.stdin.flush()
        assert runner.stdout.readline().strip() == "stopped"
        assert runner.wait(20) == 0
        assert not sock.exists() and not alive(service_pid)
    finally:
        runner.kill()
        runner.wait()
        kill_fakes(sock)


def test_the_service_ends_when_the_runner_is_killed(tmp_path: Path) -> None:
    """Slurm SIGKILLs a runner that outlives KillWait: no `stop` runs, and the detached service
    (no idle timeout) would serve on forever; its watchdog ends it."""
    fake = tmp_path / "podman"
    fake.write_text(FAKE_PODMAN)
    fake.chmod(0o755)
    sock = tmp_path / "job.sock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(sock), str(fake)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    service_pid = 0
    try:
        assert runner.stdout is not None
        service_pid = int(runner.stdout.readline())
        runner.kill()
        runner.wait()
        # The watchdog looks every 2 s: a generous deadline, not a timing.
        poll(lambda: not alive(service_pid) and not sock.exists(), 60,
             "the watchdog ending the service", interval_s=0.2)
    finally:
        runner.kill()
        kill_fakes(sock)


def test_a_service_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "podman"
    fake.write_text("#!/bin/sh\necho 'cannot set up namespace' >&2\nexit 125\n")
    fake.chmod(0o755)
    service = PodmanService(str(tmp_path / "s.sock"), dict(os.environ), podman=str(fake))
    with pytest.raises(podman.SlurmIdleError, match="service exited: cannot set up namespace"):
        service.start(timeout_s=20)
    missing = PodmanService(str(tmp_path / "s.sock"), dict(os.environ), podman="no-such-podman")
    with pytest.raises(podman.SlurmIdleError, match="no-such-podman not found"):
        missing.start()


FLAKY_PODMAN = """#!/bin/sh
# Exits without a word the first time (a marker file remembers), then serves as FAKE_PODMAN.
marker="$(dirname "$0")/tried"
if [ ! -e "$marker" ]; then : > "$marker"; exit 1; fi
""" + FAKE_PODMAN.split("\n", 1)[1]


def test_a_service_that_exits_silently_is_started_once_more(tmp_path: Path) -> None:
    """A service gone before its socket without a word on stderr gets one more start (CI saw
    one such exit fail a requeued job with 70); one that keeps exiting silently fails after
    the second start, naming what happened."""
    fake = tmp_path / "podman"
    fake.write_text(FLAKY_PODMAN)
    fake.chmod(0o755)
    sock = tmp_path / "s.sock"
    service = PodmanService(str(sock), dict(os.environ), podman=str(fake))
    try:
        assert service.start(timeout_s=20) == f"unix://{sock}"
        assert (tmp_path / "tried").exists() and service.running()
    finally:
        service.stop()
    silent = tmp_path / "silent"
    silent.mkdir()
    (silent / "podman").write_text("#!/bin/sh\nexit 1\n")
    (silent / "podman").chmod(0o755)
    never = PodmanService(str(silent / "s.sock"), dict(os.environ), podman=str(silent / "podman"))
    with pytest.raises(podman.SlurmIdleError, match="exited without an error message"):
        never.start(timeout_s=20)


# ------------------------------------------------------ without the API: the podman command

FAKE_CLI = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
case "$1" in ps) echo slurm-idle-7-r1;; rm) exit 0;; esac
"""


def test_without_the_service_the_jobs_containers_go_through_the_podman_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary: Any
) -> None:
    """The service died under the runner (Slurm signalled every process of the step): the
    runner's exit stops (grace, then kill) and removes the job's containers with `podman`."""
    import argparse
    import io

    from slurm_idle.runner.cli import _sweep_without_api
    from slurm_idle.runner.supervise import Reporter

    fake = tmp_path / "podman"
    fake.write_text(FAKE_CLI)
    fake.chmod(0o755)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    service = PodmanService(str(tmp_path / "s.sock"), dict(os.environ), podman=str(fake))
    out = io.BytesIO()
    _sweep_without_api(service, argparse.Namespace(grace_s=5.0), None, Reporter(out))
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("ps -a --filter label=slurm-idle.job-id=7")
    assert calls[1] == "rm --force --time 5 slurm-idle-7-r1"
    assert "removed container slurm-idle-7-r1 with the podman command" in out.getvalue().decode()
