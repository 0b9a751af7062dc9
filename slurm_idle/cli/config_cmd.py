"""`slurm-idle config`: check and show the configuration."""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.config import load_config
from slurm_idle.errors import ConfigError
from slurm_idle.topology import lend_groups


@main.group()
def config() -> None:
    """Validate and show the slurm-idle configuration."""


@config.command()
@click.argument("file", required=False, metavar="[FILE]")
@click.option("--json", "as_json", is_flag=True, help="Print the validated config as JSON.")
@pass_ctx
def check(ctx: Context, file: str | None, as_json: bool) -> None:
    """Validate FILE (default: the --config path). Exit 0 if valid, 2 with the reason if not."""
    path = file or ctx.resolved_config_path
    cfg = load_config(path)
    grace, budget = cfg.slurm.requeue_grace_s, cfg.timeouts.tick_budget_s
    if grace >= budget:
        raise ConfigError(
            f"{path}: slurm.requeue_grace_s ({grace:g}) must be shorter than "
            f"timeouts.tick_budget_s ({budget:g}): a reclaim waits the grace within one tick, "
            "then requeues and starts the engine; lower the grace or raise the budget"
        )
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
