"""The yardsticks slurm-idle is measured against: reactive, night-window and oracle.

- `reactive`: what an HPA/KEDA autoscaler does: scale on the load of the last minute, scale
  down only to the highest recommendation of the last 5 minutes, no forecast.
- `night-window`: the manual practice: lend a fixed number of replicas from 20:00 to 08:00.
- `oracle`: perfect foresight: serves exactly what each minute needs and starts every reclaim
  just early enough. Its harvest is the physical limit (Simulation.oracle_bound).
- `level-oracle` (a reference point for scripts/bench-sim-bound, not in the tables): knows
  the load's *level* at every minute ahead, not its minute-to-minute noise.
They decide at every step of the simulation (a minute, or `SimParams.step_s`); their
windows are in seconds. All of them only see the fleet and the trace; their decisions are plain LEND/RECLAIM actions
that the engine applies with the same latencies as the real planner's. They count in nodes
(`Simulation.need_nodes`): with several replicas per node only whole nodes are lent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from slurm_idle.metrics.forecast import NOISE_LAG_S, NOISE_SPAN_S
from slurm_idle.model import Action, ActionKind, Phase
from slurm_idle.policy.capacity import TICK_S, horizon_factor, replicas_for
from slurm_idle.policy.windows import in_windows
from slurm_idle.sim.engine import SimNode, Simulation
from slurm_idle.sim.series import noises


def _lend(
    nodes: list[SimNode], count: int, reason: str, also: Sequence[SimNode] = ()
) -> list[Action]:
    """Lend up to `count` serving nodes; `also`: nodes that will be serving when it applies."""
    serving = sorted((n for n in nodes if n.phase is Phase.SERVING), key=lambda n: n.name, reverse=True)
    serving += also
    return [
        Action(ActionKind.LEND, n.name, n.model, Phase.SERVING, Phase.RETIRING, reason)
        for n in serving[: max(0, count)]
    ]


def _bring_back(nodes: list[SimNode], count: int, reason: str) -> list[Action]:
    """Abort lends first, then reclaim the youngest lent nodes."""
    actions: list[Action] = []
    for n in (n for n in nodes if n.phase is Phase.RETIRING):
        if len(actions) >= count:
            return actions
        actions.append(Action(ActionKind.ABORT_LEND, n.name, n.model, Phase.RETIRING, Phase.SERVING, reason))
    for n in (n for n in nodes if n.phase is Phase.LENDING):
        if len(actions) >= count:
            return actions
        actions.append(Action(ActionKind.RECLAIM, n.name, n.model, Phase.LENDING, Phase.STARTING, reason))
    lent = sorted((n for n in nodes if n.phase is Phase.LENT), key=lambda n: (-(n.lent_since or 0), n.name))
    for n in lent:
        if len(actions) >= count:
            break
        actions.append(Action(ActionKind.RECLAIM, n.name, n.model, Phase.LENT, Phase.RECLAIMING, reason))
    return actions


def _count(nodes: list[SimNode], *phases: Phase) -> int:
    return sum(1 for n in nodes if n.phase in phases)


@dataclass
class Reactive:
    """Scale on the last step's load; scale down to the max of the last `stabilisation_s`."""

    stabilisation_s: int = 300
    name: str = "reactive"
    auto_continue: bool = True

    def decide(self, sim: Simulation, step: int, now: float) -> list[Action]:
        actions: list[Action] = []
        seen = max(0, step - 1)
        window = max(1, sim.params.steps(self.stabilisation_s))
        for model, nodes in sim.nodes.items():
            need = sim.need_nodes[model]
            desired = need[seen]
            supply = _count(nodes, Phase.SERVING, Phase.STARTING, Phase.RECLAIMING)
            if desired > supply:
                actions += _bring_back(nodes, desired - supply, "reactive: scale up")
                continue
            recent = max(need[max(0, seen - window + 1) : seen + 1])
            if not _count(nodes, Phase.STARTING, Phase.RECLAIMING):
                actions += _lend(nodes, _count(nodes, Phase.SERVING) - recent, "reactive: scale down")
        return actions


