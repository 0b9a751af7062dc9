"""`plan()` and `assess()`: from one Observation to the actions of this tick. Pure.

Per model: count supply by phase, compute the need (capacity.py), then
- scale up at once when the need exceeds what serves or is coming back: abort RETIRING nodes
  first (cheapest), then bring LENDING nodes straight back (no jobs yet), then reclaim LENT
  nodes in `reclaim_order.reclaim_rank` order (jobs under policy.min_job_runtime_s last, then
  least work lost; a group by the worst of its nodes). Never rate-limited, never held by the
  window;
- scale down only when the need over the whole scale-down window is below what serves, the
  metrics are known, no scale-up is under way, inside the lending windows, above the floor and
  under the lent-fraction cap; at most `max_transitions_per_tick` LENDs per tick, pool-wide;
- outside the lending windows need every node back (needed = total), whether the metrics
  are known or not: the window's end is a promise to the jobs, kept through a metrics outage;
- carry every other transitional node one step on (CONTINUE; the agent checks the conditions);
- adopt unmanaged pool nodes into serving; never name an ADMIN node.
Lend groups: the planner decides *replicas* per model, but Slurm lends whole nodes, so what moves
is a lend group (topology.py): every replica on it retires, is lent and comes back together. A
scale-up counts the replicas of the model a group brings back; a lend picks groups (the most GPUs
freed first, idle ones before busy ones) only while every model with a replica on the group keeps
its need over the window, its floor and its `max_lent_fraction`. A group's replicas always share
its phase, so no group is ever left half-retired. One-replica-per-node pools are groups of one.
A replica in a serving phase that is out of service (policy/service.py: asleep, failing the
tick's probe, or not our engine) serves nothing: it is not counted as capacity (a lent node
comes back in its place if the need says so), and, as with unknown metrics, nothing of the
model is lent meanwhile; a sleeping one's node is left alone, one not our engine is repaired.
Over 400 lines while the policy is being tuned (issue 15): plan() and assess() share its helpers.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from slurm_idle.config import Config, ModelConfig
from slurm_idle.lifecycle import arriving_phases, lent_phases, next_phase, overdue, takes_traffic
from slurm_idle.model import (
    Action,
    ActionKind,
    GroupView,
    ModelLoad,
    ModelPlan,
    Observation,
    Phase,
    Replica,
    ReplicaLoad,
)
from slurm_idle.policy.capacity import Need, assess_need, default_forecast_lead_s
from slurm_idle.policy.jobs import assess_jobs, plan_jobs
from slurm_idle.policy.reclaim_order import reclaim_rank, young_jobs
from slurm_idle.policy.rules import floor as floor_of
from slurm_idle.policy.rules import lend_evidence, may_lend, stop_lend
from slurm_idle.policy.service import failing, out_of_service
from slurm_idle.policy.windows import in_windows
from slurm_idle.topology import group_index, group_views


@dataclass(frozen=True)
class _Unit:
    """One group as one model sees it: the group and that model's replicas on it."""

    group: GroupView
    replicas: tuple[Replica, ...]
    # The replicas' loads and how many serve, worked out once (a tick reads them many times).
    _loads: tuple[ReplicaLoad | None, ...] = field(default=(), compare=False)
    _capacity: int = field(default=0, compare=False)
    _arriving: int = field(default=0, compare=False)

    @classmethod
    def of(cls, group: GroupView, replicas: tuple[Replica, ...],
           failed_starts: frozenset[str] = frozenset()) -> _Unit:
        """`failed_starts`: replicas whose start or wake failed since they last served (not
        arriving)."""
        loads = tuple(group.load(r) for r in replicas)
        return cls(group, replicas, loads, sum(1 for ld in loads if not out_of_service(ld)),
                   sum(1 for r, ld in zip(replicas, loads, strict=True)
                       if not failing(ld) and r.name not in failed_starts))

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def phase(self) -> Phase:
        return self.group.phase

    def loads(self) -> tuple[ReplicaLoad | None, ...]:
        return self._loads

    def capacity(self) -> int:
        """Replicas that serve: not asleep, not failing their health check."""
        return self._capacity

    def arriving(self) -> int:
        """Replicas that serve once the group is back (starting, reclaiming, or reclaimed this
        tick): asleep ones too, the start wakes them; not one seen failing its health check,
        which counts for nothing in any phase, or a group with a dead engine would hold a
        model short while a lent group that could serve stays lent; nor one whose start or
        wake failed (a wake is expected in seconds: capacity is taken elsewhere at once)."""
        return self._arriving

    def running(self) -> float:
        return sum(load.running for load in self.loads() if load is not None)

    def group_running(self) -> float:
        """Requests running on every replica of the group, whatever its model."""
        loads = (self.group.load(r) for r in self.group.group.replicas)
        return sum(load.running for load in loads if load is not None)


