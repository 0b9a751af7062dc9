"""The dead-man's switch: lent capacity goes back to serving when no agent renews the lease.

Run on each GPU node (`slurm-idle watchdog`, from a systemd timer or in a loop with `--every`;
the HealthCheckProgram pattern LBNL's NHC follows: each node acts on itself, no central service).
It reads the leadership lease (leadership.py) from Slurm; when no agent renewed it for
`ha.dead_after_s`:
- `ha.on_dead: safe` (the default): its node's lend group is reclaimed by the agent's own code,
  as the planner decides it when the load is unknown and `reclaim_on_unknown_metrics` holds:
  drained with our tag, the idle partition's jobs requeued (never cancelled), the engine started
  or woken, health waited for, back in the router and serving. A transition already under way
  (a reclaim the dead agent left half-done) is carried on the same way.
- `ha.on_dead: frozen`: nothing moves; the watchdog says so as an error (exit 1, syslog) so the
  site's alerting sees it.
The load is never read (the node may not reach Prometheus): unknown load, reclaim everything.
Every action is journaled with `"event": "watchdog"` and its steps' reasons name the watchdog.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from slurm_idle.agent import FAILED_OUTCOMES, Agent
from slurm_idle.config import Config, ModelConfig, ReplicaConfig
from slurm_idle.leadership import (
    ENGINE_WRITES,
    ROUTER_WRITES,
    SLURM_WRITES,
    Deposed,
    Fenced,
    Lease,
    SlurmLeaseStore,
)
from slurm_idle.lifecycle import arriving_phases
from slurm_idle.logs import get_logger
from slurm_idle.model import Action, ActionKind, ModelLoad, Observation, ReplicaLoad
from slurm_idle.slurm.protocol import PoolSlurm
from slurm_idle.steps import StepResult
from slurm_idle.topology import group_views

if TYPE_CHECKING:
    from slurm_idle.engine import Engine
    from slurm_idle.router import PoolRouters

log = get_logger(__name__)

#: How often the watchdog's fence reads the lease again while it reclaims.
FENCE_READ_S = 5.0

#: What a watchdog pass found, in `--json` and the journal.
ALIVE, NO_LEASE, FROZEN, NOTHING_LENT, RECLAIMED = (
    "alive", "no-lease", "frozen", "nothing-lent", "reclaimed")


class UnknownLoad:
    """A metrics source that knows nothing: the watchdog never reads the load."""

    def replica_loads(self, replicas: Sequence[tuple[str, ReplicaConfig]], *,
                      budget_s: float | None = None,
                      serving: Collection[str] | None = None) -> list[ReplicaLoad]:
        return [ReplicaLoad(model=m, node=r.nodes[0] if r.nodes else "", known=False)
                for m, r in replicas]

    def model_loads(self, models: Sequence[ModelConfig], now: float, *,
                    budget_s: float | None = None,
                    serving: Collection[str] | None = None) -> list[ModelLoad]:
        return [ModelLoad(model=m.name, known=False) for m in models]


@dataclass
class WatchdogResult:
    """One pass: the lease as read, what it meant, and the steps taken."""

    verdict: str
    why: str
    lease: dict[str, Any] | None
    nodes: tuple[str, ...]  # the nodes this watchdog answers for (empty: all)
    actions: list[Action] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    dry_run: bool = False

    @property
    def failed(self) -> bool:
        return self.verdict == FROZEN or any(s.outcome in FAILED_OUTCOMES for s in self.steps)

    def as_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "why": self.why, "lease": self.lease,
                "nodes": list(self.nodes), "dry_run": self.dry_run,
                "actions": [{"kind": a.kind.value, "node": a.node, "from": a.from_phase.value,
                             "to": a.to_phase.value, "reason": a.reason} for a in self.actions],
                "steps": [s.record() for s in self.steps]}


def fail_safe_config(config: Config) -> Config:
    """The agent's config as the watchdog plans with it: unknown load reclaims everything."""
    policy = config.policy.model_copy(update={"reclaim_on_unknown_metrics": True})
    return config.model_copy(update={"policy": policy})


def read_lease(agent: Agent) -> Lease | None:
    """The lease in Slurm (None: no agent ever led under ha)."""
    config = agent.config
    lease = SlurmLeaseStore(agent.slurm,  # type: ignore[arg-type]  # the backend
                            config.ha.partition or config.slurm.lend_partition, tidy=False).read()
    return lease if lease is not None and lease.instance else None


