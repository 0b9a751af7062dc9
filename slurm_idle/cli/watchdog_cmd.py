"""`slurm-idle watchdog`: the node-local dead-man's switch (slurm_idle/watchdog.py)."""

from __future__ import annotations

import signal
import socket
import threading
from types import FrameType
from typing import TYPE_CHECKING

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.errors import BadInput, ExitCode, SlurmIdleError

if TYPE_CHECKING:
    from slurm_idle.agent import Agent
    from slurm_idle.watchdog import WatchdogResult


@main.command()
@click.option("--node", "nodes", multiple=True, metavar="NODE",
              help="A pool node this watchdog answers for (repeatable); default: this host's "
                   "short name.")
@click.option("--all", "whole_pool", is_flag=True,
              help="Answer for the whole pool (lent replica jobs of placement: jobs included), "
                   "e.g. from a host beside the agents.")
@click.option("--every", "every_s", type=click.FloatRange(min=1), default=None, metavar="S",
              help="Check every S seconds until SIGTERM instead of once (a systemd service).")
@click.option("--dry-run", is_flag=True, help="Say what would be reclaimed; change nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print each pass as JSON (verdict, why, lease, nodes, actions, steps).")
@pass_ctx
def watchdog(ctx: Context, nodes: tuple[str, ...], whole_pool: bool, every_s: float | None,
             dry_run: bool, as_json: bool) -> None:
    """If no agent renewed the leadership lease for ha.dead_after_s, give this node back to serving.

    The dead-man's switch of ha.enabled: run it on each GPU node (a systemd timer every minute,
    or --every). While an agent renews the lease it does nothing. Once none has for
    ha.dead_after_s, with ha.on_dead: safe (the default) it reclaims its node's lend group with
    the agent's own code, on unknown load: drain with our tag, requeue the idle partition's jobs
    (never cancel them), start or wake the engine, wait for its health, serve; a reclaim the
    dead agent left half-done is carried on. With ha.on_dead: frozen it keeps the node lent and
    exits 1 with an error line (alert). Verdicts: alive, no-lease, nothing-lent, reclaimed,
    frozen. Exit 0: nothing to do or done; 1: a step failed, or frozen; 2: usage or config.
    """
    config = ctx.config()
    if not config.ha.enabled:
        raise BadInput("the watchdog needs ha.enabled: true (without a lease there is no dead "
                       "agent to tell)")
    if whole_pool and nodes:
        raise BadInput("give --node or --all, not both")
    scope: tuple[str, ...] = ()
    if not whole_pool:
        scope = nodes or (socket.gethostname().split(".")[0],)
        pool = {n for m in config.models for r in m.replicas for n in r.nodes}
        unknown = [n for n in scope if n not in pool]
        if unknown:
            raise BadInput(f"{', '.join(unknown)}: not a node of the pool in the config (name "
                           "one with --node, or use --all)")
    stop = threading.Event()
    if every_s is not None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    failed = _passes(ctx, scope, every_s, dry_run, as_json, stop)
    if failed:
        raise click.exceptions.Exit(ExitCode.FAILED)


def _one_pass(agent: Agent, scope: tuple[str, ...], dry_run: bool) -> WatchdogResult | None:
    from slurm_idle.lock import try_lock
    from slurm_idle.watchdog import watch

    if dry_run:
        return watch(agent, scope, dry_run=True)
    with try_lock(agent.config.paths.lock, agent.clock()) as locked:
        # a tick or an admin command here holds it: the next pass looks again
        return watch(agent, scope) if locked else None


def _passes(ctx: Context, scope: tuple[str, ...], every_s: float | None, dry_run: bool,
            as_json: bool, stop: threading.Event) -> bool:
    from slurm_idle.watchdog import RECLAIMED

    agent = ctx.agent(read_only=dry_run)
    failed = False
    said = ""
    while True:
        try:
            result = _one_pass(agent, scope, dry_run)
        except SlurmIdleError as exc:  # slurmctld failing over: say so, try again next pass
            click.echo(f"watchdog: {exc}", err=True)
            result, failed = None, True
        if result is not None:
            failed = result.failed
            line = f"watchdog: {result.verdict}: {result.why}"
            if as_json:
                echo_json(result.as_json())
            elif line != said or result.verdict == RECLAIMED:
                click.echo(line, err=result.failed)
                for step in result.steps:
                    click.echo(f"{step.action} {step.node}: {step.from_phase.value} -> "
                               f"{step.to_phase.value} [{step.outcome.value}] "
                               f"{step.duration_s:.1f}s" + (f": {step.error}" if step.error else ""))
            said = line
        if every_s is None or stop.wait(every_s):
            return failed
