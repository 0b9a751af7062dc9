"""Old home of the command runner, kept as an alias: import from `slurm_idle.commands`."""

from slurm_idle.commands import (
    TIMEOUT_RC,
    CommandRunner,
    CompletedResult,
    ReplayRunner,
    SubprocessRunner,
)

__all__ = ["TIMEOUT_RC", "CommandRunner", "CompletedResult", "ReplayRunner", "SubprocessRunner"]
