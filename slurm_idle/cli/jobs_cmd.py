"""Researcher commands: submit, jobs, pipeline."""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import not_built


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the batch script; submit nothing.")
@click.option("--json", "as_json", is_flag=True, help='Print {"job_id": ...}.')
def submit(file: str, dry_run: bool, as_json: bool) -> None:
    """Submit a container job spec (YAML) to the preemptible idle partition."""
    not_built("submit")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def jobs(as_json: bool) -> None:
    """List our jobs with state, restarts, node and last checkpoint age."""
    not_built("jobs")


@main.group()
def pipeline() -> None:
    """Run multi-step pipelines (pre-process -> train -> eval) as dependent idle jobs."""


@pipeline.command("run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the steps; submit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def pipeline_run(file: str, dry_run: bool, as_json: bool) -> None:
    """Submit every step of a pipeline with afterok dependencies."""
    not_built("pipeline run")