@dataclass
class NightWindow:
    """Lend `lend` replicas per model (None: what the trace's nights always allowed) 20:00-08:00."""

    lend: int | None = None
    window: str = "20:00-08:00"
    timezone: str = "UTC"
    name: str = "night-window"
    auto_continue: bool = True

    def _count_for(self, sim: Simulation, model: str) -> int:
        if self.lend is not None:
            return self.lend
        nodes = sim.fleet[model].nodes
        nights = [
            need
            for m, need in enumerate(sim.need_nodes[model])
            if in_windows(sim.trace.timestamp(m), (self.window,), self.timezone)
        ]
        return max(0, nodes - max(nights, default=nodes))

    def decide(self, sim: Simulation, step: int, now: float) -> list[Action]:
        if not hasattr(self, "_counts"):
            self._counts = {model: self._count_for(sim, model) for model in sim.nodes}
        actions: list[Action] = []
        night = in_windows(now, (self.window,), self.timezone)
        for model, nodes in sim.nodes.items():
            out = _count(nodes, Phase.RETIRING, Phase.LENDING, Phase.LENT)
            if night:
                floor = -(-sim.params.floor // sim.fleet[model].per_node)
                room = _count(nodes, Phase.SERVING) - min(floor, len(nodes))
                actions += _lend(nodes, min(self._counts[model] - out, room), "night window")
            elif out:
                actions += _bring_back(nodes, out, "night window over")
        return actions


@dataclass
class Oracle:
    """Knows every step's need: lends what no step needs soon, reclaims just in time."""

    name: str = "oracle"
    auto_continue: bool = True

    def needs(self, sim: Simulation) -> dict[str, list[int]]:
        """Nodes to serve per model and step: what each step needs."""
        return sim.need_nodes

    def decide(self, sim: Simulation, step: int, now: float) -> list[Action]:
        p = sim.params
        drain, end = p.drain_steps, sim.trace.steps
        actions: list[Action] = []
        for model, nodes in sim.nodes.items():
            need = self.needs(sim)[model]
            reclaim, delay = sim.reclaim_steps(model), sim.lend_delay_steps(model)

            def at(m: int, need: list[int] = need) -> int:
                return need[m] if m < end else 0

            serving = _count(nodes, Phase.SERVING)
            coming = _count(nodes, Phase.STARTING, Phase.RECLAIMING)
            short = at(step + reclaim) - (serving + coming)
            back = _bring_back(nodes, short, "oracle: needed in time") if short > 0 else []
            # A reclaim of zero steps serves this very step: the nodes brought back count as
            # serving and may be lent again at once (drained during this step) when the next
            # step does not need them. With any reclaim time the window below covers
            # step + reclaim, which is short: nothing is lent alongside a reclaim.
            instant = [] if reclaim else [
                sim.by_name[a.node] for a in back if a.kind is ActionKind.RECLAIM
            ]
            soon = max(at(m) for m in range(step + drain, step + drain + delay + reclaim + 1))
            actions += back + _lend(
                nodes, serving + len(back) - soon, "oracle: not needed soon", also=instant
            )
        return actions


def centred_means(values: Sequence[float], half_width: int) -> list[float]:
    """out[i] = mean(values[i-h .. i+h]), clipped at both ends: the load's level at minute i
    as one who saw the minutes around it would put it."""
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    n = len(values)
    out = []
    for i in range(n):
        lo, hi = max(0, i - half_width), min(n, i + half_width + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def relative_noise(values: Sequence[float], level: Sequence[float]) -> float:
    """The standard deviation of values / level - 1 over the whole trace (minutes of level 0
    left out): the trace's own minute noise, known in advance."""
    ratios = [v / m - 1.0 for v, m in zip(values, level, strict=True) if m > 0]
    if len(ratios) < 2:
        return 0.0
    mean = sum(ratios) / len(ratios)
    return math.sqrt(sum((r - mean) ** 2 for r in ratios) / len(ratios))


#: The noise figures LevelOracle can hold its margin in (see its docstring).
LEVEL_ORACLE_NOISE = ("hour", "trace")


@dataclass(kw_only=True)
class LevelOracle(Oracle):
    """A reference point, not a policy: a noise margin on a level known in advance.

    It knows, at every moment ahead, the load's level (the centred mean of the `half_width`
    minutes around it: ramps, plateaus, weekends, level shifts, bursts and flash crowds as
    they will come) and holds `sigmas` x a noise figure above it, lending and reclaiming just
    in time like the oracle (reclaim latency respected). It does not know each minute's noise.
    The figure (`noise`): "hour", the planner's own margin as the simulator feeds it to
    `policy.plan()` (the standard deviation of the last hour's 10-minute changes / sqrt 2,
    x `capacity.horizon_factor` of the reclaim lead), as it stood when the reclaim for that
    minute had to start (a reclaim earlier), so it does not see a jump before it happens; or
    "trace", one relative figure for the whole trace (known in advance). Until the hour is on
    record (the first ~70 minutes) "hour" uses the whole-trace figure. Other differences to
    `slurm-idle` remain: the planner's base is max(seasonal forecast, fitted level + rising
    trend over the lead) and it lends only after a 15-minute window. Where this misses a goal
    at every margin tried, a better level or trend estimate alone will not meet it. Not a bound
    on every rule: a margin that follows other signals could do better. Measured by
    scripts/bench-sim-bound.
    """

    sigmas: float = 3.0
    noise: str = "hour"
    half_width: int = 7
    name: str = "level-oracle"
    auto_continue: bool = True  # redeclared so that every field is keyword-only
    _for: Simulation | None = field(default=None, init=False, repr=False, compare=False)
    _plan: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.noise not in LEVEL_ORACLE_NOISE:
            raise ValueError(f"noise must be one of {', '.join(LEVEL_ORACLE_NOISE)}, not {self.noise!r}")

    def needs(self, sim: Simulation) -> dict[str, list[int]]:
        """Nodes per model and step for `sim`: planned once per simulation."""
        if self._for is not sim:
            self._plan = {model: self._nodes(sim, model) for model in sim.demand}
            self._for = sim
        return self._plan

    def _nodes(self, sim: Simulation, model: str) -> list[int]:
        p, f, demand = sim.params, sim.fleet[model], sim.demand[model]
        level = centred_means(demand, p.steps(60 * self.half_width))
        whole = relative_noise(demand, level)
        hourly = (noises(demand, p.steps(NOISE_LAG_S), p.steps(NOISE_SPAN_S))
                  if self.noise == "hour" else [None] * len(demand))
        # the planner's lead (grace + start + a tick, whole steps) and its margin's widening
        lead_steps = p.steps(p.grace_s + p.engine_start_s + TICK_S)
        widen = horizon_factor(p.step_s * lead_steps) if self.noise == "hour" else 1.0
        before = p.reclaim_steps + 1  # the figure when a reclaim for step m had to start
        floor = min(p.floor, f.replicas)
        out = []
        for i, m in enumerate(level):
            h = hourly[max(0, i - before)]
            planned = m + self.sigmas * (widen * h if h is not None else whole * m)
            replicas = min(f.replicas, max(floor, replicas_for(planned, f.tokens_per_s, p.utilisation)))
            out.append(-(-replicas // f.per_node))
        return out
