"""The one small error hierarchy of slurm-idle.

Every error a user can cause or meet on a real cluster is one of these; the CLI turns them
into a single clear line and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence


class SlurmIdleError(Exception):
    """Base of every error slurm-idle raises on purpose."""

    exit_code = 1


class ConfigError(SlurmIdleError):
    """The configuration (or a job spec) is missing, unreadable or invalid."""

    exit_code = 2


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

    exit_code = 3
