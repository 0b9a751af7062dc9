"""`slurm-idle metrics`: read vLLM engine metrics by direct scrape or through Prometheus."""

from __future__ import annotations

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import not_built


@main.group()
def metrics() -> None:
    """Read vLLM engine metrics (direct /metrics scrape or Prometheus)."""


@metrics.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def scrape(url: str, as_json: bool) -> None:
    """Scrape one vLLM server's /metrics page."""
    not_built("metrics scrape")


@metrics.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def query(as_json: bool) -> None:
    """Read every replica's metrics through Prometheus."""
    not_built("metrics query")
