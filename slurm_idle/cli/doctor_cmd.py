"""`slurm-idle doctor`: is this site set up the way slurm-idle needs it?"""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx

_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


@main.command()
@click.option("--json", "as_json", is_flag=True,
              help='Machine-readable: {"checks": [{"name", "status", "detail"}]}.')
@pass_ctx
def doctor(ctx: Context, as_json: bool) -> None:
    """Check the live cluster against what slurm-idle relies on.

    Reads `scontrol show config` / `show partition` and the nodes, makes a `sbatch --test-only`
    submission (no job is created), queries the metrics and each engine's /health (a serving
    replica whose engine does not answer fails the engine check, by its URL), and looks at the
    agent's files. Each check is ok, warn or fail with the fix in one line. Changes nothing.
    Exit 0 when nothing fails (warnings allowed), 1 otherwise.
    """
    from slurm_idle.doctor import diagnose, exit_code

    checks = diagnose(ctx.config())
    if as_json:
        echo_json({"checks": [c.as_json() for c in checks]})
    else:
        for check in checks:
            click.echo(f"{_MARK[check.status]}  {check.name:<20} {check.detail}")
        fails = sum(c.status == "fail" for c in checks)
        warns = sum(c.status == "warn" for c in checks)
        click.echo(f"{len(checks)} checks: {fails} failed, {warns} warning(s)")
    rc = exit_code(checks)
    if rc:
        raise click.exceptions.Exit(rc)
