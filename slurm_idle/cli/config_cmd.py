"""`slurm-idle config`: check and show the configuration."""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.config import (
    Config,
    ConfigInvalid,
    ConfigProblem,
    load_config_located,
)
from slurm_idle.config.problems import locate
from slurm_idle.config.provenance import format_settings, settings
from slurm_idle.errors import ConfigError
from slurm_idle.topology import lend_groups
from slurm_idle.yamlfile import Positions


@main.group()
def config() -> None:
    """Check the config (every problem, at its line) and show the values in force."""


@config.command()
@click.argument("file", required=False, metavar="[FILE]")
@click.option("--json", "as_json", is_flag=True,
              help='Print the validated config as JSON; if invalid, {"ok": false, "errors": [...]}.')
@pass_ctx
def check(ctx: Context, file: str | None, as_json: bool) -> None:
    """Validate the config: every problem at its line, exit 2 if any.

    Checks FILE (default: the --config path). Exit 0 if valid. If not, exit 2 with one line
    per problem, in file order: FILE:LINE:COLUMN, the dotted key, what is wrong and, for a
    misspelt key, the key meant ("did you mean ...?"). Every command that loads a bad config
    prints the same lines."""
    path = file or ctx.resolved_config_path
    try:
        cfg, positions = load_config_located(path)
        _check_timing(cfg, positions, path)
    except ConfigError as exc:
        if not as_json:
            raise
        problems = (exc.problems if isinstance(exc, ConfigInvalid)
                    else [ConfigProblem(path=None, message=str(exc))])
        echo_json({"ok": False, "file": path, "errors": [p.as_json() for p in problems]})
        raise click.exceptions.Exit(exc.exit_code) from None
    if as_json:
        echo_json(cfg.model_dump(mode="json"))
        return
    nodes = len(cfg.pool_nodes)
    replicas = sum(len(m.replicas) for m in cfg.models)
    groups = len(lend_groups(cfg))
    jobs = sum(m.job.replicas for m in cfg.models if m.job is not None)  # placement: jobs
    click.echo(f"{path}: OK ({len(cfg.models)} model(s), {nodes} pool node(s), {replicas} "
               f"replica(s), {groups} lend group(s)"
               + (f", {jobs} replica job(s)" if jobs else "") + ")")


def _check_timing(cfg: Config, positions: Positions, path: str) -> None:
    """The grace must fit in a tick: a reclaim waits the grace within one tick, then requeues."""
    grace, budget = cfg.slurm.requeue_grace_s, cfg.timeouts.tick_budget_s
    if grace >= budget:
        line, column = locate(("slurm", "requeue_grace_s"), positions)
        raise ConfigInvalid(path, [ConfigProblem(
            "slurm.requeue_grace_s",
            f"slurm.requeue_grace_s ({grace:g}) must be shorter than timeouts.tick_budget_s "
            f"({budget:g}): a reclaim waits the grace within one tick, then requeues and starts "
            "the engine; lower the grace or raise the budget", line, column)])


@config.command()
@click.argument("file", required=False, metavar="[FILE]")
@click.option("--json", "as_json", is_flag=True,
              help='As JSON: {"file": ..., "settings": {KEY: {"value": ..., "source": ...}}}.')
@pass_ctx
def show(ctx: Context, file: str | None, as_json: bool) -> None:
    """Show the effective config and where each value comes from.

    Reads FILE (default: the --config path). One `key = value  (source)` line per setting,
    defaults included, like `scontrol show config`; the source is `file:LINE` (a value the
    file sets, or one its shorthand expands) or `default`. Exit 2 if the file is invalid, with
    the lines of `config check`."""
    path = file or ctx.resolved_config_path
    cfg, positions = load_config_located(path)
    rows = settings(cfg, positions)
    if as_json:
        echo_json({"file": path,
                   "settings": {r.key: {"value": r.value, "source": r.source} for r in rows}})
        return
    for line in format_settings(rows):
        click.echo(line)
