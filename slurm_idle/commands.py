"""Running external commands with a timeout, behind a protocol tests can replace (the one
command-runner module: the Slurm backends, the engine's commands and the in-job runner use it).

Every Slurm or admin command goes through a `CommandRunner`, so the backends never touch
`subprocess` themselves and tests inject a fake that replays captured output. A non-zero exit
or a timeout becomes `CommandError(argv, rc, stderr)`; a timeout has rc=-1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurm_idle.errors import CommandError
from slurm_idle.logs import get_logger

log = get_logger(__name__)

TIMEOUT_RC = -1


@dataclass(frozen=True)
class CompletedResult:
    """What a finished command produced."""

    argv: tuple[str, ...]
    rc: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    """Runs one command; raises CommandError on failure or timeout."""

    def run(
        self, argv: Sequence[str], input: str | None = None, timeout: float | None = None
    ) -> CompletedResult: ...


class SubprocessRunner:
    """The real runner: subprocess with a timeout, text I/O, optional extra environment."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout: float | None = None) -> None:
        self.env = dict(env) if env is not None else None
        self.timeout = timeout

    def run(
        self, argv: Sequence[str], input: str | None = None, timeout: float | None = None
    ) -> CompletedResult:
        argv = [str(a) for a in argv]
        limit = timeout if timeout is not None else self.timeout
        started = time.monotonic()
        env = {**os.environ, **self.env} if self.env is not None else None
        try:
            # A new session lets a timeout kill the whole process group: a shell's children
            # would otherwise keep the pipes open and the wait would outlive the timeout.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise CommandError(
                argv, 127, f"{argv[0]}: command not found (install it or set slurm.bin_dir)"
            ) from None
        except PermissionError as exc:
            raise CommandError(argv, 126, f"{argv[0]}: {exc.strerror}") from None
        try:
            stdout, stderr = proc.communicate(input=input, timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise CommandError(
                argv,
                TIMEOUT_RC,
                f"timed out after {limit:g} s (is the service reachable? "
                "raise the timeout if it is only slow)",
            ) from None
        log.debug("ran %s: rc=%d in %.2fs", " ".join(argv)[:200], proc.returncode,
                  time.monotonic() - started)
        if proc.returncode != 0:
            raise CommandError(argv, proc.returncode, stderr or stdout)
        return CompletedResult(tuple(argv), proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the command and everything it started, then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a child escaped the group and holds the pipes
        proc.kill()
        proc.wait()


class ReplayRunner:
    """A CommandRunner for tests: answers from a table of argv prefixes, records every call.

    `responses` maps a tuple prefix of argv (e.g. ("sinfo", "--json")) to stdout text, or to a
    `CommandError` to raise; the longest matching prefix wins. Unknown commands fail loudly.
    """

    def __init__(self, responses: Mapping[tuple[str, ...], str | CommandError]) -> None:
        self.responses = dict(responses)
        self.calls: list[tuple[tuple[str, ...], str | None]] = []

    def run(
        self, argv: Sequence[str], input: str | None = None, timeout: float | None = None
    ) -> CompletedResult:
        key = tuple(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv))
        self.calls.append((key, input))
        matches = [p for p in self.responses if key[: len(p)] == p]
        if not matches:
            raise CommandError(argv, 127, f"ReplayRunner has no answer for {' '.join(key)}")
        answer = self.responses[max(matches, key=len)]
        if isinstance(answer, CommandError):
            raise answer
        return CompletedResult(tuple(argv), 0, answer, "")
