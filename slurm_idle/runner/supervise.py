"""Supervision of one running container: signals in, SIGTERM/SIGKILL out, an exit code back.

The waits (the grace after SIGTERM, the short urgent wait, the wait after SIGKILL, a retry's
backoff) read time from an injected `Clock`, so unit tests run a one-hour grace in no time and
the real runner uses the monotonic clock; container exit and log streaming run on threads.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from slurm_idle.jobs import ENGINE_SOCKETS, EXIT_PREEMPTED, EXIT_REQUEUE_ME
from slurm_idle.runner.container import Engine, GpuMode, PullPolicy


class Clock(Protocol):
    """The supervisor's time: a monotonic reading and waits on an event or for a while."""

    def monotonic(self) -> float: ...

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait up to `seconds` for `event`; True when it is set."""
        ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """time.monotonic and real waits."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(seconds, 0.0))

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))


@dataclass
class Signals:
    """Signals received so far; handlers set these, the run loop reads them.

    `urgent` is set by a second SIGTERM/SIGINT: Slurm is ending the job and SIGKILLs the
    runner KillWait seconds later, so the container must go now. A SIGTERM after SIGUSR1 is
    not urgent by itself (a preemption may send both at the start of its GraceTime, with
    SlurmctldParameters=preempt_send_user_signal): the run loop asks Slurm whether the job is
    ending (the time limit) instead. A repeated SIGUSR1 (slurmctld's warning beat) never is.
    """

    term: threading.Event = field(default_factory=threading.Event)
    usr1: threading.Event = field(default_factory=threading.Event)
    urgent: threading.Event = field(default_factory=threading.Event)

    def stop_requested(self) -> bool:
        return self.term.is_set() or self.usr1.is_set()

    def on_term(self) -> None:
        if self.term.is_set():
            self.urgent.set()
        self.term.set()

    def on_usr1(self) -> None:
        self.usr1.set()

    def install(self, held: Sequence[int] = ()) -> None:
        """Handle the signals from now on, after those `held` since the process started
        (job_step.hold_signals: in the order they came)."""
        handlers = {signal.SIGTERM: self.on_term, signal.SIGINT: self.on_term,
                    signal.SIGUSR1: self.on_usr1}
        for signum, handle in handlers.items():
            signal.signal(signum, lambda *_, handle=handle: handle())
        for came in list(held):
            handlers.get(signal.Signals(came), self.on_term)()

    def settle(self) -> None:
        """The exit code is decided: ignore stop signals from now until the process is gone.

        At exit Python resets its signal handlers to the default action, which for SIGTERM
        and SIGUSR1 is death. A time-limit warning (slurmctld sends it on its own ~30 s beat)
        landing in that window turned a finished job into FAILED ("task 0: User defined
        signal 1"). Ignored signals are left ignored, so the decided code stands.
        """
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)


@dataclass(frozen=True)
class RunSettings:
    grace_s: float = 30.0
    gpu_mode: GpuMode = "auto"
    pull: PullPolicy = "missing"  # the node's job_policy.pull (container.ensure_image)
    engine: Engine = "docker"  # names how to load a missing image (a rootless store is the user's)
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    poll_s: float = 0.2
    engine_sockets: tuple[str, ...] = ENGINE_SOCKETS
    # After SIGKILL at the end of grace: how long to wait for the exit code and the last log
    # lines before the container is removed anyway (kept short: Slurm may SIGKILL us next).
    kill_wait_s: float = 3.0
    # "Stop now" (see Signals.urgent): the container, SIGTERMed already, gets this much longer
    # to finish a quick checkpoint, then is force-removed. With the removal it must stay well
    # inside Slurm's KillWait (5 s in etc/slurm.conf.snippet).
    urgent_wait_s: float = 2.0
    # A container that exits with a code a stop gives (143, 75; 138: killed by SIGUSR1) with
    # no stop signal seen yet: how long to wait for one. Where the workload is a process of
    # the job step (charliecloud), Slurm's signal reaches it and the runner within moments of
    # each other, in either order.
    stop_race_s: float = 1.0
    # Where the run ledger lives (runlog.py); None: no ledger, every restart counts.
    ledger_dir: Path | None = None
    # The supervisor's time (grace, urgent and kill waits, retry backoff): tests inject a fake.
    clock: Clock = field(default_factory=RealClock)


