"""`plan()` and `assess()`: from one Observation to the actions of this tick. Pure.

Per model: count supply by phase, compute the need (capacity.py), then
- scale up at once when the need exceeds what serves or is coming back: abort RETIRING nodes
  first (cheapest), then bring LENDING nodes straight back (no jobs yet), then reclaim LENT
  nodes in `reclaim_order.reclaim_rank` order (jobs under policy.min_job_runtime_s last, then
  least work lost). Never rate-limited, never held by the window;
- scale down only when the need over the whole scale-down window is below what serves, the
  metrics are known, no scale-up is under way, inside the lending windows, above the floor and
  under the lent-fraction cap; at most `max_transitions_per_tick` LENDs per tick, pool-wide;
- outside the lending windows need every node back (needed = total), whether the metrics
  are known or not: the window's end is a promise to the jobs, kept through a metrics outage;
- carry every other transitional node one step on (CONTINUE; the agent checks the conditions);
- adopt unmanaged pool nodes into serving; never name an ADMIN node.
A replica in a serving phase whose engine reports sleeping serves nothing: it is not counted as
capacity (a lent node comes back in its place if the need says so), and, as with unknown
metrics, nothing of the model is lent while it sleeps; the node itself is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slurm_idle.config import Config, ModelConfig
from slurm_idle.lifecycle import next_phase
from slurm_idle.model import (
    Action,
    ActionKind,
    ModelLoad,
    ModelPlan,
    NodeView,
    Observation,
    Phase,
)
from slurm_idle.policy.capacity import Need, assess_need, default_forecast_lead_s
from slurm_idle.policy.reclaim_order import reclaim_rank, young_jobs
from slurm_idle.policy.windows import in_windows


@dataclass(frozen=True)
class _Model:
    """One model's nodes by phase and its verdict: the shared work of plan() and assess()."""

    config: ModelConfig
    by_phase: dict[Phase, list[NodeView]]
    adoptable: list[NodeView]
    total: int  # non-admin nodes
    known: bool  # metrics good enough to lend on
    in_window: bool  # inside the lending windows (always, without windows)
    need: Need
    needed: int  # what supply must reach now
    reason: str

    def nodes(self, *phases: Phase) -> list[NodeView]:
        return [n for p in phases for n in self.by_phase.get(p, [])]

    @property
    def taking_traffic(self) -> int:
        return sum(1 for n in self.nodes(Phase.SERVING, Phase.RETIRING) if not _asleep(n))


def _asleep(view: NodeView) -> bool:
    """The replica serves nothing: its engine reports sleeping (even on stale metrics: then it
    may still be), or its endpoint proved not to be the expected engine (`foreign`)."""
    return view.replica is not None and (view.replica.sleeping or view.replica.foreign)


def _load_known(load: ModelLoad | None, serving: list[NodeView]) -> tuple[bool, str]:
    if load is None:
        return False, "no load metrics for the model"
    if not load.known:
        return False, "model load metrics missing or stale"
    foreign = [n.name for n in serving if n.replica is not None and n.replica.foreign]
    if foreign:
        return False, f"serving replica(s) {', '.join(foreign)} not the expected engine (not counted)"
    blind = [n.name for n in serving if n.replica is None or not n.replica.known]
    if blind:
        return False, f"metrics unknown for serving replica(s) {', '.join(blind)}"
    asleep = [n.name for n in serving if _asleep(n)]
    if asleep:
        names = ", ".join(asleep)
        return False, f"engine asleep on serving replica(s) {names} (not counted until it wakes)"
    return True, ""


