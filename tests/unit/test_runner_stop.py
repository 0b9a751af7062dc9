"""The runner's stop path: a second SIGTERM (or one while Slurm already ends the job) removes
the container at once, and the GPUs a container sees are always the ones Slurm allocated."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.commands import ReplayRunner
from slurm_idle.errors import CommandError
from slurm_idle.runner import (
    EXIT_PREEMPTED,
    EXIT_REQUEUE_ME,
    Reporter,
    RunSettings,
    Signals,
    SlurmContext,
    container_kwargs,
    job_is_ending,
    run_container,
    show_job_state,
)
from tests.unit.test_runner import CTX, FakeClient, FakeContainer, run, spec

GRACE_S = 30.0  # far longer than any test may take: a stop that waits it out fails the test


def later(*steps: Callable[[], None], gap_s: float = 0.05) -> Callable[[FakeContainer], None]:
    """An on_start hook that runs `steps` one after another from a thread, `gap_s` apart."""

    def on_start(_: FakeContainer) -> None:
        def go() -> None:
            for step in steps:
                time.sleep(gap_s)
                step()

        threading.Thread(target=go, daemon=True).start()

    return on_start


def test_a_second_sigterm_during_the_grace_wait_removes_the_container_at_once(
    tmp_path: Path,
) -> None:
    """Regression: reclaim SIGTERM, then `scontrol requeue`'s SIGTERM (SIGKILL 5 s later):
    the runner no longer waits out grace_s; it removes the container and exits 143."""
    signals = Signals()
    client = FakeClient(on_start=later(signals.on_term, signals.on_term), exits_on_term=False)
    started = time.monotonic()
    code, log = run(client, spec(tmp_path), signals, grace_s=GRACE_S)
    (c,) = client.containers.created
    assert code == EXIT_PREEMPTED and c.removed and c.kills == ["SIGTERM"]
    assert time.monotonic() - started < 5
    assert "removing it now" in log
    assert log.index("removing it now") < log.index("removed container")


def test_stop_now_still_keeps_a_checkpoint_that_is_quick(tmp_path: Path) -> None:
    """A workload that ends within the short last wait of a stop-now is not cut off: its
    exit (and its log) is recorded as for any stop."""
    signals = Signals()
    client = FakeClient(on_start=later(signals.on_term), exits_on_term=False)

    def ending() -> bool:  # Slurm is ending the job; the workload exits 0.1 s later
        threading.Timer(0.1, client.containers.created[0].exit, args=(0,)).start()
        return True

    code, log = run(client, spec(tmp_path), signals, grace_s=GRACE_S, job_ending=ending,
                    urgent_wait_s=3.0)
    assert code == EXIT_PREEMPTED and client.containers.created[0].kills == ["SIGTERM"]
    assert "container stopped with code 0 after" in log and "removing it now" not in log


def test_sigterm_after_the_time_limit_warning_stops_at_once_when_the_job_ends(
    tmp_path: Path,
) -> None:
    """SIGUSR1 starts the checkpoint; a SIGTERM while Slurm ends the job (the time limit) is
    stop-now, exit 143 (the script's own requeue is for exit 75 only)."""
    signals = Signals()
    client = FakeClient(on_start=later(signals.on_usr1, signals.on_term), exits_on_term=False)
    started = time.monotonic()
    code, log = run(client, spec(tmp_path), signals, grace_s=GRACE_S, job_ending=lambda: True)
    assert code == EXIT_PREEMPTED and client.containers.created[0].removed
    assert time.monotonic() - started < 5 and "removing it now" in log


def test_sigterm_after_sigusr1_in_a_running_job_keeps_the_grace(tmp_path: Path) -> None:
    """A preemption may send SIGUSR1 and SIGTERM together (preempt_send_user_signal) with its
    whole GraceTime ahead: with the job still RUNNING the grace is kept."""
    signals = Signals()
    client = FakeClient(on_start=later(signals.on_usr1, signals.on_term), exits_on_term=False)
    asked: list[bool] = []
    code, log = run(client, spec(tmp_path), signals, grace_s=0.5,
                    job_ending=lambda: asked.append(True) or False)
    assert code == EXIT_PREEMPTED and asked == [True] and not signals.urgent.is_set()
    assert "killing it" in log and client.containers.created[0].kills == ["SIGTERM", "SIGKILL"]


def test_a_repeated_time_limit_warning_keeps_the_grace(tmp_path: Path) -> None:
    """slurmctld may send SIGUSR1 again: that is not a reason to cut the checkpoint short."""
    signals = Signals()
    client = FakeClient(on_start=later(signals.on_usr1, signals.on_usr1), exits_on_term=False)
    code, log = run(client, spec(tmp_path), signals, grace_s=0.5)
    (c,) = client.containers.created
    assert code == EXIT_REQUEUE_ME and c.kills == ["SIGTERM", "SIGKILL"] and not signals.urgent.is_set()
    assert "killing it" in log


def test_a_first_sigterm_while_slurm_ends_the_job_stops_at_once(tmp_path: Path) -> None:
    """A plain `scontrol requeue`/scancel sends one SIGTERM and SIGKILL after KillWait: when
    Slurm says the job is ending, the runner does not wait out grace_s."""
    signals = Signals()
    client = FakeClient(on_start=later(signals.on_term), exits_on_term=False)
    started = time.monotonic()
    code, log = run(client, spec(tmp_path), signals, grace_s=GRACE_S, job_ending=lambda: True)
    assert code == EXIT_PREEMPTED and client.containers.created[0].removed
    assert time.monotonic() - started < 5 and "already ending the job" in log


def test_a_sigterm_during_a_running_job_keeps_the_grace(tmp_path: Path) -> None:
    """A preemption's GraceTime or the agent's step SIGTERM (job RUNNING): the container
    checkpoints and exits on its own, no stop-now."""
    signals = Signals()
    client = FakeClient(on_start=later(signals.on_term), exits_on_term=True)
    asked: list[bool] = []
    code, log = run(client, spec(tmp_path), signals, grace_s=GRACE_S,
                    job_ending=lambda: asked.append(True) or False)
    assert code == EXIT_PREEMPTED and asked == [True] and not signals.urgent.is_set()
    assert "container stopped with code 143" in log


def test_real_signals_drive_the_same_events() -> None:
    """Installed handlers: one SIGTERM requests a stop, a second makes it urgent; SIGUSR1
    twice, or SIGUSR1 then SIGTERM, is not urgent by itself; SIGINT counts as SIGTERM."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        signals = Signals()
        signals.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.usr1.is_set() and signals.term.is_set() and not signals.urgent.is_set()
        signals = Signals()
        signals.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.term.is_set() and not signals.urgent.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.urgent.is_set()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


SHOW = "JobId=5 JobName=demo\n   JobState={state} Reason=None Dependency=(null)\n"


@pytest.mark.parametrize(("state", "ending"), [
    ("RUNNING", False), ("COMPLETING", True), ("CANCELLED", True), ("TIMEOUT", True),
    ("PENDING", True), ("SUSPENDED", False),
])
def test_job_is_ending_reads_the_job_state(state: str, ending: bool) -> None:
    """Only states in which Slurm is ending the job cut the grace; unknown keeps it."""
    slurm = ReplayRunner({("scontrol", "show", "job", "5"): SHOW.format(state=state)})
    assert job_is_ending("5", slurm) is ending
    assert [argv for argv, _ in slurm.calls] == [("scontrol", "show", "job", "5")]
    assert show_job_state(SHOW.format(state=state)) == state
    failing = ReplayRunner({("scontrol",): CommandError(["scontrol"], 1, "slurm_load_jobs error")})
    assert job_is_ending("5", failing) is False
    assert job_is_ending("", slurm) is False


def test_no_gpus_means_no_gpus_whatever_the_spec_says(tmp_path: Path) -> None:
    """Regression: `NVIDIA_VISIBLE_DEVICES=all` in a GPU-less job's env reached the nvidia
    runtime and showed every GPU; the runner sets `void` (and an empty CUDA list) over it."""
    sp = spec(tmp_path, env={"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    no_gpus = SlurmContext(job_id="7")
    for device_requests in (True, False):
        env = container_kwargs(sp, no_gpus, uid=0, gid=0, use_device_requests=device_requests,
                               params_file=None)["environment"]
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == ""
        assert "SLURM_IDLE_GPUS" not in env


@pytest.mark.parametrize(("device_requests", "cuda"), [(True, "0,1"), (False, "2,3")])
def test_allocated_gpus_override_the_spec_env(tmp_path: Path, device_requests: bool,
                                              cuda: str) -> None:
    """With GPUs the allocated list wins over the spec's `all`, with or without device
    requests; CUDA's list matches what the container can see."""
    sp = spec(tmp_path, env={"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "7"})
    kw: dict[str, Any] = container_kwargs(sp, CTX, uid=0, gid=0,
                                          use_device_requests=device_requests, params_file=None)
    assert kw["environment"]["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert kw["environment"]["CUDA_VISIBLE_DEVICES"] == cuda


def test_gpu_mode_off_hides_every_gpu(tmp_path: Path) -> None:
    """--gpu-mode off: the container is started with NVIDIA_VISIBLE_DEVICES=void."""
    client = FakeClient(on_start=lambda c: c.exit(0), runtimes=("runc", "nvidia"))
    run_container(client, spec(tmp_path), CTX,
                  RunSettings(grace_s=1.0, gpu_mode="off", uid=0, gid=0, poll_s=0.01),
                  Signals(), Reporter(io.BytesIO(), clock=lambda: 0.0))
    kwargs = client.containers.created[0].kwargs
    assert kwargs["environment"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "device_requests" not in kwargs


def test_grace_comes_from_the_flag_else_the_spec(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """--help names no environment variable for the grace, and none is read: the flag wins,
    else the spec's grace_s."""
    from slurm_idle.runner import cli as runner

    with pytest.raises(SystemExit):
        runner._parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: the spec's grace_s" in help_text and "SLURM_IDLE_GRACE_S" not in help_text
    seen: list[float] = []

    def fake_run(*args: Any, **kwargs: Any) -> int:
        seen.append(args[3].grace_s)
        return 0

    monkeypatch.setattr(runner, "_client", lambda *a, **k: object())
    monkeypatch.setattr(runner, "run_container", fake_run)
    from slurm_idle.config import JobPolicyConfig

    # docker: the grace is the question here, not the runtime (podman would start its service)
    monkeypatch.setattr(runner, "site_policy",
                        lambda env: JobPolicyConfig(allow_root=True, runtime="docker"))
    monkeypatch.setenv("SLURM_IDLE_GRACE_S", "99")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: t\nimage: img:1\ngrace_s: 12\n")
    assert runner._main(["--spec", str(spec_file)], Signals()) == 0
    assert runner._main(["--spec", str(spec_file), "--grace-s", "3"], Signals()) == 0
    assert seen == [12.0, 3.0]


@pytest.mark.parametrize(("stop", "expected"), [("usr1", EXIT_REQUEUE_ME), ("term", EXIT_PREEMPTED)])
def test_a_stop_signal_before_the_container_starts(tmp_path: Path, stop: str,
                                                   expected: int) -> None:
    """A time-limit warning before the container started (Slurm may send it up to a minute
    early) requeues the job (75): as 143 the batch script waited for a requeue nobody made
    and the job ended TIMEOUT. A SIGTERM then is Slurm's own ending (143)."""
    signals = Signals()
    if stop == "usr1":
        signals.on_usr1()
    else:
        signals.on_term()
    client = FakeClient(on_start=lambda _: None)
    code, log = run(client, spec(tmp_path), signals, grace_s=GRACE_S)
    assert code == expected and not client.containers.created
    assert "nothing to checkpoint" in log


@pytest.mark.parametrize(("stop", "exits", "expected"), [
    ("usr1", 0, 0), ("term", 0, 0), ("usr1", 143, EXIT_REQUEUE_ME), ("term", 143, EXIT_PREEMPTED),
])
def test_a_container_that_ends_as_a_stop_signal_comes(
        tmp_path: Path, stop: str, exits: int, expected: int) -> None:
    """The container ends just as the time-limit warning (or a SIGTERM) lands, its exit code
    still on its way, and the engine refuses to signal a container that is not running. Exit
    0 is its last step done: the job is complete (0), not requeued to run once more (seen in
    the 24.11 lane: the demo printed `done` twice). Exit 143 is the stop's (Slurm signalled
    the workload itself, which checkpointed): the job is requeued as for any stop."""
    signals = Signals()

    def finish(c: FakeContainer) -> None:
        c.exit_code_delay_s = 0.5
        c.exit(exits)
        if stop == "usr1":
            signals.on_usr1()
        else:
            signals.on_term()

    client = FakeClient(on_start=finish)
    code, log = run(client, spec(tmp_path), signals, grace_s=GRACE_S)
    assert code == expected, log
    assert client.containers.created[0].kills == []


HELD_THEN_REPLAYED = """
import os, signal
from slurm_idle import job_step
held = job_step.hold_signals()
for name in {signals!r}:  # while the runner is imported
    os.kill(os.getpid(), getattr(signal, name))
from slurm_idle.runner.supervise import Signals
s = Signals()
s.install(held)
os.kill(os.getpid(), signal.SIGTERM)  # after its handlers are in
print(s.usr1.is_set(), s.term.is_set(), s.urgent.is_set())
"""


@pytest.mark.parametrize(("early", "seen"), [
    ((), "False True False"),
    (("SIGUSR1",), "True True False"),
    (("SIGTERM",), "False True True"),
    (("SIGUSR1", "SIGUSR1"), "True True False"),
])
def test_a_signal_while_the_runner_is_imported_is_held_and_replayed(
        early: tuple[str, ...], seen: str) -> None:
    """Slurm may send the time-limit warning as the step starts, and importing the runner
    takes seconds on a busy node: a SIGUSR1 then killed the step ("task 0: User defined signal
    1", the job FAILED). job_step holds the signals from its first line and the runner's own
    handlers replay them: the warning counts, and a held SIGTERM followed by another makes
    the stop urgent as two SIGTERMs always do."""
    done = subprocess.run([sys.executable, "-c", HELD_THEN_REPLAYED.format(signals=early)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-400:])
    assert done.stdout.strip() == seen


@pytest.mark.parametrize("code, stop, expected", [
    (EXIT_PREEMPTED, "on_term", EXIT_PREEMPTED),
    (EXIT_REQUEUE_ME, "on_usr1", EXIT_REQUEUE_ME),
    (128 + signal.SIGUSR1, "on_usr1", EXIT_REQUEUE_ME),  # no handler: killed by the warning
])
def test_a_workload_slurm_signalled_first_is_requeued_not_failed(
        tmp_path: Path, code: int, stop: str, expected: int) -> None:
    """Where the workload is a process of the job step (charliecloud's ch-run), Slurm's signal
    reaches it and the runner in either order: its checkpoint exit coming a moment before
    the runner's own signal is the stop's (requeued), not a failure (measured on the sandbox:
    a reclaim made such a job FAILED with 1)."""
    signals = Signals()

    def on_start(c: FakeContainer) -> None:
        c.exit(code)
        threading.Timer(0.2, getattr(signals, stop)).start()

    early: list[str] = []
    got, log = run(FakeClient(on_start=on_start), spec(tmp_path), signals, early=early)
    assert got == expected, log
    assert "as the stop signal came: taken as stopped" in log
    assert early == (["early"] if stop == "on_term" else [])


@pytest.mark.parametrize("code, expected", [(1, EXIT_PREEMPTED), (0, 0)])
def test_an_exit_as_the_stop_came_is_the_stops_unless_it_is_0(
        tmp_path: Path, code: int, expected: int) -> None:
    """The stop already seen when the code comes: any non-zero code is the stop's; exit 0 is
    the container's own (its last step done: complete, not run again)."""
    signals = Signals()

    def on_start(c: FakeContainer) -> None:
        signals.on_term()
        c.exit(code)

    got, log = run(FakeClient(on_start=on_start, exits_on_term=False), spec(tmp_path), signals)
    assert got == expected, log