class Reporter:
    """Runner messages, prefixed and flushed, into the same stream as the container's output."""

    def __init__(self, out: BinaryIO, clock: Callable[[], float] = time.time) -> None:
        self.out = out
        self.clock = clock
        self.lock = threading.Lock()

    def say(self, message: str) -> None:
        self.write(f"slurm-idle-run: {message} t={self.clock():.1f}\n".encode())

    def write(self, data: bytes) -> None:
        with self.lock:
            self.out.write(data)
            self.out.flush()


def wait_for(
    done: threading.Event,
    seconds: float,
    signals: Signals,
    settings: RunSettings,
    on_first_term: Callable[[], None] | None = None,
) -> bool:
    """Wait up to `seconds` for `done`; give up early on an urgent stop. True: done.

    `on_first_term` runs once, as soon as a SIGTERM has been received (also one that arrives
    during a SIGUSR1 grace), and may set `signals.urgent`.
    """
    clock = settings.clock
    deadline = clock.monotonic() + seconds
    while not done.is_set() and not signals.urgent.is_set():
        if on_first_term is not None and signals.term.is_set():
            on_first_term()
            on_first_term = None
            continue
        left = deadline - clock.monotonic()
        if left <= 0:
            break
        clock.wait(done, min(settings.poll_s, left))
    return done.is_set()


def stop_now(done: threading.Event, settings: RunSettings, report: Reporter, t0: float) -> bool:
    """The urgent end of a grace wait: a last short wait. True: the container exited."""
    report.say(
        f"stop signal {settings.clock.monotonic() - t0:.1f} s into the grace: Slurm is ending the job; "
        f"the container gets {settings.urgent_wait_s:g} s more, then is removed"
    )
    if settings.clock.wait(done, settings.urgent_wait_s):
        return True
    report.say("container still running: removing it now, before Slurm kills the runner")
    return False


def supervise(
    container: Any,
    settings: RunSettings,
    signals: Signals,
    report: Reporter,
    stream_client: Any,
    job_ending: Callable[[], bool] | None = None,
) -> int:
    done = threading.Event()
    result: dict[str, int] = {}

    def wait() -> None:
        try:
            result["code"] = int(stream_client.containers.get(container.id).wait()["StatusCode"])
        except Exception:  # noqa: BLE001 - the container vanished; the loop decides
            result.setdefault("code", -1)
            result.setdefault("lost", 1)
        done.set()

    def stream_logs() -> None:
        try:
            for chunk in stream_client.containers.get(container.id).logs(
                stream=True, follow=True
            ):
                report.write(chunk)
        except Exception:  # noqa: BLE001, S110 - logs are best effort; the exit code is not
            pass

    logs = threading.Thread(target=stream_logs, daemon=True)
    logs.start()
    threading.Thread(target=wait, daemon=True).start()
    clock = settings.clock
    while not clock.wait(done, settings.poll_s):
        if signals.stop_requested():
            break
    # The engine connection broke while a stop was asked for (a podman API service signalled
    # with the step): no exit code came, so this is the stop, not a failed container.
    if done.is_set() and not ("lost" in result and signals.stop_requested()):
        code = result["code"]
        if not ended_by_the_stop(code, signals, settings):
            return own_exit(code, logs, report)
        # The workload got the stop first (Slurm signals every process of the step; a ch-run
        # workload is one) and ended with it: a stop, requeued, never a failure. Exit 0 is
        # its own (its last step done), as when the container ended as the stop came.
        logs.join(timeout=settings.kill_wait_s)
        report.say(f"container exited with code {code} as the stop signal came: "
                   "taken as stopped")
        return EXIT_REQUEUE_ME if signals.usr1.is_set() and not signals.term.is_set() \
            else EXIT_PREEMPTED
    why = "SIGTERM (preemption or requeue)" if signals.term.is_set() else "SIGUSR1 (time limit near)"
    report.say(f"{why}: forwarding SIGTERM to the container, grace {settings.grace_s:g} s")
    t0 = clock.monotonic()
    try:
        container.kill(signal="SIGTERM")
    except Exception as exc:  # noqa: BLE001 - it may have exited meanwhile
        report.say(f"could not signal the container: {exc}")
        # Not running: it ended as the stop came. Exit 0 is its last step done (its code was
        # on the way): the job is complete, and taken as stopped it would be requeued to run
        # once more. Any other code is the stop's (a site whose Slurm signals every process
        # of the step reached the workload first, which checkpointed and exited 143).
        if not_running(container) and clock.wait(done, settings.kill_wait_s) \
                and "lost" not in result and result["code"] == 0:
            return own_exit(0, logs, report)

    def check_ending() -> None:
        # Asked after the container has its SIGTERM, so the check costs it no grace.
        if job_ending is not None and job_ending():
            report.say("Slurm is already ending the job (no grace left): stopping now")
            signals.urgent.set()

    if not wait_for(done, settings.grace_s, signals, settings, check_ending):
        if signals.urgent.is_set():
            if not stop_now(done, settings, report, t0):
                # The finally of _run_once force-removes it (kill + remove) right away.
                return EXIT_PREEMPTED
        else:
            report.say(f"container still running after {settings.grace_s:g} s: killing it")
            try:
                container.kill(signal="SIGKILL")
            except Exception as exc:  # noqa: BLE001 - it may have exited meanwhile
                report.say(f"could not kill the container: {exc}")
            wait_for(done, settings.kill_wait_s, signals, settings)
    logs.join(timeout=0.5 if signals.urgent.is_set() else settings.kill_wait_s)
    report.say(
        f"container stopped with code {result.get('code', -1)} after "
        f"{clock.monotonic() - t0:.1f} s of grace"
    )
    if signals.usr1.is_set() and not signals.term.is_set():
        return EXIT_REQUEUE_ME
    return EXIT_PREEMPTED


