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
from slurm_idle.errors import BadInput, ExitCode, SlurmIdleError
from slurm_idle.journal import (
    AdminRecord,
    Journal,
    RouterOutcome,
    RouterRecord,
    StepOutcome,
    TransitionRecord,
    iso,
)
from slurm_idle.logs import get_logger
from slurm_idle.model import ActionKind

if TYPE_CHECKING:
    from slurm_idle.admin import AdminResult
    from slurm_idle.agent import Agent, TickResult
    from slurm_idle.steps import StepResult

log = get_logger(__name__)


@main.command()
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the actions and steps taken as JSON.")
@click.option("--instance", metavar="NAME", default=None,
              help="This tick's name in the leadership lease (ha.enabled), default: the short "
                   "host name.")
@pass_ctx
def tick(ctx: Context, dry_run: bool, as_json: bool, instance: str | None) -> None:
    """One reconcile pass: lock, observe, plan, act, journal.

    Run it from cron every minute. It prints one line per transition made (stdout) and
    nothing at all when nothing happened (a step still waiting changed nothing), so cron mails
    only news; warnings and errors go to stderr once, the decision lines to syslog with
    --syslog (and to stderr with -v; -q leaves stderr only the errors). Another tick still running makes this one exit 0 at once,
    silently (-v says so). A step that failed or is stuck past its phase's timeout is an error
    line on stderr and makes the tick exit 1; the next tick retries it. Transitions that need longer than the tick budget (engine cold
    start, jobs leaving a node) are left in their phase, written in Slurm, and carried on by
    the next tick.

    With ha.enabled the tick acts only if it can take the leadership lease (free, handed back,
    or not renewed for 2 x ha.lease_s) and hands it back when done; while an agent leads it
    only says so (-v).
    """
    from slurm_idle.wiring import under_lease

    agent = ctx.agent(read_only=dry_run)
    if not dry_run:
        agent = under_lease(agent, instance)
    if agent.leadership is None:
        result = agent.tick(dry_run=dry_run)
    else:
        with agent.leadership.renewing():
            result = agent.tick()
    if result.standby:
        log.info("%s; nothing to do", result.standby)
    if as_json:
        echo_json(result.as_json() | {"dry_run": dry_run})
    elif result.locked_out:
        # Another tick overlapping is routine, not news for cron's mail: a log line (-v).
        log.info("%s; nothing to do", result.locked_out)
    elif dry_run:
        if not result.error:
            _print_dry_run(result)
    else:
        # Each transition made, once (even when the tick failed after making it); nothing at
        # all when nothing happened, so cron mails only news. A step carried over (waiting)
        # or left to an admin (skipped) changed nothing: a decision line for syslog (--syslog)
        # and -v. A failed or stuck one is an error: its one line on stderr is the step's own
        # log line (transitions.py), and the tick exits 1 below.
        for step in result.steps:
            if step.outcome is StepOutcome.OK:
                click.echo(f"{step.action} {step.node}: {step.from_phase.value} -> "
                           f"{step.to_phase.value} [ok] {step.duration_s:.1f}s: {step.reason}"
                           + (f" ({step.detail})" if step.detail else ""))
    if result.errors:
        # A step that failed or is stuck past its phase's timeout, the tick itself, or a
        # stranger's lock: exit 1 as every command does for a failed action (a systemd timer
        # shows the unit failed). The agent already logged each as an error, once.
        raise click.exceptions.Exit(ExitCode.FAILED)