def _asleep(unit: _Unit) -> bool:
    """Every replica of the model on the group is out of service (none of it is capacity)."""
    return unit.capacity() == 0


@dataclass(frozen=True)
class _Model:
    """One model's groups by phase and its verdict: the shared work of plan() and assess()."""

    config: ModelConfig
    by_phase: dict[Phase, list[_Unit]]
    adoptable: list[_Unit]
    total: int  # replicas on non-admin groups
    known: bool  # metrics good enough to lend on
    in_window: bool  # inside the lending windows (always, without windows)
    need: Need
    needed: int  # what supply must reach now
    reason: str
    arriving: int = 0  # groups on their way back (RECLAIMING, HELD, STARTING) not stuck

    def units(self, *phases: Phase) -> list[_Unit]:
        return [u for p in phases for u in self.by_phase.get(p, [])]

    @property
    def taking_traffic(self) -> int:
        return sum(u.capacity() for p, units in self.by_phase.items() if takes_traffic(p) for u in units)

    @property
    def lendable(self) -> bool:
        """Load known, in a window, evidence over the window, nothing on its way back."""
        return (self.known and self.in_window and self.need.down is not None
                and not self.arriving and not self.adoptable)


def _load_known(load: ModelLoad | None, serving: list[_Unit]) -> tuple[bool, str]:
    return lend_evidence(load, ((r.name, ld) for u in serving
                                for r, ld in zip(u.replicas, u.loads(), strict=True)))


def _adoptable(group: GroupView) -> bool:
    return group.phase is Phase.UNKNOWN and not any(v.node.drained or v.node.down for v in group.nodes)


def _examine(obs: Observation, config: Config, model: ModelConfig, now: float, units: list[_Unit]) -> _Model:
    """`units`: the model's groups in observation order (grouped once for all models)."""
    units = sorted(units, key=lambda u: u.name)
    by_phase: dict[Phase, list[_Unit]] = {}
    for unit in units:
        by_phase.setdefault(unit.phase, []).append(unit)
    adoptable = [u for u in by_phase.get(Phase.UNKNOWN, []) if _adoptable(u.group)]
    total = sum(len(u.replicas) for u in units if u.phase is not Phase.ADMIN)
    taking = [u for p in Phase if takes_traffic(p) for u in by_phase.get(p, [])]
    awake = sum(u.capacity() for u in taking)
    policy = config.policy
    load = obs.model_load(model.name)
    known, why_unknown = _load_known(load, taking)
    coming = [u for p in arriving_phases() for u in by_phase.get(p, [])]
    supply = awake + sum(u.arriving() for u in coming) + sum(u.arriving() for u in adoptable)
    floor = floor_of(model, total)
    arriving = sum(1 for u in coming if not _stuck(u.group, config, now))
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
        return _Model(model, by_phase, adoptable, total, False, window_ok, need, needed, reason,
                      arriving)

    replicas = [ld for u in taking for ld in u.loads() if ld is not None and not out_of_service(ld)]
    lead_s = default_forecast_lead_s(config, model.name)
    need = assess_need(model, policy, load, replicas, awake, total, lead_s)
    needed, reason = need.up, need.reason
    if not known:
        reason += f"; {why_unknown}: nothing lent"
    if not window_ok:
        needed = total
        reason += f"; {outside}"
    return _Model(model, by_phase, adoptable, total, known, window_ok, need, needed, reason, arriving)


