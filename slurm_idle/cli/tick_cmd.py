"""Commands that act on the pool: tick, status, explain, pin, unpin, lend, reclaim.

They parse, get the agent from the context's factory (slurm_idle.wiring's by default) and
print; the decisions and effects live in policy.py, agent.py, transitions.py and, for the
admin's pin/unpin/lend/reclaim, admin.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import (
    AdminRecord,
    Journal,
    RouterOutcome,
    RouterRecord,
    StepOutcome,
    TickRecord,
    TransitionRecord,
)
from slurm_idle.model import ActionKind
from slurm_idle.status import group_rows, model_rows, node_rows, render_status, replica_rows

if TYPE_CHECKING:
    from slurm_idle.admin import AdminResult
    from slurm_idle.agent import Agent


@main.command()
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the actions and steps taken as JSON.")
@pass_ctx
def tick(ctx: Context, dry_run: bool, as_json: bool) -> None:
    """One reconcile pass: lock, observe, plan, act, journal.

    Run it from cron every minute. Another tick still running makes this one exit 0 at once.
    Transitions that need longer than the tick budget (engine cold start, jobs leaving a node)
    are left in their phase, written in Slurm, and carried on by the next tick.
    """
    agent = ctx.agent(read_only=dry_run)
    result = agent.tick(dry_run=dry_run)
    if as_json:
        echo_json(result.as_json() | {"dry_run": dry_run})
    elif result.lock_problem:
        pass  # the agent logged it as an error (stderr, and syslog under cron); exit 1 below
    elif result.locked_out:
        click.echo(f"slurm-idle: {result.locked_out}; nothing to do", err=True)
    elif not result.error:
        for plan in result.plans:
            click.echo(f"{plan.model}: {plan.serving_replicas} serving, {plan.needed_replicas} needed ({plan.reason})")
        if not result.actions:
            click.echo("no action")
        for action in result.actions:
            prefix = "would " if dry_run else ""
            click.echo(f"{prefix}{action.kind.value} {action.node}: {action.from_phase.value} -> "
                       f"{action.to_phase.value}: {action.reason}")
        for step in result.steps:
            click.echo(f"  {step.node} {step.from_phase.value} -> {step.to_phase.value} "
                       f"[{step.outcome}] {step.duration_s:.1f}s" + (f": {step.error}" if step.error else ""))
    if result.error or result.lock_problem:
        # The agent already logged "tick failed: ..." (stderr, and syslog under cron).
        raise click.exceptions.Exit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def status(ctx: Context, as_json: bool) -> None:
    """Every pool node's phase and every model's serving/needed replicas and load signals.

    Phases: serving, retiring, lending, lent, reclaiming, starting, admin (drained by someone
    else: never touched), unknown (not managed yet, or down). Each replica meant to serve is
    asked for /health now; one that fails it, is asleep, is not the expected engine or has no
    fresh metrics is shown `unhealthy` with why (its /health URL), and listed again in closing
    `attention:` lines. `--json`: each replica's `healthy`, `health_reason`, `health_summary`,
    and a top-level `attention` list.
    """
    from slurm_idle.doctor import status_warnings
    from slurm_idle.replica_health import attention, probe_serving

    agent = ctx.agent(read_only=True)
    obs = agent.observe()
    plans = agent.assessor(obs, agent.config, obs.now)
    nodes, models = node_rows(obs), model_rows(obs, plans)
    errors = [*obs.errors, *status_warnings(agent.config, obs),
              *_lock_warning(agent.config.paths.lock, obs.now)]
    router_line = _add_router_states(agent, nodes)
    replicas = replica_rows(obs, agent.config, probe_serving(obs, agent.config, agent.engine_for))
    if as_json:
        echo_json({"nodes": nodes, "models": models, "errors": errors,
                   "replicas": replicas, "groups": group_rows(obs, agent.config),
                   "attention": attention(replicas)})
    else:
        click.echo(render_status(nodes, models, errors, replicas))
        if router_line:
            click.echo(router_line)


def _add_router_states(agent: Agent, nodes: list[dict[str, Any]]) -> str | None:
    """Each row's `router_state` (in, out, missing, unknown; `none` without a router) read
    from the router now; the loud line `status` prints when some model has no router."""
    # The router knows each replica on its own; a node shows its head replicas' state (one
    # word when they agree, else each's: `in,out`), a node a replica only spans (gpu7 of a
    # replica on gpu[6-7]) its head's.
    from slurm_idle.router import targets_headed
    from slurm_idle.router.none import WARNING

    config = agent.config
    head = {row["name"]: row["name"] if config.replica(row["name"]) is not None
            else config.replicas_on(row["name"])[0][1].node for row in nodes}
    names = {h: [t.name for t in targets_headed(config, h)] for h in dict.fromkeys(head.values())}
    wanted = [n for ns in names.values() for n in ns]
    states = agent.router.states(wanted) if agent.router is not None else {}
    kinds = {}
    for row in nodes:
        kind = config.router_for(row["model"]).kind
        kinds[row["model"]] = kind
        seen = list(dict.fromkeys(states.get(n, "unknown") for n in names[head[row["name"]]]))
        row["router_state"] = "none" if kind == "none" else (",".join(seen) or "unknown")
    bare = sorted(m for m, k in kinds.items() if k == "none")
    return f"WARNING {WARNING} (models: {', '.join(bare)})" if bare else None


def _lock_warning(path: str, now: float) -> list[str]:
    """A stranger holding the tick lock, as a status warning (nothing when it cannot be told:
    the lock's directory is the agent user's alone)."""
    from slurm_idle.lock import inspect

    holder = inspect(path, now, record=False)
    if holder is None or holder.is_tick:
        return []
    return [f"{holder.describe()}: no tick can act until it is released"]


@main.command()
@click.argument("node", required=False)
@click.option("-n", "--last", default=10, show_default=True, type=click.IntRange(min=1),
              help="How many transitions to show (at least 1).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def explain(ctx: Context, node: str | None, last: int, as_json: bool) -> None:
    """Why the latest decisions were taken (for NODE, or all nodes), from the journal.

    Shows phase changes, router calls and an admin's pin/unpin, newest last.
    """
    config = ctx.config()
    records = list(Journal(Path(config.paths.journal)).typed())
    transitions = [r for r in records if isinstance(r, TransitionRecord | RouterRecord | AdminRecord)
                   and (node is None or r.node == node
                        or (isinstance(r, TransitionRecord) and node in r.nodes))]
    ticks = [r for r in records if isinstance(r, TickRecord)]
    replica_jobs = {f"{m.name}#{i}" for m in config.models if m.job is not None
                    for i in range(m.job.replicas)}  # `placement: jobs`: NODE may be model#index
    if node is not None and node not in config.pool_nodes and node not in replica_jobs:
        raise SlurmIdleError(f"{node} is not a pool node (nor a replica job, MODEL#INDEX) in "
                             f"{ctx.resolved_config_path}")
    shown = transitions[-last:]
    if as_json:
        echo_json({"transitions": [r.to_json() for r in shown if isinstance(r, TransitionRecord)],
                   "router": [r.to_json() for r in shown if isinstance(r, RouterRecord)],
                   "admin": [r.to_json() for r in shown if isinstance(r, AdminRecord)],
                   "last_tick": ticks[-1].to_json() if ticks else None})
        return
    if not shown:
        click.echo(f"no transitions journaled{' for ' + node if node else ''} in {config.paths.journal}")
    for r in shown:
        if isinstance(r, AdminRecord):  # pin/unpin (lend/reclaim journal transitions)
            failed = "" if r.outcome == StepOutcome.OK else f" FAILED ({r.detail})"
            click.echo(f"{r.time or '?'} {r.node}: {r.command} by an admin while "
                       f"{r.phase}{failed}")
            continue
        err = f" ({r.error})" if r.error else ""
        if isinstance(r, RouterRecord):
            verb = {"remove": "left", "add": "joined"}.get(r.call, r.call)
            if r.outcome != RouterOutcome.OK:
                verb = f"FAILED to be {'removed from' if r.call == 'remove' else 'added to'}"
            click.echo(f"{r.time or '?'} {r.node}: {verb} the router ({r.router}) because "
                       f"{r.reason}{err}")
            continue
        click.echo(f"{r.time or '?'} {r.node}: {r.from_phase} -> {r.to_phase} [{r.outcome}] "
                   f"because {r.reason}{err}")
    if ticks:
        t = ticks[-1]
        click.echo(f"last tick {t.time}: needed {t.needed}, serving {t.serving}, "
                   f"{t.actions} action(s), {t.errors} error(s)")


def _print_result(result: AdminResult, as_json: bool) -> None:
    """An admin command's action and steps (lend, reclaim, pin of a lent node) or its line."""
    action, steps, dry_run = result.action, result.steps, result.dry_run
    if action is None or (result.command in ("pin", "unpin") and dry_run):
        click.echo(result.message)
        return
    if as_json:
        echo_json({"dry_run": dry_run, "action": {"kind": action.kind.value, "node": action.node,
                   "from": action.from_phase.value, "to": action.to_phase.value,
                   "reason": action.reason}, "steps": [s.record() for s in steps]})
        return
    if dry_run:
        click.echo(f"would {action.kind.value} {action.node}: {action.from_phase.value} -> "
                   f"{action.to_phase.value}")
    for s in steps:
        click.echo(f"{s.node} {s.from_phase.value} -> {s.to_phase.value} [{s.outcome}] "
                   f"{s.duration_s:.1f}s" + (f": {s.error}" if s.error else ""))
    if result.waiting:
        click.echo(f"{action.node} is still {steps[-1].from_phase.value}; the next tick carries on")