def _examine(
    obs: Observation, config: Config, model: ModelConfig, now: float, nodes: list[NodeView]
) -> _Model:
    """`nodes`: the model's nodes in observation order (grouped once for all models)."""
    views = sorted(nodes, key=lambda n: n.name)
    by_phase: dict[Phase, list[NodeView]] = {}
    for view in views:
        by_phase.setdefault(view.phase, []).append(view)
    adoptable = [
        n for n in by_phase.get(Phase.UNKNOWN, []) if not n.node.drained and not n.node.down
    ]
    total = sum(1 for n in views if n.phase is not Phase.ADMIN)
    taking = by_phase.get(Phase.SERVING, []) + by_phase.get(Phase.RETIRING, [])
    awake = [n for n in taking if not _asleep(n)]
    policy = config.policy
    load = obs.model_load(model.name)
    known, why_unknown = _load_known(load, taking)
    supply = len(awake) + sum(
        len(by_phase.get(p, [])) for p in (Phase.STARTING, Phase.RECLAIMING)
    ) + len(adoptable)
    floor = min(model.min_serving_replicas, total)
    # The window rule needs no metrics: outside every window all nodes come back, known load or
    # not (jobs rely on the window's end; a Prometheus outage must not extend their loan).
    window_ok = in_windows(now, policy.lending_windows, policy.timezone)
    outside = f"outside lending windows {', '.join(policy.lending_windows)} ({policy.timezone})"

    if load is None or not load.known:
        need = Need(up=0, down=None, reason=why_unknown)
        if not window_ok:
            needed, reason = total, f"{why_unknown}; {outside}: reclaiming everything"
        elif policy.reclaim_on_unknown_metrics:
            needed, reason = total, f"{why_unknown}: reclaiming everything (reclaim_on_unknown_metrics)"
        else:
            needed = max(floor, min(supply, total))
            reason = f"{why_unknown}: holding {needed} (nothing lent on unknown load)"
        return _Model(model, by_phase, adoptable, total, False, window_ok, need, needed, reason)

    replicas = [n.replica for n in awake if n.replica is not None]
    lead_s = default_forecast_lead_s(config, model.name)
    need = assess_need(model, policy, load, replicas, len(awake), total, lead_s)
    needed, reason = need.up, need.reason
    if not known:
        reason += f"; {why_unknown}: nothing lent"
    if not window_ok:
        needed = total
        reason += f"; {outside}"
    return _Model(model, by_phase, adoptable, total, known, window_ok, need, needed, reason)


def _running(view: NodeView) -> tuple[float, str]:
    return (view.replica.running if view.replica is not None else 0.0), view.name


def _stuck(view: NodeView, config: Config, now: float) -> bool:
    """A RECLAIMING/STARTING node older than its timeout (timeouts.reclaim_s / start_s)."""
    if view.phase_since is None:
        return False
    limit = config.timeouts.reclaim_s if view.phase is Phase.RECLAIMING else config.timeouts.start_s
    return now - view.phase_since > limit


def _act(kind: ActionKind, view: NodeView, to: Phase, reason: str, **details: float | str) -> Action:
    return Action(kind, view.name, view.model, view.phase, to, reason, dict(details))