def _reclaim_rank(unit: _Unit, now: float, ckpt_s: float | None,
                  min_runtime_s: float) -> tuple[bool, float, int, str]:
    """reclaim_order.reclaim_rank of a group: its node's, or for several nodes the worst
    protection and the sums of work lost and GPUs in use, named by the group."""
    ranks = [reclaim_rank(v, now, ckpt_s, min_runtime_s) for v in unit.group.nodes]
    if len(ranks) == 1:
        return ranks[0]
    return (any(r[0] for r in ranks), sum(r[1] for r in ranks), sum(r[2] for r in ranks), unit.name)


def _young(unit: _Unit, now: float, min_runtime_s: float) -> list[int]:
    return sorted({j for v in unit.group.nodes for j in young_jobs(v, now, min_runtime_s)})


def _running(unit: _Unit) -> tuple[float, str]:
    return unit.running(), unit.name


def _lend_order(unit: _Unit) -> tuple[bool, int, float, str]:
    """Consolidation: groups whose replicas are all idle first, then the most GPUs freed, then
    the least busy."""
    running = unit.group_running()
    return running > 0, -unit.group.gpus_total, running, unit.name


def _stuck(group: GroupView, config: Config, now: float) -> bool:
    """A group in a timed phase (RETIRING, LENDING, RECLAIMING, HELD, STARTING) older than its
    timeout (lifecycle.overdue: the driver's own test of stuck)."""
    return overdue(group.phase, group.phase_since, config, now)


def _act(kind: ActionKind, unit: _Unit, model: str, to: Phase, reason: str,
         **details: float | str) -> Action:
    return Action(kind, unit.name, model, unit.phase, to, reason, dict(details))


@dataclass
class _Tick:
    """What this tick has decided so far, across models: a group is acted on once, and a lend
    for one model takes the replicas of the others on the same group with it."""

    models: dict[str, _Model]
    budget: int
    touched: set[str] = field(default_factory=set)
    returning: set[str] = field(default_factory=set)  # groups an action brings back to serving
    leaving: set[str] = field(default_factory=set)  # SERVING groups lent this tick
    lent_out: dict[str, int] = field(default_factory=dict)  # model -> replicas lent this tick
    # Replicas whose lend was refused for the memory their engine leaves (not lent again).
    refused: frozenset[str] = frozenset()


def _supply(m: _Model, tick: _Tick, config: Config, now: float) -> int:
    """Replicas serving or on their way back, with this tick's decisions so far."""
    n = 0
    for u in m.units(Phase.SERVING):
        if u.name not in tick.leaving:
            n += u.capacity()
    for u in m.units(*sorted(arriving_phases())):
        # A group stuck past its timeout is still carried on, but no longer counted on:
        # otherwise one engine that never starts would hold the model below its need forever.
        if not _stuck(u.group, config, now):
            n += u.arriving()
    n += sum(u.arriving() for u in m.adoptable)
    for u in m.units(Phase.RETIRING):
        if u.name in tick.returning:
            n += u.capacity()
    for u in m.units(Phase.LENDING, Phase.LENT):
        if u.name in tick.returning:
            n += u.arriving()
    return n


def _can_lend(unit: _Unit, tick: _Tick, config: Config, serving: dict[str, int],
              out: dict[str, int]) -> bool:
    """Every model with a replica on the group keeps its need over the window (and floor) and
    stays within its max_lent_fraction once the group is lent."""
    for model in unit.group.group.models():
        other = tick.models.get(model)
        if other is None or not other.lendable:
            return False
        assert other.need.down is not None
        theirs = _Unit.of(unit.group, tuple(r for r in unit.group.group.replicas if r.model == model))
        if serving[model] - theirs.capacity() < other.need.down:
            return False
        if not may_lend(config.policy, other.total, out[model], len(theirs.replicas)):
            return False
    return True


