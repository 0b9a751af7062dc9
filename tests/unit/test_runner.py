"""The in-job runner: what it asks the engine for, and how it reacts to exits and signals."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from slurm_idle import runlog
from slurm_idle.commands import ReplayRunner
from slurm_idle.errors import CommandError
from slurm_idle.jobs import parse_job_spec
from slurm_idle.runner import (
    EXIT_MAX_RESTARTS,
    EXIT_PREEMPTED,
    EXIT_REQUEUE_ME,
    EXIT_START_FAILED,
    LABEL_JOB,
    PARAMS_TARGET,
    Reporter,
    RunSettings,
    Signals,
    SlurmContext,
    container_kwargs,
    mem_bytes,
    preempted_in_this_run,
    requeue_if_preempted,
    run_container,
    slurm_context,
    wants_device_requests,
)

# ---------------------------------------------------------------- a fake engine


class FakeContainer:
    def __init__(self, client: FakeClient, kwargs: dict[str, Any]) -> None:
        self.client = client
        self.kwargs = kwargs
        self.id = f"id-{kwargs['name']}"
        self.name = kwargs["name"]
        self.labels = kwargs.get("labels", {})
        self.kills: list[str] = []
        self.removed = False
        self._exited = threading.Event()
        self._code = 0
        # How long the engine takes to hand over an exit code (wait() returning): the race
        # of an exit and a stop signal.
        self.exit_code_delay_s = 0.0
        self.status = "running"

    def exit(self, code: int) -> None:
        self._code = code
        self._exited.set()

    def reload(self) -> None:
        self.status = "exited" if self._exited.is_set() else "running"

    def start(self) -> None:
        if self.client.fail_start:
            raise docker.errors.APIError("start failed")
        self.client.on_start(self)

    def wait(self) -> dict[str, int]:
        self._exited.wait(10)
        time.sleep(self.exit_code_delay_s)
        return {"StatusCode": self._code}

    def logs(self, stream: bool, follow: bool) -> Any:
        yield b"hello from the container\n"

    def kill(self, signal: str) -> None:
        if self._exited.is_set():  # as dockerd: 409 Conflict, the container is not running
            raise docker.errors.APIError(f"container {self.id} is not running")
        self.kills.append(signal)
        if signal == "SIGKILL" or (signal == "SIGTERM" and self.client.exits_on_term):
            self.exit(137 if signal == "SIGKILL" else 143)

    def remove(self, force: bool = False) -> None:
        self.removed = True


class FakeContainers:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.created: list[FakeContainer] = []
        self.leftovers: list[FakeContainer] = []

    def create(self, **kwargs: Any) -> FakeContainer:
        if self.client.fail_create:
            raise docker.errors.ImageNotFound("no such image")
        self.client.seen_params = _read_params(kwargs)
        c = FakeContainer(self.client, kwargs)
        self.created.append(c)
        return c

    def get(self, cid: str) -> FakeContainer:
        return next(c for c in self.created if c.id == cid)

    def list(self, all: bool, filters: dict[str, list[str]]) -> list[FakeContainer]:
        wanted = filters["label"][0].split("=", 1)
        return [c for c in self.leftovers if c.labels.get(wanted[0]) == wanted[1]]


class FakeImages:
    def get(self, tag: str) -> object:
        return object()


class FakeClient:
    def __init__(self, on_start: Callable[[FakeContainer], None], runtimes: Sequence[str] = ("runc",),
                 exits_on_term: bool = True) -> None:
        self.on_start = on_start
        self.exits_on_term = exits_on_term
        self.runtimes = runtimes
        self.fail_create = False
        self.fail_start = False
        self.seen_params: Any = None
        self.containers = FakeContainers(self)
        self.images = FakeImages()

    def info(self) -> dict[str, Any]:
        return {"Runtimes": {r: {} for r in self.runtimes}}


def _read_params(kwargs: dict[str, Any]) -> Any:
    for m in kwargs["mounts"]:
        if m["Target"] == PARAMS_TARGET:
            return json.loads(Path(m["Source"]).read_text())
    return None


def spec(tmp_path: Path, **over: Any) -> Any:
    return parse_job_spec({
        "name": "t", "image": "img:1",
        "mounts": {"checkpoint": {"source": str(tmp_path / "ck"), "target": "/ck"}},
        **over,
    })


CTX = SlurmContext(job_id="42", restart_count=1, gpus=("2", "3"), cuda_visible_devices="2,3")


def run(client: FakeClient, sp: Any, signals: Signals | None = None, ctx: SlurmContext = CTX,
        grace_s: float = 1.0, early: list[str] | None = None,
        job_ending: Callable[[], bool] | None = None,
        urgent_wait_s: float = 0.2,
        preempted: Callable[[], bool] | None = None) -> tuple[int, str]:
    out = io.BytesIO()
    calls = early if early is not None else []
    settings = RunSettings(grace_s=grace_s, uid=1000, gid=1000, poll_s=0.01,
                           urgent_wait_s=urgent_wait_s)
    code = run_container(
        client, sp, ctx, settings,
        signals or Signals(), Reporter(out, clock=lambda: 0.0),
        early_requeue=lambda: calls.append("early") or "requeued early",
        job_ending=job_ending, preempted=preempted,
    )
    return code, out.getvalue().decode()


# ---------------------------------------------------------------- pure parts


def test_slurm_context_prefers_step_gpus_and_defaults_restarts_to_zero() -> None:
    """GPU indexes come from SLURM_STEP_GPUS, then SLURM_JOB_GPUS, then CUDA_VISIBLE_DEVICES."""
    ctx = slurm_context({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "1,2", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert ctx == SlurmContext("7", 0, ("1", "2"), "0,1", "")
    assert slurm_context({"SLURM_STEP_GPUS": "3", "SLURM_RESTART_COUNT": "2"}).gpus == ("3",)
    assert slurm_context({"SLURM_RESTART_COUNT": "2"}).restart_count == 2
    assert slurm_context({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}).gpus == ()


def test_container_is_unprivileged_as_the_job_user_with_init_and_labels(tmp_path: Path) -> None:
    """uid:gid of the job, init, no privileges, the spec's network, our labels, resource limits."""
    sp = spec(tmp_path, cpus=2, mem="1G", network="none", command=["python"], args=["-m", "x"],
              workdir="/w")
    kw = container_kwargs(sp, CTX, uid=1000, gid=100, use_device_requests=False, params_file=None)
    assert kw["user"] == "1000:100" and kw["init"] is True and kw["privileged"] is False
    assert kw["security_opt"] == ["no-new-privileges"] and kw["network_mode"] == "none"
    assert kw["labels"][LABEL_JOB] == "42" and kw["name"] == "slurm-idle-42-r1"
    assert kw["entrypoint"] == ["python"] and kw["command"] == ["-m", "x"]
    assert kw["nano_cpus"] == 2_000_000_000 and kw["mem_limit"] == 1 << 30
    assert kw["working_dir"] == "/w"
    assert not any("sock" in m["Source"] for m in kw["mounts"])


