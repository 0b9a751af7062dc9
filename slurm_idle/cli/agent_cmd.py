"""`slurm-idle agent`: run the tick as a long-running loop with fast checks (slurm_idle/loop.py)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx


@main.command()
@click.option("--json", "as_json", is_flag=True,
              help="On exit, print the passes run as JSON (ticks, fast_checks, fast_actions, errors).")
@click.option("--instance", metavar="NAME", default=None,
              help="This agent's name in the leadership lease (ha.enabled), default: the short "
                   "host name. Two agents on one host (a test) need two names.")
@pass_ctx
def agent(ctx: Context, as_json: bool, instance: str | None) -> None:
    """Run full ticks every policy.tick_interval_s and fast checks in between, until SIGTERM.

    A full tick is exactly `slurm-idle tick` (same lock, state in Slurm, journal). Between two
    ticks, every policy.fast_interval_s, a fast check observes the same way and only starts the
    reclaims that a queue, a hot KV cache or TTFT over its SLO ask for: a surge is met within
    seconds instead of at the next cron minute. Run it from etc/systemd/slurm-idle-agent.service
    instead of the cron entry or the tick timer (both may run: the lock keeps passes apart).
    SIGTERM or SIGINT stop it between passes; a pass in flight ends within
    timeouts.tick_budget_s and leaves any transition in Slurm for the next tick to carry on.
    Its decision lines go to syslog with --syslog (as the shipped unit runs it), to stderr with
    --log stderr or -v; without either, stderr gets only warnings and errors.

    With ha.enabled, several agents (on the slurmctld primary and backup hosts) may run: the one
    holding the leadership lease acts, the others watch and take over within ha.lease_s after it
    stops renewing; on SIGTERM the leader hands the lease back at once (docs/architecture.md).
    """
    from slurm_idle.loop import run_loop
    from slurm_idle.wiring import under_lease

    config = ctx.config()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    click.echo(f"slurm-idle agent: ticks every {config.policy.tick_interval_s}s, fast checks every "
               f"{config.policy.fast_interval_s}s (0: none); SIGTERM stops it", err=True)
    if config.ha.enabled:
        click.echo(f"slurm-idle agent: under the leadership lease (ha.lease_s {config.ha.lease_s:g}"
                   f" s), instance {instance or 'this host'}", err=True)
    stats = run_loop(under_lease(ctx.agent(), instance), stop)
    summary = {"ticks": stats.ticks, "fast_checks": stats.fast_checks,
               "fast_actions": stats.fast_actions, "errors": stats.errors}
    if as_json:
        echo_json(summary)
    else:
        click.echo(f"slurm-idle agent: stopped after {stats.ticks} tick(s), {stats.fast_checks} fast "
                   f"check(s) ({stats.fast_actions} fast action(s), {stats.errors} error(s))", err=True)