def _admin(ctx: Context, command: str, node: str, dry_run: bool, as_json: bool = False) -> None:
    """Run one admin command (slurm_idle.admin) and print what it did; a failed step prints
    the steps taken, then the error line."""
    from slurm_idle import admin

    agent = ctx.agent(read_only=dry_run)
    try:
        if command == "pin":
            result = admin.pin(agent, node, dry_run)
        elif command == "unpin":
            result = admin.unpin(agent, node, dry_run)
        else:
            result = admin.force(agent, node, ActionKind(command), dry_run)
    except admin.AdminFailed as exc:
        _print_result(exc.result, as_json)
        raise
    _print_result(result, as_json)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def lend(ctx: Context, node: str, dry_run: bool, as_json: bool) -> None:
    """Force NODE from serving to lent (admin), through the normal transition path.

    The replica finishes its in-flight requests, the engine is stopped and the node RESUMEd
    into the idle partition. The planner may take it back at a later tick if load needs it.
    A `placement: jobs` replica is named MODEL#INDEX: its job is cancelled after the drain.
    """
    _admin(ctx, "lend", node, dry_run, as_json)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def reclaim(ctx: Context, node: str, dry_run: bool, as_json: bool) -> None:
    """Force NODE from lent back to serving (admin): jobs requeued, vLLM restarted.

    MODEL#INDEX: a `placement: jobs` replica's job is submitted (Slurm preempts idle jobs)."""
    _admin(ctx, "reclaim", node, dry_run, as_json)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@pass_ctx
def pin(ctx: Context, node: str, dry_run: bool) -> None:
    """Keep NODE serving: the planner never lends it. A lent NODE is reclaimed first.

    MODEL#INDEX pins a `placement: jobs` replica (the pin is in its job's Comment)."""
    _admin(ctx, "pin", node, dry_run)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@pass_ctx
def unpin(ctx: Context, node: str, dry_run: bool) -> None:
    """Release a pinned NODE (or MODEL#INDEX replica) back to the planner."""
    _admin(ctx, "unpin", node, dry_run)