def watch(agent: Agent, nodes: Sequence[str] = (), dry_run: bool = False) -> WatchdogResult:
    """One pass for `nodes` (empty: every node of the pool)."""
    config = agent.config
    now = agent.clock()
    lease = read_lease(agent)
    scope = tuple(nodes)
    if lease is None:
        return WatchdogResult(NO_LEASE, "no leadership lease in Slurm: no agent ever led under "
                              "ha.enabled, nothing to watch", None, scope, dry_run=dry_run)
    seen = lease.as_json(now)
    age = lease.age_s(now)
    dead_after = config.ha.dead_after_s
    if age < dead_after:
        return WatchdogResult(ALIVE, f"{lease.instance} renewed the lease {age:.0f} s ago "
                              f"(dead after {dead_after:g} s)", seen, scope, dry_run=dry_run)
    why = (f"no agent renewed the lease for {age:.0f} s (ha.dead_after_s {dead_after:g}; last "
           f"{lease.instance} on {lease.host}, epoch {lease.epoch}"
           f"{', handed back' if lease.released else ''})")
    fence = StillDead(agent, lease)
    engine_for = agent.engine_for
    safe_agent = replace(
        agent, config=fail_safe_config(config), metrics=UnknownLoad(), journal_empty=False,
        on_tick=None,
        slurm=cast(PoolSlurm, Fenced(agent.slurm, SLURM_WRITES, fence)),
        engine_for=lambda model: cast("Engine", Fenced(engine_for(model), ENGINE_WRITES, fence)),
        router=None if agent.router is None else cast(
            "PoolRouters", Fenced(agent.router, ROUTER_WRITES, fence)))
    obs = safe_agent.observe()
    # Only what brings capacity back (the fast check's rule): a reclaim, a lend undone, the
    # carry-on of an arrival. Never a lend's carry-on, which would cancel a replica job.
    planned = [a for a in safe_agent.planner(obs, safe_agent.config, obs.now)
               if a.kind in (ActionKind.RECLAIM, ActionKind.ABORT_LEND)
               or (a.kind is ActionKind.CONTINUE and a.from_phase in arriving_phases())]
    if scope:
        planned = [a for a in planned if _touches(a, obs, config, scope)]
    actions = [replace(a, reason=f"watchdog: {why}; {a.reason}") for a in planned]
    if not actions:
        return WatchdogResult(NOTHING_LENT, why + ": nothing lent here", seen, scope,
                              dry_run=dry_run)
    if config.ha.on_dead == "frozen":
        log.error("watchdog: %s; ha.on_dead is frozen: %s stay(s) lent", why,
                  ", ".join(a.node for a in actions))
        result = WatchdogResult(FROZEN, why + "; ha.on_dead: frozen, kept lent", seen, scope,
                                actions, dry_run=dry_run)
        if not dry_run:
            _journal(agent, result, now)
        return result
    result = WatchdogResult(RECLAIMED, why, seen, scope, actions, dry_run=dry_run)
    log.warning("watchdog: %s: reclaiming %s", why, ", ".join(a.node for a in actions))
    if not dry_run:
        _journal(agent, result, now)
        result.steps = safe_agent.run_actions(actions, obs, cancel_duplicates=False)
    return result


def _touches(action: Action, obs: Observation, config: Config, scope: Sequence[str]) -> bool:
    """Whether the action is for this scope: its lend group's first node (sorted) is in it, so
    one watchdog drives a group of several nodes, not each of them at once; a replica job with
    a node in it. A lent replica job has no node (its job was cancelled): only a watchdog for
    the whole pool (`--all`) takes it back."""
    wanted = set(scope)
    for group in group_views(obs, config):
        if group.name == action.node:  # a group of several nodes: its first node's watchdog
            return min(v.name for v in group.nodes) in wanted
    return any(r.name == action.node and bool(wanted & set(r.nodes)) for r in obs.replica_jobs)


class StillDead:
    """The watchdog's fence: a write goes through only while no agent has renewed the lease
    since the watchdog found it dead (read again at most every FENCE_READ_S). An agent that
    comes back takes over; the watchdog's next write is refused and it stops."""

    def __init__(self, agent: Agent, seen: Lease) -> None:
        self.agent = agent
        self.seen = seen
        self.checked = agent.clock()

    def __call__(self) -> None:
        now = self.agent.clock()
        if now - self.checked < FENCE_READ_S:
            return
        lease = read_lease(self.agent)
        self.checked = now
        if lease is not None and not lease.released and (
                lease.epoch != self.seen.epoch or lease.renewed != self.seen.renewed):
            raise Deposed(f"{lease.instance} on {lease.host} leads again (epoch {lease.epoch}): "
                          "the watchdog stops, the agent carries on")


def _journal(agent: Agent, result: WatchdogResult, now: float) -> None:
    assert agent.journal is not None
    agent.journal.record({"ts": now, "event": "watchdog", "verdict": result.verdict,
                          "why": result.why, "nodes": [a.node for a in result.actions],
                          "lease": result.lease})