#: Exit codes a stop gives a workload: its checkpoint exits, and death by Slurm's SIGUSR1
#: (a workload without a handler for the time-limit warning; SIGTERM's is 143).
STOP_CODES = (EXIT_PREEMPTED, EXIT_REQUEUE_ME, 128 + signal.SIGUSR1)


def ended_by_the_stop(code: int, signals: Signals, settings: RunSettings) -> bool:
    """A container's own non-zero exit is the stop's when a stop signal has come, or comes
    within `stop_race_s` of an exit with a code a stop gives (STOP_CODES)."""
    if code == 0:
        return False
    if code not in STOP_CODES or signals.stop_requested():
        return signals.stop_requested()
    deadline = settings.clock.monotonic() + settings.stop_race_s
    while not signals.stop_requested() and (left := deadline - settings.clock.monotonic()) > 0:
        settings.clock.wait(signals.term, min(settings.poll_s, left))
    return signals.stop_requested()


def own_exit(code: int, logs: threading.Thread, report: Reporter) -> int:
    """The runner's exit code for a container that exited on its own with `code`."""
    logs.join(timeout=5)
    report.say(f"container exited with code {code}")
    if code in (EXIT_PREEMPTED, EXIT_REQUEUE_ME):
        # Those two codes tell the batch script "requeue me": a container that fails
        # with one of them on its own must not be requeued forever.
        report.say(f"exit code {code} is reserved for preemption: reporting failure (1)")
        return 1
    return code


def not_running(container: Any) -> bool:
    """True when the engine says the container has ended (exited or dead); False when it
    runs or cannot be asked."""
    try:
        container.reload()
        return str(container.status) in ("exited", "dead")
    except Exception:  # noqa: BLE001 - asking is best effort: unknown means running
        return False


def backoff(seconds: float, signals: Signals, settings: RunSettings) -> bool:
    """Wait out a retry's backoff; False when a stop signal cut it short."""
    clock = settings.clock
    deadline = clock.monotonic() + seconds
    while (left := deadline - clock.monotonic()) > 0:
        if signals.stop_requested():
            return False
        clock.sleep(min(settings.poll_s, left))
    return not signals.stop_requested()