def test_mounts_inputs_read_only_outputs_and_checkpoint_writable(tmp_path: Path) -> None:
    """Inputs are bind-mounted read-only; outputs, checkpoint and params as declared."""
    sp = spec(tmp_path, mounts={
        "inputs": [{"source": "/data", "target": "/in"}],
        "outputs": [{"source": "/out", "target": "/out"}],
        "checkpoint": {"source": "/ck", "target": "/ckpt"}})
    kw = container_kwargs(sp, CTX, uid=0, gid=0, use_device_requests=False, params_file="/p.json")
    mounts = {m["Target"]: m for m in kw["mounts"]}
    assert mounts["/in"]["ReadOnly"] is True
    assert mounts["/out"]["ReadOnly"] is False and mounts["/ckpt"]["ReadOnly"] is False
    assert mounts[PARAMS_TARGET]["ReadOnly"] is True and mounts[PARAMS_TARGET]["Source"] == "/p.json"


def test_environment_carries_restart_count_job_id_checkpoint_and_params(tmp_path: Path) -> None:
    """The workload sees SLURM_RESTART_COUNT, SLURM_JOB_ID, CHECKPOINT_DIR, PARAM_* and its env."""
    sp = spec(tmp_path, env={"A": "1"}, params={"lr": 0.5})
    env = container_kwargs(sp, CTX, uid=0, gid=0, use_device_requests=False,
                           params_file="/p.json")["environment"]
    assert env["SLURM_RESTART_COUNT"] == "1" and env["SLURM_JOB_ID"] == "42"
    assert env["CHECKPOINT_DIR"] == "/ck" and env["A"] == "1" and env["PARAM_LR"] == "0.5"
    assert env["SLURM_IDLE_PARAMS_FILE"] == PARAMS_TARGET


