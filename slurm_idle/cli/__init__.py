"""The `slurm-idle` command line: parse, load config, call library code, print.

Each command group lives in its own module here and registers itself on `main`; the library
code it calls knows nothing about click. Errors of the `SlurmIdleError` family become one line
on stderr and their exit code (the table in slurm_idle/errors.py, shown by `--help`).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from slurm_idle import __version__
from slurm_idle.cli.common import Context, run_guarded
from slurm_idle.cli.logopts import LOG_HELP, LazyGroup, apply_log_options
from slurm_idle.config import CONFIG_ENV, DEFAULT_CONFIG_PATH
from slurm_idle.errors import exit_code_table
from slurm_idle.logs import LOG_TARGETS

# \b keeps click from rewrapping the table (one code a line).
EXIT_CODES_EPILOG = "\b\nExit codes (every command):\n" + exit_code_table()


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES_EPILOG,
)
@click.version_option(__version__, prog_name="slurm-idle")
@click.option(
    "--config",
    "config_path",
    metavar="PATH",
    default=None,
    help=f"Config file. Default: ${CONFIG_ENV}, then {DEFAULT_CONFIG_PATH}.",
)
@click.option("-v", "--verbose", count=True,
              help="More log output on stderr (-v the decisions and debug, -vv libraries too).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr (no warnings).")
@click.option("--syslog", is_flag=True,
              help="Send the decision log lines to syslog (/dev/log); stderr shows them only with -v.")
@click.option("--log", type=click.Choice(LOG_TARGETS), default=None, help=LOG_HELP)
@click.pass_context
def main(ctx: click.Context, config_path: str | None, verbose: int, quiet: bool, syslog: bool,
         log: str | None) -> None:
    """Lend the idle GPUs of an LLM inference fleet to a preemptible Slurm partition.

    slurm-idle reads the vLLM engines' own metrics, decides how many replicas the traffic
    needs, drains/resumes Slurm nodes accordingly and lends the freed GPUs to the `idle`
    partition, taking them back (jobs requeued, vLLM restarted) when traffic rises.
    Run `slurm-idle tick` from cron every minute; see `slurm-idle COMMAND --help`.
    -v/-q/--syslog/--log may also follow the command: `slurm-idle tick -v`.
    """
    apply_log_options(verbose, quiet, syslog, log)
    if isinstance(ctx.obj, Context):  # given by the caller (its agent factory): keep it
        ctx.obj.config_path = config_path
    else:
        ctx.obj = Context(config_path=config_path)


#: Which module defines each command: a command's module is imported only when that command
#: runs (or help lists them all), so `explain` does not pay for `simulate`'s imports.
COMMAND_MODULES = {
    "agent": "agent_cmd", "config": "config_cmd", "doctor": "doctor_cmd",
    "explain": "tick_cmd", "jobs": "jobs_cmd", "lend": "tick_cmd", "metrics": "metrics_cmd",
    "pin": "tick_cmd", "pipeline": "jobs_cmd", "reclaim": "tick_cmd", "report": "report_cmd",
    "simulate": "simulate_cmd", "status": "tick_cmd", "submit": "jobs_cmd", "tick": "tick_cmd",
    "unpin": "tick_cmd", "watchdog": "watchdog_cmd", "web": "web_cmd",
}


def load_all() -> None:
    """Import every command module (each registers its commands on `main`), in a fixed order."""
    import importlib

    for module in sorted(set(COMMAND_MODULES.values())):
        importlib.import_module(f"slurm_idle.cli.{module}")


def entry(argv: list[str] | None = None) -> Any:
    """Console-script entry point with the error guard."""
    return run_guarded(main, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(entry())
