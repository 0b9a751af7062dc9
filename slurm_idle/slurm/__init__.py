"""The Slurm adapter: one protocol, a CLI backend (default) and a pyslurm backend.

`make_backend(config)` picks one from `slurm.backend`: `cli`, `pyslurm`, or `auto` (pyslurm
only when it imports and was built for the cluster's major.minor release, else the CLI).
"""

from __future__ import annotations

from slurm_idle.commands import CommandRunner, CompletedResult, SubprocessRunner
from slurm_idle.config import Config
from slurm_idle.errors import ConfigError
from slurm_idle.slurm.cli_backend import CliBackend
from slurm_idle.slurm.parse import SlurmJsonError, major_minor
from slurm_idle.slurm.protocol import (
    AcctJob,
    ClusterReader,
    JobControl,
    NodeWriter,
    PoolSlurm,
    SlurmBackend,
)

__all__ = [
    "AcctJob",
    "CliBackend",
    "ClusterReader",
    "CommandRunner",
    "CompletedResult",
    "JobControl",
    "NodeWriter",
    "PoolSlurm",
    "SlurmBackend",
    "SlurmJsonError",
    "SubprocessRunner",
    "make_backend",
]


def make_backend(config: Config, runner: CommandRunner | None = None) -> SlurmBackend:
    """The backend `config.slurm.backend` asks for; commands use bin_dir and the timeout."""
    settings = config.slurm
    cli = CliBackend(runner=runner, bin_dir=settings.bin_dir, timeout_s=settings.command_timeout_s)
    if settings.backend == "cli":
        return cli
    from slurm_idle.slurm import pyslurm_backend

    if settings.backend == "pyslurm":
        return pyslurm_backend.PyslurmBackend(cli)
    try:
        module = pyslurm_backend.import_pyslurm()
    except ConfigError:
        return cli
    built_for = major_minor(pyslurm_backend.pyslurm_version(module))
    if built_for != major_minor(cli.version()):
        return cli
    return pyslurm_backend.PyslurmBackend(cli, module)