def test_gpus_as_device_requests_only_with_an_nvidia_runtime(tmp_path: Path) -> None:
    """With device requests the GPUs are requested by index; without, they are only env vars."""
    sp = spec(tmp_path)
    kw = container_kwargs(sp, CTX, uid=0, gid=0, use_device_requests=True, params_file=None)
    (req,) = kw["device_requests"]
    assert req["DeviceIDs"] == ["2", "3"] and req["Driver"] == "nvidia"
    # the same GPUs in the variable the runtime reads; CUDA numbers the container's GPUs from 0
    assert kw["environment"]["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert kw["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    kw = container_kwargs(sp, CTX, uid=0, gid=0, use_device_requests=False, params_file=None)
    assert "device_requests" not in kw
    assert kw["environment"]["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert kw["environment"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert wants_device_requests("auto", ["runc", "nvidia"])
    assert not wants_device_requests("auto", ["runc"])
    assert wants_device_requests("nvidia", []) and not wants_device_requests("env", ["nvidia"])


def test_mem_bytes_uses_slurm_units() -> None:
    """A plain number is MiB, as in Slurm."""
    assert mem_bytes("512") == 512 << 20 and mem_bytes("2G") == 2 << 30 and mem_bytes("1T") == 1 << 40


SHOW_JOB = ("JobId=5 JobName=demo\n   JobState=RUNNING Reason=None Restarts=1\n"
            "   StartTime=2026-12-02T16:33:10 EndTime=Unknown\n"
            "   PreemptEligibleTime=2026-12-02T16:33:10 PreemptTime={preempt}\n")


def test_preempted_in_this_run_compares_preempt_and_start_times() -> None:
    """Only a PreemptTime at or after this run's StartTime counts."""
    assert preempted_in_this_run(SHOW_JOB.format(preempt="2026-12-02T16:33:38"))
    assert not preempted_in_this_run(SHOW_JOB.format(preempt="None"))
    assert not preempted_in_this_run(SHOW_JOB.format(preempt="2026-12-02T16:30:00"))


def test_early_requeue_only_for_a_slurm_preemption() -> None:
    """After a clean stop a preempted job is requeued at once; otherwise nothing is run."""

    def slurm(preempt: str) -> ReplayRunner:
        return ReplayRunner({("scontrol", "show", "job"): SHOW_JOB.format(preempt=preempt),
                             ("scontrol", "requeue"): ""})

    preempted = slurm("2026-12-02T16:34:00")
    assert "requeued job 5" in requeue_if_preempted("5", preempted)
    assert preempted.calls[-1][0] == ("scontrol", "requeue", "5")
    not_preempted = slurm("None")
    assert "leaving the requeue" in requeue_if_preempted("5", not_preempted)
    assert [argv for argv, _ in not_preempted.calls] == [("scontrol", "show", "job", "5")]
    assert "nothing to requeue" in requeue_if_preempted("", not_preempted)
    refused = ReplayRunner({("scontrol", "show", "job"): SHOW_JOB.format(preempt="2026-12-02T16:34:00"),
                            ("scontrol", "requeue"): CommandError(["scontrol"], 1, "Requested operation is presently disabled")})
    assert "early requeue of job 5 failed" in requeue_if_preempted("5", refused)


# ---------------------------------------------------------------- the run loop


def test_success_streams_logs_and_removes_the_container(tmp_path: Path) -> None:
    """Exit 0 -> runner exit 0; the container's output reaches the job log; container removed."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    code, log = run(client, spec(tmp_path))
    (c,) = client.containers.created
    assert code == 0 and c.removed and "hello from the container" in log
    assert (tmp_path / "ck").is_dir()  # the checkpoint dir is created for the job


def test_container_failure_is_the_job_exit_code(tmp_path: Path) -> None:
    """A failing container makes the runner exit with its code (the job FAILS with it)."""
    client = FakeClient(on_start=lambda c: c.exit(3))
    assert run(client, spec(tmp_path))[0] == 3
    assert client.containers.created[0].removed


def test_container_exit_codes_reserved_for_requeue_become_failures(tmp_path: Path) -> None:
    """A container exiting 143 or 75 on its own is a failure (1), not a request to requeue."""
    for reserved in (EXIT_PREEMPTED, EXIT_REQUEUE_ME):
        client = FakeClient(on_start=lambda c, r=reserved: c.exit(r))
        assert run(client, spec(tmp_path))[0] == 1


def test_sigterm_is_forwarded_and_the_runner_exits_for_requeue(tmp_path: Path) -> None:
    """SIGTERM -> SIGTERM to the container, clean exit within grace, exit 143, early requeue."""
    signals = Signals()
    client = FakeClient(on_start=lambda c: signals.term.set())
    early: list[str] = []
    code, log = run(client, spec(tmp_path), signals, early=early)
    (c,) = client.containers.created
    assert code == EXIT_PREEMPTED and c.kills == ["SIGTERM"] and c.removed
    assert early == ["early"] and "requeued early" in log
    assert log.index("removed container") < log.index("requeued early")


def test_a_container_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    """If the workload does not exit within grace_s it is killed; the runner still exits 143."""
    signals = Signals()
    client = FakeClient(on_start=lambda c: signals.term.set(), exits_on_term=False)
    code, log = run(client, spec(tmp_path), signals, grace_s=0.05)
    (c,) = client.containers.created
    assert code == EXIT_PREEMPTED and c.kills == ["SIGTERM", "SIGKILL"] and c.removed
    assert "killing it" in log


class FakeClock:
    """Supervision time that passes only when the runner waits: an hour's grace in no time."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if not event.is_set():
            self.t += max(seconds, 0.0)
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)


def test_the_grace_is_measured_on_the_injected_clock(tmp_path: Path) -> None:
    """An hour's grace passes on the supervisor's clock: SIGTERM, then SIGKILL when it is up."""
    signals = Signals()
    client = FakeClient(on_start=lambda c: signals.term.set(), exits_on_term=False)
    clock = FakeClock()
    settings = RunSettings(grace_s=3600.0, uid=1000, gid=1000, poll_s=60.0, clock=clock)
    out = io.BytesIO()
    code = run_container(client, spec(tmp_path), CTX, settings, signals,
                         Reporter(out, clock=lambda: 0.0))
    (c,) = client.containers.created
    assert code == EXIT_PREEMPTED and c.kills == ["SIGTERM", "SIGKILL"]
    assert clock.t >= 3600.0 and "still running after 3600 s: killing it" in out.getvalue().decode()


def test_time_limit_warning_checkpoints_and_asks_for_requeue(tmp_path: Path) -> None:
    """SIGUSR1 -> SIGTERM to the container, exit 75 (the script requeues), no early requeue."""
    signals = Signals()
    client = FakeClient(on_start=lambda c: signals.usr1.set())
    early: list[str] = []
    assert run(client, spec(tmp_path), signals, early=early)[0] == EXIT_REQUEUE_ME
    assert early == []


@pytest.mark.parametrize("preempting", [True, False])
def test_sigusr1_sent_by_a_preemption_is_a_preemption(tmp_path: Path, preempting: bool) -> None:
    """A site with send_user_signal sends the job's USR1 at a preemption instead of SIGTERM:
    when Slurm says this run is being preempted, the stop is a preemption (143, ledger
    `preempted`, early requeue), so it never counts against max_restarts; otherwise it stays
    the time limit's (75)."""
    signals = Signals()
    client = FakeClient(on_start=lambda c: signals.usr1.set())
    early: list[str] = []
    buf = io.BytesIO()
    settings = RunSettings(grace_s=1.0, uid=1000, gid=1000, poll_s=0.01,
                           ledger_dir=tmp_path / "state")
    code = run_container(client, spec(tmp_path), CTX, settings, signals,
                         Reporter(buf, clock=lambda: 0.0),
                         early_requeue=lambda: early.append("early") or "requeued early",
                         preempted=lambda: preempting)
    out = buf.getvalue().decode()
    ledger = runlog.read(tmp_path / "state", CTX.job_id, CTX.cluster)
    assert code == (EXIT_PREEMPTED if preempting else EXIT_REQUEUE_ME)
    assert early == (["early"] if preempting else [])
    assert ledger[-1]["why"] == ("preempted" if preempting else "time_limit"), ledger
    assert ("a preemption, not the time limit" in out) is preempting


def test_signal_before_start_starts_nothing(tmp_path: Path) -> None:
    """A job stopped while the image was being prepared never starts its container."""
    signals = Signals()
    signals.term.set()
    client = FakeClient(on_start=lambda c: c.exit(0))
    assert run(client, spec(tmp_path), signals)[0] == EXIT_PREEMPTED
    assert client.containers.created == []


def test_too_many_restarts_fail_the_job(tmp_path: Path) -> None:
    """A run beyond max_restarts exits 64 without starting a container."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    ctx = SlurmContext(job_id="1", restart_count=3)
    code, log = run(client, spec(tmp_path, max_restarts=2), ctx=ctx)
    assert code == EXIT_MAX_RESTARTS and client.containers.created == [] and "max_restarts=2" in log


def test_engine_errors_exit_70_and_still_remove_the_container(tmp_path: Path) -> None:
    """A create or start failure is exit 70; a created container is removed anyway."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    client.fail_create = True
    assert run(client, spec(tmp_path))[0] == EXIT_START_FAILED
    client = FakeClient(on_start=lambda c: c.exit(0))
    client.fail_start = True
    assert run(client, spec(tmp_path))[0] == EXIT_START_FAILED
    assert client.containers.created[0].removed


def test_leftovers_of_the_same_job_are_removed_first(tmp_path: Path) -> None:
    """Containers labelled with this job id (a killed earlier run) are removed before starting."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    old = FakeContainer(client, {"name": "slurm-idle-42-r0", "labels": {LABEL_JOB: "42"}})
    other = FakeContainer(client, {"name": "slurm-idle-9-r0", "labels": {LABEL_JOB: "9"}})
    client.containers.leftovers = [old, other]
    _, log = run(client, spec(tmp_path))
    assert old.removed and not other.removed and "removed leftover container slurm-idle-42-r0" in log


def test_params_file_is_mounted_during_the_run_and_deleted_after(tmp_path: Path) -> None:
    """params reach the container as a JSON file that is gone once the job ends."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    sp = spec(tmp_path, params={"lr": 0.1, "name": "x"})
    run(client, sp)
    assert client.seen_params == {"lr": 0.1, "name": "x"}
    src = next(m["Source"] for m in client.containers.created[0].kwargs["mounts"]
               if m["Target"] == PARAMS_TARGET)
    assert not os.path.exists(src)


@pytest.mark.parametrize("params_as", [["env"], []])
def test_no_params_file_unless_asked(tmp_path: Path, params_as: list[str]) -> None:
    """params_as without 'file' mounts no params file."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    run(client, spec(tmp_path, params={"a": 1}, params_as=params_as))
    assert client.seen_params is None


def test_runner_resolves_the_job_id_placeholder(tmp_path: Path) -> None:
    """The checkpoint dir `{job_id}` is created and mounted with the real job id."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    sp = parse_job_spec({"name": "t", "image": "img:1", "mounts": {
        "checkpoint": {"source": str(tmp_path / "ck-{job_id}"), "target": "/ck"}}})
    run(client, sp)
    (mount,) = [m for m in client.containers.created[0].kwargs["mounts"] if m["Target"] == "/ck"]
    assert mount["Source"] == str(tmp_path / "ck-42") and (tmp_path / "ck-42").is_dir()