def _plan_model(m: _Model, tick: _Tick, config: Config, now: float) -> list[Action]:
    ckpt_s = config.report.checkpoint_interval_s
    min_runtime_s = config.policy.min_job_runtime_s
    name = m.config.name
    actions: list[Action] = []
    touched = tick.touched

    def act(kind: ActionKind, unit: _Unit, to: Phase, reason: str, back: bool = True,
            **details: float | str) -> None:
        actions.append(_act(kind, unit, name, to, reason, **details))
        touched.add(unit.name)
        if back:
            tick.returning.add(unit.name)

    retiring = [u for u in m.units(Phase.RETIRING) if u.name not in touched]
    lending = [u for u in m.units(Phase.LENDING) if u.name not in touched]
    lent = [u for u in m.units(Phase.LENT) if u.name not in touched]

    for unit in m.adoptable:
        if unit.name not in touched:
            act(ActionKind.ADOPT, unit, Phase.RECLAIMING,
                "unmanaged pool node: adopting it into serving (service first)")

    # A lend under way stops where it is and comes back when its group is pinned or the
    # model's evidence is not good enough to lend on (rules.stop_lend).
    for unit in retiring:
        why = stop_lend(unit.group.pinned, m.known, m.reason)
        if why:
            act(ActionKind.ABORT_LEND, unit, Phase.SERVING, why)
    for unit in lending:
        why = stop_lend(unit.group.pinned, m.known, m.reason)
        if why:
            act(ActionKind.RECLAIM, unit, Phase.STARTING, why)
    for unit in lent:
        if unit.group.pinned:  # pinned while lent: back from the idle partition
            act(ActionKind.RECLAIM, unit, Phase.RECLAIMING, "pinned: back to serving")

    # A serving replica whose endpoint is not its engine (nothing answers, or something
    # without its identity) serves nobody and blinds the model's metrics: restart it, out of
    # the router first. It was no capacity, so this takes none away.
    for unit in m.units(Phase.SERVING):
        gone = [r.name for r, ld in zip(unit.replicas, unit.loads(), strict=True)
                if ld is not None and ld.foreign]
        if gone and unit.name not in touched:
            act(ActionKind.REPAIR, unit, Phase.STARTING,
                f"engine of serving replica(s) {', '.join(gone)} gone or not ours: restarting it",
                back=False)

    # A GPU still held past timeouts.gpu_free_s: the node is the admin's now (it no longer
    # counts as coming back, so the deficit below reclaims another group in the same tick).
    for unit in m.units(Phase.HELD):
        if unit.name not in touched and _stuck(unit.group, config, now):
            act(ActionKind.HAND_OVER, unit, Phase.ADMIN,
                f"GPU memory still held after timeouts.gpu_free_s ({config.timeouts.gpu_free_s:.0f} s): "
                "drained for the admin", back=False)

    supply = _supply(m, tick, config, now)
    deficit = m.needed - supply
    if deficit > 0:
        up_reason = f"{m.reason}; {supply} serving or coming back"
        candidates = (
            [(ActionKind.ABORT_LEND, u, Phase.SERVING, u.capacity())
             for u in sorted(retiring, key=_running, reverse=True) if not _asleep(u)]
            + [(ActionKind.RECLAIM, u, Phase.STARTING, u.arriving()) for u in lending]
            + [(ActionKind.RECLAIM, u, Phase.RECLAIMING, u.arriving())
               for u in sorted(lent, key=lambda u: _reclaim_rank(u, now, ckpt_s, min_runtime_s))]
        )
        for kind, unit, to, brings in candidates:
            if deficit <= 0:
                break
            if unit.name in touched:
                continue
            young = _young(unit, now, min_runtime_s) if kind is ActionKind.RECLAIM else []
            exempt = (f"; job(s) {', '.join(map(str, young))} under policy.min_job_runtime_s, but no "
                      "other lent node is left") if young else ""
            act(kind, unit, to, f"{up_reason}: needs {m.needed}{exempt}", needed=m.needed,
                supply=supply)
            deficit -= brings
    elif tick.budget > 0 and m.lendable:
        assert m.need.down is not None
        serving = {k: _serving_now(o, tick) for k, o in tick.models.items()}
        out = {k: _out_now(o, tick) for k, o in tick.models.items()}
        before = serving[name]
        spare = sorted(
            (u for u in m.units(Phase.SERVING)
             if stop_lend(u.group.pinned, m.known, m.reason) is None
             and u.name not in touched and not _asleep(u)
             and not any(r.name in tick.refused for r in u.group.group.replicas)),
            key=_lend_order,
        )
        for unit in spare:
            if tick.budget <= 0:
                break
            if not _can_lend(unit, tick, config, serving, out):
                continue
            act(ActionKind.LEND, unit, Phase.RETIRING,
                f"{m.need.reason}; {before} serving, needs {m.need.down} over the window: lending",
                back=False, needed=m.need.down, serving=before)
            tick.leaving.add(unit.name)
            tick.budget -= 1
            for r in unit.group.group.replicas:
                ld = unit.group.load(r)
                serving[r.model] -= 0 if out_of_service(ld) else 1
                out[r.model] += 1
                tick.lent_out[r.model] = tick.lent_out.get(r.model, 0) + 1

    return actions