def _plan_model(m: _Model, config: Config, now: float, lend_budget: int) -> list[Action]:
    policy = config.policy
    ckpt_s = config.report.checkpoint_interval_s
    actions: list[Action] = []
    touched: set[str] = set()
    serving = [v for v in m.nodes(Phase.SERVING) if not _asleep(v)]  # asleep: not capacity
    retiring = m.nodes(Phase.RETIRING)
    lending = m.nodes(Phase.LENDING)
    lent = m.nodes(Phase.LENT)
    coming = m.nodes(Phase.STARTING, Phase.RECLAIMING)
    # A node stuck past its timeout is still carried on, but no longer counted on: otherwise
    # one engine that never starts would hold the model below its need (and floor) forever.
    arriving = [v for v in coming if not _stuck(v, config, now)]

    for view in m.adoptable:
        actions.append(_act(ActionKind.ADOPT, view, Phase.RECLAIMING,
                            "unmanaged pool node: adopting it into serving (service first)"))
        touched.add(view.name)

    # Pinned nodes are never lent: stop their lend, bring them back from the idle partition.
    for view in retiring:
        if view.pinned:
            actions.append(_act(ActionKind.ABORT_LEND, view, Phase.SERVING, "pinned: keep serving"))
            touched.add(view.name)
    for view in lending:
        if view.pinned:
            actions.append(_act(ActionKind.RECLAIM, view, Phase.STARTING, "pinned: back to serving"))
            touched.add(view.name)
    for view in lent:
        if view.pinned:
            actions.append(_act(ActionKind.RECLAIM, view, Phase.RECLAIMING, "pinned: back to serving"))
            touched.add(view.name)

    supply = (
        len(serving) + len(arriving) + len(m.adoptable)
        + sum(1 for v in retiring if v.pinned and not _asleep(v))
        + sum(1 for v in lending + lent if v.pinned)
    )
    deficit = m.needed - supply
    if deficit > 0:
        up_reason = f"{m.reason}; {supply} serving or coming back"
        candidates = (
            [(ActionKind.ABORT_LEND, v, Phase.SERVING)
             for v in sorted(retiring, key=_running, reverse=True) if not _asleep(v)]
            + [(ActionKind.RECLAIM, v, Phase.STARTING) for v in lending]
            + [(ActionKind.RECLAIM, v, Phase.RECLAIMING) for v in sorted(
                lent, key=lambda v: reclaim_rank(v, now, ckpt_s, policy.min_job_runtime_s))]
        )
        for kind, view, to in candidates:
            if deficit <= 0:
                break
            if view.name in touched:
                continue
            young = young_jobs(view, now, policy.min_job_runtime_s) if kind is ActionKind.RECLAIM else []
            exempt = (f"; job(s) {', '.join(map(str, young))} under policy.min_job_runtime_s, but no "
                      "other lent node is left") if young else ""
            actions.append(_act(kind, view, to, f"{up_reason}: needs {m.needed}{exempt}",
                                needed=m.needed, supply=supply))
            touched.add(view.name)
            deficit -= 1
    elif (
        lend_budget > 0 and m.known and m.in_window and m.need.down is not None
        and not arriving and not m.adoptable
    ):
        max_lent = int(policy.max_lent_fraction * m.total + 1e-9)
        out = len(retiring) + len(lending) + len(lent)
        lendable = [v for v in sorted(serving, key=_running) if not v.pinned]
        count = min(len(serving) - m.need.down, max_lent - out, len(lendable), lend_budget)
        for view in lendable[: max(0, count)]:
            actions.append(_act(
                ActionKind.LEND, view, Phase.RETIRING,
                f"{m.need.reason}; {len(serving)} serving, needs {m.need.down} over the window: lending",
                needed=m.need.down, serving=len(serving),
            ))
            touched.add(view.name)

    if not m.known:
        # Never lend on unknown evidence: a lend under way stops where it is and comes back.
        for view in retiring:
            if view.name not in touched:
                actions.append(_act(ActionKind.ABORT_LEND, view, Phase.SERVING,
                                    f"{m.reason}: not lending on unknown metrics"))
                touched.add(view.name)
        for view in lending:
            if view.name not in touched:
                actions.append(_act(ActionKind.RECLAIM, view, Phase.STARTING,
                                    f"{m.reason}: not lending on unknown metrics"))
                touched.add(view.name)

    for view in retiring + lending + coming:
        if view.name not in touched:
            nxt = next_phase(view.phase)
            assert nxt is not None  # retiring/lending/reclaiming/starting all move on
            actions.append(_act(ActionKind.CONTINUE, view, nxt,
                                f"carry on {view.phase.value} -> {nxt.value}"))
    return actions


def _models(obs: Observation, config: Config, now: float) -> list[_Model]:
    by_model: dict[str, list[NodeView]] = {}
    for view in obs.nodes:  # one pass, not one per model
        by_model.setdefault(view.model, []).append(view)
    return [_examine(obs, config, model, now, by_model.get(model.name, [])) for model in config.models]


def plan(observation: Observation, config: Config, now: float) -> list[Action]:
    """The actions of this tick, in model order; deterministic for equal inputs."""
    actions: list[Action] = []
    budget = config.policy.max_transitions_per_tick
    for m in _models(observation, config, now):
        model_actions = _plan_model(m, config, now, budget)
        budget -= sum(1 for a in model_actions if a.kind is ActionKind.LEND)
        actions.extend(model_actions)
    return actions


def assess(observation: Observation, config: Config, now: float) -> list[ModelPlan]:
    """Per model: replicas needed now, replicas taking traffic, and why."""
    return [
        ModelPlan(m.config.name, m.needed, m.taking_traffic, m.reason)
        for m in _models(observation, config, now)
    ]


def apply_actions(observation: Observation, actions: list[Action]) -> Observation:
    """The observation as it would be if every action succeeded (for dry runs and tests)."""
    moved = {a.node: a.to_phase for a in actions}
    nodes = tuple(
        replace(n, phase=moved[n.name], phase_since=observation.now) if n.name in moved else n
        for n in observation.nodes
    )
    return replace(observation, nodes=nodes)
