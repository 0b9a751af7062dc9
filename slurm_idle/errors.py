"""The one small error hierarchy of slurm-idle.

Every error a user can cause or meet on a real cluster is one of these; the CLI turns them
into a single clear line and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class ExitCode(IntEnum):
    """What every `slurm-idle` command's exit status means: the one table (also in --help)."""

    OK = 0
    FAILED = 1  # an action or a check failed (a Slurm call, an engine, a doctor check)
    BAD_INPUT = 2  # bad input, usage or config: unknown node, missing file, bad flag
    REFUSED = 3  # refused by a safety rule, or a feature not built yet
    INTERRUPTED = 130  # Ctrl-C / SIGINT


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "ok (also: nothing to do)",
    ExitCode.FAILED: ("an action or a check failed (Slurm, an engine, the router, a tick's step, "
                      "a doctor check; an admin command finding the tick lock held)"),
    ExitCode.BAD_INPUT: ("bad input, usage or config (unknown node, missing file, bad flag, "
                         "port in use; an admin's lend the config's floor or max_lent_fraction "
                         "forbids: --force overrides)"),
    ExitCode.REFUSED: "refused by a safety rule (admin-drained, pinned, wrong phase), or not built",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}


def exit_code_table() -> str:
    """The table as the lines `slurm-idle --help` shows (code, two spaces, meaning): written
    once here so the help, the README and the error classes cannot disagree."""
    return "\n".join(f"{int(code):>3}  {text}" for code, text in EXIT_CODE_MEANINGS.items())


class SlurmIdleError(Exception):
    """Base of every error slurm-idle raises on purpose."""

    exit_code: int = ExitCode.FAILED


class ConfigError(SlurmIdleError):
    """The configuration (or a job spec) is missing, unreadable or invalid."""

    exit_code = ExitCode.BAD_INPUT


class BadInput(SlurmIdleError):
    """What the user typed names nothing there is (an unknown node or replica, a missing
    file) or cannot be used (a port in use): the command, not the pool, must change."""

    exit_code = ExitCode.BAD_INPUT


class OverLimit(SlurmIdleError):
    """An admin's change would break a limit the config sets (a model's floor,
    policy.max_lent_fraction): exit 2 like any request the config forbids; `--force` makes it
    anyway, journaled. Nothing was changed."""

    exit_code = ExitCode.BAD_INPUT


class Refused(SlurmIdleError):
    """A safety rule refused the command (an admin-drained node, a pin, a phase the lifecycle
    has no edge from): nothing was changed."""

    exit_code = ExitCode.REFUSED


class CommandError(SlurmIdleError):
    """An external command (sinfo, scontrol, sbatch...) failed or timed out."""

    def __init__(self, argv: Sequence[str], rc: int, stderr: str) -> None:
        self.argv = list(argv)
        self.rc = rc
        self.stderr = stderr
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else "no error output"
        super().__init__(f"`{' '.join(self.argv)}` failed (rc={rc}): {tail}")


class MetricsUnavailable(SlurmIdleError):
    """Engine metrics could not be read (Prometheus or /metrics did not answer usefully)."""


class EngineError(SlurmIdleError):
    """A vLLM replica could not be stopped, started, slept or woken."""


class RouterError(SlurmIdleError):
    """The request router could not be told (or read): the replica stays where it is."""


class NotBuiltYet(SlurmIdleError):
    """A command exists in the CLI but its feature has not been built yet."""

    exit_code = ExitCode.REFUSED
