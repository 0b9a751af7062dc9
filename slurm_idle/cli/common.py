"""Helpers every CLI module shares: the context object, JSON output and the error guard."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import click

from slurm_idle.config import Config, load_config, resolve_config_path
from slurm_idle.errors import ExitCode, NotBuiltYet, SlurmIdleError

if TYPE_CHECKING:
    from slurm_idle.agent import Agent
    from slurm_idle.slurm.protocol import ClusterReader


class AgentFactory(Protocol):
    """Builds the agent a command acts through; `read_only` for commands that only look."""

    def __call__(self, config: Config, *, read_only: bool = False) -> Agent: ...


def build_agent(config: Config, *, read_only: bool = False) -> Agent:
    """The real agent (slurm_idle.wiring), imported when a command first needs one."""
    from slurm_idle import wiring

    return wiring.build_agent(config, read_only=read_only)


@dataclass
class Context:
    """What the top-level group hands to every command. Tests and embedding scripts pass
    their own (`CliRunner().invoke(main, args, obj=Context(agent_factory=...))`) to run the
    commands on fakes: `main` keeps it and only sets the config path."""

    config_path: str | None = None
    _config: Config | None = field(default=None, repr=False)
    agent_factory: AgentFactory = build_agent

    @property
    def resolved_config_path(self) -> str:
        return resolve_config_path(self.config_path)

    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.resolved_config_path)
        return self._config

    def agent(self, read_only: bool = False) -> Agent:
        """The agent of the loaded config, from `agent_factory`."""
        return self.agent_factory(self.config(), read_only=read_only)

    def slurm(self) -> ClusterReader:
        """Slurm alone, for a command that only reads nodes (explain): the real backend without
        the agent's imports (a third of explain's time), or the agent's own when a caller gave
        its factory (tests on fakes)."""
        if self.agent_factory is not build_agent:
            return self.agent(read_only=True).slurm
        from slurm_idle.slurm import make_backend

        return make_backend(self.config())


pass_ctx = click.make_pass_decorator(Context, ensure=True)


def echo_json(data: Any) -> None:
    """Print a stable, machine-readable JSON document on stdout."""
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def not_built(feature: str) -> NoReturn:
    """Say plainly that a command is not built yet (exit 3) instead of pretending."""
    raise NotBuiltYet(f"`{feature}` is not built yet in this version of slurm-idle")


def log_fatal(message: str) -> None:
    """Send a fatal error's line to the log handlers that are not the stderr one (syslog).

    Under cron stderr is discarded and `--syslog` is the only trace left, so a bad config, an
    unusable lock or journal must reach syslog too; stderr already got the line from click.
    """
    from slurm_idle.logs import LOGGER_NAME

    logger = logging.getLogger(LOGGER_NAME)
    if not logger.isEnabledFor(logging.ERROR):
        return
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in logger.handlers:
        if type(handler) is logging.StreamHandler:  # the stderr handler (setup_logging)
            continue
        if record.levelno >= handler.level:
            handler.handle(record)


def run_guarded(command: click.Command, argv: list[str] | None = None, **extra: Any) -> NoReturn:
    """Run the click app; SlurmIdleError becomes a line per problem on stderr and its exit code.

    Anything else (a bug, an OSError nobody turned into a SlurmIdleError) is one line and
    exit 1 too; `-v` shows its traceback. Both lines also go to syslog under `--syslog`.
    `extra` goes to click (`obj=Context(agent_factory=...)`: tests and embedding scripts).
    """
    try:
        # Without standalone mode click *returns* the code of `ctx.exit(n)` / `Exit(n)`.
        rc = command.main(args=argv, prog_name="slurm-idle", standalone_mode=False, **extra)
        if isinstance(rc, int) and not isinstance(rc, bool):
            sys.exit(rc)
    except SlurmIdleError as exc:
        # An invalid config is one line per problem (ConfigInvalid); each gets the prefix, so
        # every line reads (and greps) as an error of its own, on stderr and in syslog.
        for line in str(exc).splitlines() or [""]:
            click.echo(f"slurm-idle: error: {line}", err=True)
            log_fatal(f"error: {line}")
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("slurm-idle: aborted", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, never a traceback
        import traceback

        from slurm_idle.logs import LOGGER_NAME

        if logging.getLogger(LOGGER_NAME).isEnabledFor(logging.DEBUG):
            traceback.print_exc()
            hint = ""
        else:
            hint = " (run with -v for the traceback)"
        click.echo(f"slurm-idle: error: {type(exc).__name__}: {exc}{hint}", err=True)
        log_fatal(f"error: {type(exc).__name__}: {exc}")
        sys.exit(ExitCode.FAILED)
    sys.exit(ExitCode.OK)
