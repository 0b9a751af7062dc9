"""`slurm-idle report`: harvested GPU-hours, preemptions and savings."""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import not_built


@main.command()
@click.option("--since", metavar="DATE", help="Start of the period (default: 7 days ago).")
@click.option("--until", metavar="DATE", help="End of the period (default: now).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--plot", metavar="FILE.png", help="Draw lent and used GPUs per hour.")
@click.option("--csv", "csv_path", metavar="FILE", help="Write the per-day table as CSV.")
def report(since: str | None, until: str | None, as_json: bool, plot: str | None, csv_path: str | None) -> None:
    """Report what the idle pool gave: GPU-hours, jobs, preemptions, savings."""
    not_built("report")
