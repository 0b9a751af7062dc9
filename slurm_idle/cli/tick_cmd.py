"""Commands that act on the pool: tick, status, explain, pin, unpin, lend, reclaim."""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import not_built


@main.command()
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the actions taken as JSON.")
def tick(dry_run: bool, as_json: bool) -> None:
    """One reconcile pass: lock, observe, plan, act, journal (run from cron every minute)."""
    not_built("tick")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(as_json: bool) -> None:
    """Show every pool node's phase and every model's serving/needed replicas."""
    not_built("status")


@main.command()
@click.argument("node", required=False)
def explain(node: str | None) -> None:
    """Explain the latest decisions (for NODE, or all) from the journal."""
    not_built("explain")


@main.command()
@click.argument("node")
def pin(node: str) -> None:
    """Keep NODE serving: the planner will never lend it."""
    not_built("pin")


@main.command()
@click.argument("node")
def unpin(node: str) -> None:
    """Release a pinned NODE back to the planner."""
    not_built("unpin")


@main.command()
@click.argument("node")
def lend(node: str) -> None:
    """Force NODE from serving to lent (admin), through the normal transition path."""
    not_built("lend")


@main.command()
@click.argument("node")
def reclaim(node: str) -> None:
    """Force NODE from lent back to serving (admin): jobs requeued, vLLM restarted."""
    not_built("reclaim")
