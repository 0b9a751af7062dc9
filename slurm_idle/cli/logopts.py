"""-v/-q/--syslog/--log on every command, not only before it.

Admins type `slurm-idle tick -v` as often as `slurm-idle -v tick` (and the alert texts say the
former), so every leaf command takes the logging options too; given there, they are
merged with the group's and logging is set up again before the command runs.
"""

from __future__ import annotations

from typing import Any

import click

from slurm_idle.logs import LOG_TARGETS

LOG_OPTION_NAMES = ("verbose", "quiet", "syslog", "log")
LOG_HELP = ("Where the decision lines (each plan and step) go: syslog (as --syslog) or stderr "
            "(without -v's debug lines). Default: syslog with --syslog, stderr only with -v.")


def log_options() -> list[click.Option]:
    """Fresh Option objects (click params must not be shared between commands)."""
    return [
        click.Option(
            ["-v", "--verbose"], count=True,
            help="More log output on stderr: -v adds the decision lines and debug lines "
            "(observations, every Slurm command and "
            "Prometheus query with its duration), -vv the libraries' HTTP requests too.",
        ),
        click.Option(["-q", "--quiet"], is_flag=True, help="Only errors on stderr (no warnings)."),
        click.Option(["--syslog"], is_flag=True,
                     help="Send the decision log lines to syslog (/dev/log); stderr shows them "
                     "only with -v."),
        click.Option(["--log"], type=click.Choice(LOG_TARGETS), default=None, help=LOG_HELP),
    ]


def apply_log_options(verbose: int, quiet: bool, syslog: bool, log: str | None = None) -> None:
    """Set up logging from the options and remember them for subcommands to merge with."""
    from slurm_idle.logs import setup_logging

    setup_logging(verbose=verbose, quiet=quiet, syslog=syslog, log=log)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta["slurm_idle.log"] = (verbose, quiet, syslog, log)


class LoggedCommand(click.Command):
    """A command that also accepts the logging options after its name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(log_options())

    def invoke(self, ctx: click.Context) -> Any:
        verbose, quiet, syslog, log = (ctx.params.pop(name) for name in LOG_OPTION_NAMES)
        if verbose or quiet or syslog or log:
            g_verbose, g_quiet, g_syslog, g_log = ctx.meta.get("slurm_idle.log",
                                                               (0, False, False, None))
            apply_log_options(g_verbose + verbose, g_quiet or quiet, g_syslog or syslog,
                              log or g_log)
        return super().invoke(ctx)


class LoggedGroup(click.Group):
    """A group whose commands (and subgroups' commands) are LoggedCommands."""

    command_class = LoggedCommand
    group_class = type  # subgroups are LoggedGroups too


class LazyGroup(LoggedGroup):
    """The top group: a command's module (slurm_idle.cli.COMMAND_MODULES) is imported when the
    command is looked up, not when the CLI starts (a `explain` answers in a third less time)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            import importlib

            from slurm_idle.cli import COMMAND_MODULES

            module = COMMAND_MODULES.get(cmd_name)
            if module is not None:
                importlib.import_module(f"slurm_idle.cli.{module}")
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]
                        ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and self.get_command(ctx, args[0]) is None:
            from slurm_idle.cli import load_all

            load_all()  # a typo: click's "Did you mean" picks from every command
        return super().resolve_command(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        from slurm_idle.cli import COMMAND_MODULES

        return sorted(set(COMMAND_MODULES) | set(self.commands))