def _print_dry_run(result: TickResult) -> None:
    """`tick --dry-run` is asked for by a person: the plans and what would be done."""
    for plan in result.plans:
        click.echo(f"{plan.model}: {plan.serving_replicas} serving, {plan.needed_replicas} needed "
                   f"({plan.reason})")
    if not result.actions:
        click.echo("no action")
    for action in result.actions:
        click.echo(f"would {action.kind.value} {action.node}: {action.from_phase.value} -> "
                   f"{action.to_phase.value}: {action.reason}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def status(ctx: Context, as_json: bool) -> None:
    """Every pool node's phase and every model's serving/needed replicas and load signals.

    Phases: serving, retiring, lending, lent, reclaiming, held (empty of jobs, but a GPU still
    holds someone's memory: nothing wakes on it), starting, admin (drained by someone else, or
    handed to an admin with a Reason saying why: never touched), unknown (not managed yet, or
    down). Each replica meant to serve is
    asked for /health now; one that fails it, is asleep, is not the expected engine or has no
    fresh metrics is shown `unhealthy` with why (its /health URL) and since when a tick first
    saw it so (UTC), and listed again in closing `attention:` lines. `--json`: each replica's
    `healthy`, `health_reason`, `health_summary`, `unhealthy_since`, and a top-level
    `attention` list. Each node row: `gpus_total`, `gpus_used` (Slurm's counts) and `gpus`,
    every GPU's memory as the site's GPU exporter reports it (`index`, `used_mib`,
    `total_mib`, `holder`: the job it names, or null), null when not observed.
    """
    from slurm_idle.doctor import status_warnings
    from slurm_idle.replica_health import attention, probe_serving
    from slurm_idle.status import group_rows, model_rows, node_rows, render_status, replica_rows
    from slurm_idle.unhealthy_since import annotate, read, since_path

    agent = ctx.agent(read_only=True)
    obs = agent.observe()
    plans = agent.assessor(obs, agent.config, obs.now)
    nodes, models = node_rows(obs), model_rows(obs, plans)
    errors = [*obs.errors, *status_warnings(agent.config, obs),
              *_lock_warning(agent.config.paths.lock, obs.now)]
    router_line = _add_router_states(agent, nodes)
    replicas = replica_rows(obs, agent.config, probe_serving(obs, agent.config, agent.engine_for))
    annotate(replicas, read(since_path(agent.config.paths.journal)))
    leader, ha_events = _leadership(agent, obs.now)
    if as_json:
        echo_json({"nodes": nodes, "models": models, "errors": errors,
                   "replicas": replicas, "groups": group_rows(obs, agent.config),
                   "attention": attention(replicas), "leader": leader, "ha_events": ha_events})
    else:
        click.echo(render_status(nodes, models, errors, replicas, now=obs.now))
        if router_line:
            click.echo(router_line)
        if agent.config.ha.enabled:
            click.echo(_leader_line(leader, agent.config.ha.lease_s))
            for event in ha_events:
                click.echo(f"  {event.get('time', '')} {_ha_event_line(event)}")


def _on_the_leaders_host(agent: Agent) -> None:
    """With ha, an admin's change is made on the host whose agent leads (its lock keeps the
    command and that agent's passes apart); from another host it would race the leader."""
    config = agent.config
    if not config.ha.enabled:
        return
    import socket

    from slurm_idle.leadership import SlurmLeaseStore

    lease = SlurmLeaseStore(agent.slurm,  # type: ignore[arg-type]  # the backend
                            config.ha.partition or config.slurm.lend_partition, tidy=False).read()
    here = socket.gethostname().split(".")[0]
    if (lease is not None and lease.instance and not lease.released
            and lease.age_s(agent.clock()) <= config.ha.lease_s and lease.host != here):
        from slurm_idle.errors import Refused

        raise Refused(f"agent {lease.instance} on {lease.host} leads (epoch {lease.epoch}): run "
                      f"this command on {lease.host}, where its lock keeps it apart from that "
                      "agent's passes (or stop that agent first)")


#: How far back `status` lists leadership changes and watchdog actions.
HA_EVENTS_S = 86400.0


def _leadership(agent: Agent, now: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The lease in Slurm (ha.enabled) and the last day's leadership and watchdog records."""
    if not agent.config.ha.enabled:
        return None, []
    from slurm_idle.leadership import SlurmLeaseStore

    config = agent.config
    try:
        lease = SlurmLeaseStore(agent.slurm,  # type: ignore[arg-type]  # the backend
                                config.ha.partition or config.slurm.lend_partition,
                                tidy=False).read()
    except SlurmIdleError as exc:
        log.warning("cannot read the leadership lease: %s", exc)
        lease = None
    events = [r for r in Journal(Path(config.paths.journal)).records(since=now - HA_EVENTS_S)
              if r.get("event") in ("leadership", "watchdog") and float(r.get("ts", 0)) >= now - HA_EVENTS_S]
    leader = lease.as_json(now) if lease is not None and lease.instance else None
    return leader, events[-20:]


def _leader_line(leader: dict[str, Any] | None, lease_s: float) -> str:
    if leader is None:
        return "leader: none (no agent has taken the leadership lease)"
    state = ("handed back" if leader["released"] else
             "STALE" if leader["age_s"] > lease_s else "renewed")
    return (f"leader: {leader['instance']} on {leader['host']}, epoch {leader['epoch']} since "
            f"{iso(leader['since'])} ({state} {leader['age_s']:.0f} s ago)")


def _ha_event_line(event: dict[str, Any]) -> str:
    if event.get("event") == "watchdog":
        nodes = ", ".join(event.get("nodes") or []) or "-"
        return f"watchdog {event.get('verdict')} {nodes}: {event.get('why', '')}"
    return (f"leadership {event.get('change')}: {event.get('instance')} "
            f"(epoch {event.get('epoch') or event.get('lost_epoch')}): {event.get('why', '')}")


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

    Shows phase changes, router calls and an admin's pin/unpin of the nodes and replicas in
    the config now, in the order they happened, newest last. A node whose phase now (as `status` shows it) is not where its journal left
    it gets a line saying the journal predates its current state (a restarted pool).
    """
    from slurm_idle.explain import read_recent, stale_in_history

    config = ctx.config()
    replica_jobs = {f"{m.name}#{i}" for m in config.models if m.job is not None
                    for i in range(m.job.replicas)}  # `placement: jobs`: NODE may be model#index
    if node is not None and node not in config.pool_nodes and node not in replica_jobs:
        raise BadInput(f"{node} is not a pool node (nor a replica job, MODEL#INDEX) in "
                       f"{ctx.resolved_config_path}")
    # The current pool's nodes and replicas only: a journal kept across a pool's change (a
    # node taken out of the config, a model renamed) must not explain what is no longer there.
    wanted = {node} if node is not None else set(config.pool_nodes) | replica_jobs

    def shown_here(r: TransitionRecord | RouterRecord | AdminRecord) -> bool:
        return (r.node in wanted or (isinstance(r, TransitionRecord) and bool(wanted & set(r.nodes)))
                or (isinstance(r, RouterRecord) and r.replica in wanted))

    # Read from the journal's end until the last N are found (journal_files.backward).
    journal = Journal(Path(config.paths.journal))
    recent = read_recent(journal, shown_here, last)
    shown, last_tick = recent.events, recent.last_tick
    phases = _current_phases(ctx) if shown else {}
    stale = stale_in_history(journal, shown, {n: p for n, p in phases.items() if node in (None, n)})
    if as_json:
        echo_json({"transitions": [r.to_json() for r in shown if isinstance(r, TransitionRecord)],
                   "router": [r.to_json() for r in shown if isinstance(r, RouterRecord)],
                   "admin": [r.to_json() for r in shown if isinstance(r, AdminRecord)],
                   "last_tick": last_tick.to_json() if last_tick else None,
                   "journal_predates": [n.to_json() for n in stale]})
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
        # A waiting step says what it waits for (e.g. the GPU, the MiB and the holder).
        why = f" ({r.error or r.detail})" if r.error or r.detail else ""
        click.echo(f"{r.time or '?'} {r.node}: {r.from_phase} -> {r.to_phase} [{r.outcome}] "
                   f"because {r.reason}{why}")
    for node_note in stale:
        click.echo(node_note.line())
    if last_tick is not None:
        t = last_tick
        when = iso(t.last_ts)
        run = f" (the last of {t.count} idle ticks alike since {t.time})" if t.count > 1 else ""
        click.echo(f"last tick {when}{run}: needed {t.needed}, serving {t.serving}, "
                   f"{t.actions} action(s), {t.errors} error(s)")


def _current_phases(ctx: Context) -> dict[str, str]:
    """Each pool node's phase now, as `status` shows it (read from Slurm alone: the phase lives
    in the node's Reason and Comment, no metrics needed); empty when Slurm cannot be read
    (explain still shows the journal, it just cannot tell whether it is current)."""
    from slurm_idle.lifecycle import derive_phase

    config = ctx.config()
    try:
        nodes = {n.name: n for n in ctx.slurm().nodes()}
    except (SlurmIdleError, OSError):
        return {}
    return {name: derive_phase(nodes[name], config.slurm.tag).phase.value
            for name in config.pool_nodes if name in nodes}


def _step_line(s: StepResult) -> str:
    return (f"{s.node} {s.from_phase.value} -> {s.to_phase.value} [{s.outcome}] "
            f"{s.duration_s:.1f}s" + (f": {s.error}" if s.error else ""))


def _print_result(result: AdminResult, as_json: bool, streamed: bool = False) -> None:
    """An admin command's action and steps (lend, reclaim, pin of a lent node) or its line;
    `streamed`: the steps were printed as they ended (not again)."""
    action, steps, dry_run = result.action, result.steps, result.dry_run
    if action is None or (result.command in ("pin", "unpin") and dry_run):
        click.echo(result.message)
        return
    if as_json:
        echo_json({"dry_run": dry_run, "action": {"kind": action.kind.value, "node": action.node,
                   "from": action.from_phase.value, "to": action.to_phase.value,
                   "reason": action.reason}, "steps": [s.record() for s in steps],
                   "forced": result.message or None})
        return
    if result.message:  # the rule a --force overrode
        click.echo(f"slurm-idle: {result.message}", err=True)
    if dry_run:
        click.echo(f"would {action.kind.value} {action.node}: {action.from_phase.value} -> "
                   f"{action.to_phase.value}")
    if not streamed:
        for s in steps:
            click.echo(_step_line(s))
    if result.waiting:
        click.echo(f"{action.node} is still {steps[-1].from_phase.value}; the next tick carries on")


def _admin(ctx: Context, command: str, node: str, dry_run: bool, as_json: bool = False,
           override: bool = False) -> None:
    """Run one admin command (slurm_idle.admin) and print what it did; a failed step prints
    the steps taken, then the error line.

    Without --json each step is printed as it ends (a reclaim waits out the lent jobs' grace
    and the engine's start: a minute or more), and a line on stderr says before the grace
    what is being waited for."""
    from slurm_idle import admin

    agent = ctx.agent(read_only=dry_run)
    if not dry_run:
        _on_the_leaders_host(agent)
    printed: list[StepResult] = []

    def on_step(step: StepResult) -> None:
        click.echo(_step_line(step))
        printed.append(step)

    def notify(line: str) -> None:
        click.echo(f"slurm-idle: {line}", err=True)

    live = None if as_json else on_step
    try:
        if command == "pin":
            result = admin.pin(agent, node, dry_run, on_step=live)
        elif command == "unpin":
            result = admin.unpin(agent, node, dry_run)
        else:
            result = admin.force(agent, node, ActionKind(command), dry_run, on_step=live,
                                 notify=None if as_json else notify, override=override)
    except admin.AdminFailed as exc:
        _print_result(exc.result, as_json, streamed=bool(printed))
        raise
    _print_result(result, as_json, streamed=bool(printed))


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--force", "override", is_flag=True,
              help="Lend even below a model's floor or over policy.max_lent_fraction (journaled).")
@pass_ctx
def lend(ctx: Context, node: str, dry_run: bool, as_json: bool, override: bool) -> None:
    """Force NODE from serving to lent (admin), through the normal transition path.

    The replica finishes its in-flight requests, the engine is stopped and the node RESUMEd
    into the idle partition. The planner may take it back at a later tick if load needs it.
    A `placement: jobs` replica is named MODEL#INDEX: its job is cancelled after the drain.

    The lend obeys the planner's limits: one that would leave a model with fewer serving
    replicas than min_serving_replicas, or more lent than policy.max_lent_fraction, is refused
    (exit 2, one line naming the rule; --dry-run too). --force lends anyway and journals the
    rule it overrode; the agent's fast check then brings a replica back to the floor.
    """
    _admin(ctx, "lend", node, dry_run, as_json, override)


@main.command()
@click.argument("node")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def reclaim(ctx: Context, node: str, dry_run: bool, as_json: bool) -> None:
    """Force NODE from lent back to serving (admin): jobs requeued, vLLM restarted.

    MODEL#INDEX: a `placement: jobs` replica's job is submitted (Slurm preempts idle jobs).
    Each step is printed as it ends; before the lent jobs' grace (slurm.requeue_grace_s) a
    line on stderr says which jobs are given it."""
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