LATE_SIGNAL_CHILD = """
import os, signal, sys
from slurm_idle.runner import Signals

signals = Signals()
signals.install()
if sys.argv[1] == "settle":
    signals.settle()


class LateSignal:
    # Module globals are cleared after Python has reset its signal handlers: this lands
    # in the same window as a time-limit warning arriving while the runner exits.
    def __del__(self):
        os.kill(os.getpid(), signal.SIGUSR1)


late = LateSignal()
"""


@pytest.mark.parametrize("settle, expected_rc", [("settle", 0), ("no-settle", -10)])
def test_a_signal_while_the_runner_exits_does_not_kill_it(settle: str, expected_rc: int) -> None:
    """Regression (CI): SIGUSR1 during interpreter exit killed a finished job's runner (FAILED).

    The no-settle case shows the window is real, so the settle case can fail.
    """
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", LATE_SIGNAL_CHILD, settle], capture_output=True, timeout=60,
        check=False,
    )
    assert proc.returncode == expected_rc, proc.stderr.decode()


def test_main_settles_its_signals_whatever_the_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() leaves SIGTERM/SIGUSR1 ignored when it returns, even on an early error."""
    import signal

    from slurm_idle.runner import cli as runner

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}

    def no_engine(*_: Any, **__: Any) -> Any:
        raise docker.errors.DockerException("no engine here")

    monkeypatch.setattr(runner, "_client", no_engine)
    try:
        assert runner.main(["--cleanup", "1"]) == EXIT_START_FAILED
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_a_mount_above_the_real_engine_socket_is_refused(tmp_path: Path) -> None:
    """The socket the runner really uses (DOCKER_HOST, anywhere) never shows in a container,
    through its directory, a parent, or a symlink to either; the container is not created."""
    from slurm_idle.errors import SlurmIdleError
    from slurm_idle.runner import check_no_engine_socket, engine_sockets

    engine_dir = tmp_path / "engine" / "run"
    engine_dir.mkdir(parents=True)
    sockets = engine_sockets(f"unix://{engine_dir}/docker.sock")
    (tmp_path / "link").symlink_to(tmp_path / "engine")
    for source in (engine_dir, tmp_path / "engine", tmp_path, tmp_path / "link"):
        bad = spec(tmp_path, mounts={"outputs": [{"source": str(source), "target": "/o"}]})
        with pytest.raises(SlurmIdleError, match="engine socket"):
            check_no_engine_socket(bad, sockets)
    fine = spec(tmp_path, mounts={"outputs": [{"source": str(tmp_path / "out"), "target": "/o"}]})
    check_no_engine_socket(fine, sockets)
    client = FakeClient(on_start=lambda c: c.exit(0))
    bad = spec(tmp_path, mounts={"outputs": [{"source": str(tmp_path / "link"), "target": "/o"}]})
    signals = Signals()
    code = run_container(client, bad, CTX, RunSettings(grace_s=1.0, engine_sockets=sockets),
                         signals, Reporter(io.BytesIO(), clock=lambda: 0.0))
    assert code == EXIT_START_FAILED and client.containers.created == []


def test_a_lost_engine_connection_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """The API service gone at the stop (requests' ConnectionError, not a DockerException):
    the signal and the removal each say one line and the runner still exits 143 (a requeue),
    never a traceback and exit 1 (the job FAILED at every reclaim, issue 24)."""
    import requests

    lost = requests.exceptions.ConnectionError("('Connection aborted.', FileNotFoundError(2))")
    signals = Signals()

    def gone(*_: Any, **__: Any) -> None:
        raise lost

    def on_start(c: FakeContainer) -> None:
        c.kill = gone  # type: ignore[method-assign]
        c.remove = gone  # type: ignore[method-assign]
        c.wait = gone  # type: ignore[method-assign] # the wait thread's connection broke too
        signals.term.set()

    code, log = run(FakeClient(on_start=on_start), spec(tmp_path), signals, grace_s=0.05)
    assert code == EXIT_PREEMPTED, log
    assert "could not remove container slurm-idle-42-r1: ('Connection aborted." in log
