"""Commands that act on the pool: tick, status, explain, pin, unpin, lend, reclaim.

They parse, build the agent from the config (slurm_idle.wiring) and print; the decisions and
effects live in policy.py, agent.py and transitions.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import Journal, RouterOutcome, RouterRecord, TickRecord, TransitionRecord
from slurm_idle.lifecycle import DRAINED_PHASES, format_reason
from slurm_idle.lock import lock_holder, try_lock
from slurm_idle.model import ActionKind, GroupView, NodeView, Observation, Phase
from slurm_idle.status import group_rows, model_rows, node_rows, render_status, replica_rows
from slurm_idle.topology import group_views


def _agent(ctx: Context, read_only: bool = False) -> Any:
    from slurm_idle.wiring import build_agent

    return build_agent(ctx.config(), read_only=read_only)


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
    agent = _agent(ctx, read_only=dry_run)
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
    else: never touched), unknown (not managed yet, or down).
    """
    from slurm_idle.doctor import status_warnings

    agent = _agent(ctx, read_only=True)
    obs = agent.observe()
    plans = agent.assessor(obs, agent.config, obs.now)
    nodes, models = node_rows(obs), model_rows(obs, plans)
    errors = [*obs.errors, *status_warnings(agent.config, obs),
              *_lock_warning(agent.config.paths.lock, obs.now)]
    router_line = _add_router_states(agent, nodes)
    replicas = replica_rows(obs, agent.config)
    if as_json:
        echo_json({"nodes": nodes, "models": models, "errors": errors,
                   "replicas": replicas, "groups": group_rows(obs, agent.config)})
    else:
        click.echo(render_status(nodes, models, errors, replicas))
        if router_line:
            click.echo(router_line)


def _add_router_states(agent: Any, nodes: list[dict[str, Any]]) -> str | None:
    """Each row's `router_state` (in, out, missing, unknown; `none` without a router) read
    from the router now; the loud line `status` prints when some model has no router."""
    from slurm_idle.router.none import WARNING

    # The router knows a replica by its head node: a node a replica only spans (gpu7 of a
    # replica on gpu[6-7]) shows its head's state.
    config = agent.config
    head = {row["name"]: row["name"] if config.replica(row["name"]) is not None
            else config.replicas_on(row["name"])[0][1].node for row in nodes}
    heads = list(dict.fromkeys(head.values()))
    states = agent.router.states(heads) if agent.router is not None else {}
    kinds = {}
    for row in nodes:
        kind = config.router_for(row["model"]).kind
        kinds[row["model"]] = kind
        row["router_state"] = "none" if kind == "none" else states.get(head[row["name"]], "unknown")
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
    """Why the latest decisions were taken (for NODE, or all nodes), from the journal."""
    config = ctx.config()
    records = list(Journal(Path(config.paths.journal)).typed())
    transitions = [r for r in records if isinstance(r, TransitionRecord | RouterRecord)
                   and (node is None or r.node == node
                        or (isinstance(r, TransitionRecord) and node in r.nodes))]
    ticks = [r for r in records if isinstance(r, TickRecord)]
    if node is not None and node not in config.pool_nodes:
        raise SlurmIdleError(f"{node} is not a pool node in {ctx.resolved_config_path}")
    shown = transitions[-last:]
    if as_json:
        echo_json({"transitions": [r.to_json() for r in shown if isinstance(r, TransitionRecord)],
                   "router": [r.to_json() for r in shown if isinstance(r, RouterRecord)],
                   "last_tick": ticks[-1].to_json() if ticks else None})
        return
    if not shown:
        click.echo(f"no transitions journaled{' for ' + node if node else ''} in {config.paths.journal}")
    for r in shown:
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


def _group(obs: Observation, config: Any, node: str) -> GroupView:
    """The lend group of `node` (what a lend or reclaim moves: the node and its partners)."""
    for g in group_views(obs, config):
        if node in g.group.nodes:
            return g
    raise SlurmIdleError(f"{node} is not a pool node")


def _view(obs: Observation, node: str) -> NodeView:
    for v in obs.nodes:
        if v.name == node:
            return v
    pool = ", ".join(v.name for v in obs.nodes)
    raise SlurmIdleError(f"{node} is not a pool node (pool: {pool})")


def _locked_admin_action(ctx: Context, fn: Any) -> Any:
    config = ctx.config()
    with try_lock(config.paths.lock) as locked:
        if not locked:
            raise SlurmIdleError(
                f"a tick is running (pid {lock_holder(config.paths.lock) or '?'}); try again in a minute"
            )
        return fn()


def _print_steps(steps: list[Any], as_json: bool, dry_run: bool, action: Any) -> None:
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
    if steps and steps[-1].outcome == "waiting":
        click.echo(f"{action.node} is still {steps[-1].from_phase.value}; the next tick carries on")


def _count_transitions(config: Any, steps: list[Any]) -> None:
    """Admin transitions count in the agent's metrics too (alerts watch the counter)."""
    if config.paths.textfile is None:
        return
    from slurm_idle.agent_metrics import add_transitions

    add_transitions(config.paths.textfile,
                    [(s.from_phase.value, s.to_phase.value) for s in steps if s.outcome == "ok"])