def _serving_now(m: _Model, tick: _Tick) -> int:
    return sum(u.capacity() for u in m.units(Phase.SERVING) if u.name not in tick.leaving)


def _out_now(m: _Model, tick: _Tick) -> int:
    out = sum(len(u.replicas) for u in m.units(*sorted(lent_phases()))
              if u.name not in tick.returning)
    return out + tick.lent_out.get(m.config.name, 0)


def _carry_on(m: _Model, tick: _Tick) -> list[Action]:
    """CONTINUE every transitional group of the model no decision of this tick touched."""
    actions = []
    for unit in m.units(*(p for p in Phase if next_phase(p) is not None)):
        if unit.name not in tick.touched:
            nxt = next_phase(unit.phase)
            assert nxt is not None
            actions.append(_act(ActionKind.CONTINUE, unit, m.config.name, nxt,
                                f"carry on {unit.phase.value} -> {nxt.value}"))
            tick.touched.add(unit.name)
    return actions


def _paused_gc(fn: Callable[[Observation, Config, float], list[_Model]], obs: Observation,
               config: Config, now: float) -> list[_Model]:
    """`fn` with Python's cyclic GC paused (as observe does): a 10,000-node fleet makes some
    10^5 short-lived views and no cycles, and the collector's passes over them would cost more
    than the planning itself. The GC state is restored on the way out, also on errors."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return fn(obs, config, now)
    finally:
        if collecting:
            gc.enable()


def _models(obs: Observation, config: Config, now: float) -> list[_Model]:
    by_model: dict[str, list[_Unit]] = {}
    failed_starts = obs.failed_starts
    for group in group_views(obs, config):  # one pass, not one per model
        replicas = group.group.replicas
        if len(replicas) == 1:
            by_model.setdefault(replicas[0].model, []).append(_Unit.of(group, replicas, failed_starts))
            continue
        mine: dict[str, list[Replica]] = {}
        for r in replicas:
            mine.setdefault(r.model, []).append(r)
        for model, reps in mine.items():
            by_model.setdefault(model, []).append(_Unit.of(group, tuple(reps), failed_starts))
    return [_examine(obs, config, model, now, by_model.get(model.name, []))
            for model in config.models if model.placement == "nodes"]


def plan(observation: Observation, config: Config, now: float) -> list[Action]:
    """The actions of this tick, in model order; deterministic for equal inputs."""
    models = _paused_gc(_models, observation, config, now)
    tick = _Tick({m.config.name: m for m in models}, config.policy.max_transitions_per_tick,
                 refused=observation.lend_refused)
    actions: list[Action] = []
    for m in models:
        actions.extend(_plan_model(m, tick, config, now))
    for m in models:
        actions.extend(_carry_on(m, tick))
    return actions + plan_jobs(observation, config, now, tick.budget)  # one budget, both placements


def assess(observation: Observation, config: Config, now: float) -> list[ModelPlan]:
    """Per model: replicas needed now, replicas taking traffic, and why."""
    return [
        ModelPlan(m.config.name, m.needed, m.taking_traffic, m.reason)
        for m in _paused_gc(_models, observation, config, now)
    ] + assess_jobs(observation, config, now)


def apply_actions(observation: Observation, actions: Iterable[Action],
                  config: Config | None = None) -> Observation:
    """The observation as it would be if every action succeeded (for dry runs and tests); with
    `config`, an action on a group moves every node of it."""
    index = group_index(config) if config is not None else {}
    moved: dict[str, Phase] = {}
    for a in actions:
        group = index.get(a.node)
        for node in group.nodes if group is not None else (a.node,):
            moved[node] = a.to_phase
    nodes = tuple(
        replace(n, phase=moved[n.name], phase_since=observation.now) if n.name in moved else n
        for n in observation.nodes
    )
    return replace(observation, nodes=nodes)
