"""`slurm-idle simulate`: replay a load trace against a policy."""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import not_built


@main.command()
@click.argument("trace", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def simulate(trace: str | None, as_json: bool) -> None:
    """Simulate a fleet on a load trace under a policy and score it."""
    not_built("simulate")