def _force(ctx: Context, node: str, kind: ActionKind, dry_run: bool, as_json: bool) -> None:
    from slurm_idle.transitions import action_for_admin

    agent = _agent(ctx, read_only=dry_run)

    def run() -> None:
        obs = agent.observe()
        view = _view(obs, node)
        if view.phase is Phase.ADMIN:
            raise SlurmIdleError(f"{node} is drained by an admin ({view.node.reason!r}); slurm-idle never touches it")
        if kind is ActionKind.LEND and view.pinned:
            raise SlurmIdleError(f"{node} is pinned; `slurm-idle unpin {node}` first")
        group = _group(obs, agent.config, node)
        if group.phase is Phase.ADMIN:
            raise SlurmIdleError(f"{node} is in lend group {','.join(group.group.nodes)}, which an "
                                 "admin drained; slurm-idle never touches it")
        wanted = Phase.SERVING if kind is ActionKind.LEND else Phase.LENT
        if group.phase is not wanted and not (kind is ActionKind.RECLAIM and group.phase is Phase.UNKNOWN):
            raise SlurmIdleError(
                f"{node} is {group.phase.value}, not {wanted.value}; cannot {kind.value} it now"
                " (see `slurm-idle status`)"
            )
        # The group moves as one: the action names its key node, from the group's phase.
        action = replace(action_for_admin(replace(view, phase=group.phase), kind,
                                          f"admin: slurm-idle {kind.value} {node}"), node=group.name)
        steps = [] if dry_run else agent.run_actions([action], obs)
        _count_transitions(agent.config, steps)
        _print_steps(steps, as_json, dry_run, action)
        if any(s.outcome == "error" for s in steps):
            raise SlurmIdleError(f"{kind.value} {node} failed: {steps[-1].error}")

    _locked_admin_action(ctx, run)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def lend(ctx: Context, node: str, dry_run: bool, as_json: bool) -> None:
    """Force NODE from serving to lent (admin), through the normal transition path.

    The replica finishes its in-flight requests, the engine is stopped and the node RESUMEd
    into the idle partition. The planner may take it back at a later tick if load needs it.
    """
    _force(ctx, node, ActionKind.LEND, dry_run, as_json)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def reclaim(ctx: Context, node: str, dry_run: bool, as_json: bool) -> None:
    """Force NODE from lent back to serving (admin): jobs requeued, vLLM restarted."""
    _force(ctx, node, ActionKind.RECLAIM, dry_run, as_json)


def _set_pin(ctx: Context, node: str, pinned: bool, dry_run: bool) -> None:
    agent = _agent(ctx, read_only=dry_run)
    tag = agent.config.slurm.tag

    def run() -> None:
        obs = agent.observe()
        view = _view(obs, node)
        if view.phase is Phase.ADMIN:
            raise SlurmIdleError(f"{node} is drained by an admin ({view.node.reason!r}); not touching it")
        if view.phase in DRAINED_PHASES:
            reason = format_reason(tag, view.phase, view.phase_since or obs.now, pinned)
            if dry_run:
                click.echo(f"would set {node} reason to {reason!r}")
                return
            agent.slurm.drain(node, reason)
            click.echo(f"{node} {'pinned' if pinned else 'unpinned'} ({view.phase.value})")
            return
        if not pinned:
            click.echo(f"{node} is {view.phase.value}; nothing to unpin")
            return
        from slurm_idle.powersave import powered_only

        # A lent node Slurm powered down is pinned like any other: the reclaim powers it up.
        if view.phase in {Phase.LENT, Phase.UNKNOWN} and (not view.node.down or powered_only(view.node)):
            # Pinning a lent node means: bring it back now and keep it.
            from slurm_idle.transitions import action_for_admin

            pinned_view = replace(view, pinned=True)
            action = action_for_admin(pinned_view, ActionKind.RECLAIM, f"admin: slurm-idle pin {node}")
            if dry_run:
                click.echo(f"would reclaim {node} and keep it serving")
                return
            steps = agent.run_actions([action], replace(obs, nodes=tuple(
                pinned_view if v.name == node else v for v in obs.nodes)))
            _count_transitions(agent.config, steps)
            _print_steps(steps, False, False, action)
            if any(s.outcome == "error" for s in steps):
                raise SlurmIdleError(f"pin {node}: reclaiming it failed: {steps[-1].error}")
            return
        raise SlurmIdleError(f"{node} is {view.phase.value}; cannot pin it now")

    _locked_admin_action(ctx, run)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@pass_ctx
def pin(ctx: Context, node: str, dry_run: bool) -> None:
    """Keep NODE serving: the planner never lends it. A lent NODE is reclaimed first."""
    _set_pin(ctx, node, True, dry_run)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@pass_ctx
def unpin(ctx: Context, node: str, dry_run: bool) -> None:
    """Release a pinned NODE back to the planner."""
    _set_pin(ctx, node, False, dry_run)


