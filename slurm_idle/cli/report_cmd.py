"""`slurm-idle report`: harvested GPU-hours, preemptions and savings."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.errors import ConfigError

if TYPE_CHECKING:
    from slurm_idle.slurm.protocol import SlurmBackend

WEEK_S = 7 * 24 * 3600.0


@main.command()
@click.option("--since", metavar="DATE", help="Start of the period (default: 7 days ago).")
@click.option("--until", metavar="DATE", help="End of the period (default: now).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--plot", metavar="FILE.png",
              help="Draw lent and used GPUs per hour (.png, .svg or .pdf; needs matplotlib).")
@click.option("--csv", "csv_path", metavar="FILE", help="Write the per-day table as CSV.")
@pass_ctx
def report(
    ctx: Context,
    since: str | None,
    until: str | None,
    as_json: bool,
    plot: str | None,
    csv_path: str | None,
) -> None:
    """Report what the idle pool gave: GPU-hours, jobs, preemptions, savings.

    Reads `sacct` (jobs of the lend partition, allocated gres/gpu, every run of a requeued job)
    and the agent's journal. DATE takes sacct's forms (now-1day, now-2hours, today, noon, 08:00),
    `yesterday`, YYYY-MM-DD or an ISO datetime, in policy.timezone unless it carries an offset. A requeued run is a preemption when the journal shows the agent
    reclaiming its node, or when it ended more than 3 min (120 s USR1 warning + 60 s) before its
    time limit; otherwise the job requeued itself at its limit. Work lost to a preemption is the
    preempted run's tail up to report.checkpoint_interval_s, or the whole run when that is unset
    (an upper bound). Lends, reclaims, reclaim latency and lent GPU-hours come from the journal
    (paths.journal): run the report where the tick runs.
    """
    from slurm_idle.report_io import (
        check_output_path,
        check_plot_ready,
        fetch_inference_runs,
        fetch_runs,
        make_report,
        write_csv,
        write_plot,
    )
    from slurm_idle.report_model import render_text
    from slurm_idle.when import parse_when

    config = ctx.config()
    tz = config.policy.timezone
    now = time.time()
    start = parse_when(since, tz, now) if since else now - WEEK_S
    end = parse_when(until, tz, now) if until else now
    if end <= start:
        raise ConfigError("the report period is empty: --until must be after --since")
    if csv_path:
        check_output_path(csv_path, "--csv")
    if plot:
        check_plot_ready(plot)  # before the CSV is written: all outputs or none
    from slurm_idle.slurm import make_backend

    slurm = make_backend(config)
    runs = fetch_runs(config, start, end, slurm)
    result = make_report(config, start, end, now, runs, slurm_gpus=_node_gres(slurm),
                         inference_runs=fetch_inference_runs(config, start, end, slurm))
    if result.journal is None:
        click.echo(f"slurm-idle: warning: no journal at {config.paths.journal} (paths.journal): "
                   "lends, reclaims, reclaim latency and lent GPU-hours are not counted; run "
                   "`report` on the host that runs `tick`", err=True)
    if csv_path:
        write_csv(result, csv_path)
    if plot:
        write_plot(result, plot)
    if as_json:
        echo_json(result.to_json())
    else:
        click.echo(render_text(result))


def _node_gres(slurm: SlurmBackend) -> dict[str, int]:
    """GPUs per node from Slurm's gres (what a lent node really lends); {} when Slurm cannot be
    read: the report then counts the GPUs the config's replicas use."""
    from slurm_idle.errors import SlurmIdleError

    try:
        return {n.name: n.gpus_total for n in slurm.nodes()}
    except (SlurmIdleError, OSError):
        return {}
