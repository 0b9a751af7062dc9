"""The `slurm-idle` policy in the simulator: the real `policy.plan()` fed simulated Observations.

Nothing of the policy is re-implemented here; this module only plays the part of the metrics
adapter and of Slurm. At the tick of minute m the agent sees what Prometheus would show then:
the rates of the minute that just ended (m-1), maxima and minima over the scale-down window
(None until the trace has run for the whole window, as Prometheus' coverage check), the queue's
minimum over `queue_sustain_s`, and the forecast computed by `policy.forecast_demand` from the
same moments 1 day and 7 days earlier. A model whose serving replicas cannot keep up shows a
queue and a hot KV cache. The planner is configured like the simulated fleet: its lead time
from the simulated grace and start, its utilisation and prompt weight from the demand model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from slurm_idle.config import (
    Config,
    EngineConfig,
    ModelConfig,
    PolicyConfig,
    ReplicaConfig,
    SlurmConfig,
)
from slurm_idle.lifecycle import takes_traffic
from slurm_idle.metrics.forecast import NOISE_LAG_S, NOISE_SPAN_S
from slurm_idle.model import (
    Action,
    ModelLoad,
    NodeView,
    Observation,
    Phase,
    ReplicaLoad,
    SlurmJob,
    SlurmNode,
)
from slurm_idle.policy import default_forecast_lead_s, fast_plan, forecast_demand, plan
from slurm_idle.sim.engine import FleetModel, SimNode, SimParams, Simulation, fleet_node_names

#: The planner knobs the benchmarks run with (see docs/benchmarks.md): the defaults. Replicas
#: are planned at the SLO line itself (80% busy); the margin against noise, steps and ramps is
#: the adaptive headroom (policy.headroom_sigmas), measured from the load, not a tuned factor.
SIM_POLICY = PolicyConfig.model_validate({})
_DEFAULT_UTILISATION: float = PolicyConfig.model_fields["target_utilisation"].default


def sim_policy(params: SimParams) -> PolicyConfig:
    """SIM_POLICY for the demand model of `params`: replicas planned at its SLO line
    (`--utilisation`) and prompt tokens weighed as it weighs them (`--prompt-weight`), so the
    policy under test plans against the line it is scored on."""
    utilisation = SIM_POLICY.target_utilisation * (params.utilisation / _DEFAULT_UTILISATION)
    return PolicyConfig.model_validate({
        **SIM_POLICY.model_dump(),
        "target_utilisation": min(1.0, utilisation),
        "prompt_token_weight": params.prompt_weight,
    })

DAY_MIN = 1440
WEEK_MIN = 7 * DAY_MIN
_DRAINED = frozenset({"DRAIN"})


def fleet_config(fleet: Sequence[FleetModel], params: SimParams, policy: PolicyConfig) -> Config:
    """A Config for the simulated pool (node names as the engine makes them); the job grace and
    the engine's start (or wake) are the simulated ones, so the forecast's lead matches them."""
    kind = "http-sleep" if params.wake_s is not None else "command"
    engine = EngineConfig.model_validate({
        "kind": kind, "start_command": "true", "stop_command": "true",
        "expected_start_s": params.engine_start_s,
    })
    slurm = SlurmConfig.model_validate({"requeue_grace_s": params.grace_s})
    names_of = fleet_node_names(fleet)
    models = tuple(
        ModelConfig(
            name=f.name,
            gpus_per_replica=f.gpus_per_replica,
            tokens_per_s_per_replica=f.tokens_per_s,
            min_serving_replicas=min(params.floor, f.replicas),
            replicas=tuple(
                ReplicaConfig(node=n, url=f"http://{n}:{8000 + i}", index=i, port=8000 + i,
                              gpus=None if f.per_node == 1 else tuple(
                                  range(i * f.gpus_per_replica, (i + 1) * f.gpus_per_replica)))
                for n in names_of[f.name] for i in range(f.per_node)
            ),
        )
        for f in fleet
    )
    return Config(slurm=slurm, engine=engine, models=models, policy=policy)


def _sliding_max(values: Sequence[float], width: int) -> list[float]:
    """out[i] = max(values[i-width+1 .. i])."""
    out: list[float] = []
    window: deque[int] = deque()
    for i, v in enumerate(values):
        while window and values[window[-1]] <= v:
            window.pop()
        window.append(i)
        if window[0] <= i - width:
            window.popleft()
        out.append(values[window[0]])
    return out


def _ahead_max(values: Sequence[float], width: int) -> list[float]:
    """out[i] = max(values[i+1 .. i+width]) (clipped at the end)."""
    past = _sliding_max(values, width)  # past[j] = max(values[j-width+1 .. j])
    last = len(values) - 1
    return [past[min(last, i + width)] if i < last else values[last] for i in range(len(values))]


def _means(values: Sequence[float], width: int) -> list[float]:
    """Mean of values[i-width+1 .. i] (Prometheus `avg_over_time`), by a running sum."""
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def _noises(values: Sequence[float], lag: int, span: int) -> list[float | None]:
    """out[i]: metrics.forecast.noise_from_changes of the `lag`-minute changes ending in
    i-span+1 .. i (None until the trace has run lag + span minutes), by running sums."""
    out: list[float | None] = []
    total = squares = 0.0
    changes: list[float] = []
    for i in range(len(values)):
        if i >= lag:
            c = values[i] - values[i - lag]
            changes.append(c)
            total += c
            squares += c * c
            if len(changes) > span:
                old = changes[-span - 1]
                total -= old
                squares -= old * old
        n = min(len(changes), span)
        if n < span:
            out.append(None)
            continue
        mean = total / n
        out.append(math.sqrt(max(0.0, squares / n - mean * mean) / 2.0))
    return out


def _slopes(values: Sequence[float], width: int) -> list[float]:
    """Least-squares slope per second of values[i-width+1 .. i] (Prometheus `deriv`)."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - width + 1) : i + 1]
        n = len(window)
        if n < 2:
            out.append(0.0)
            continue
        mean_x = (n - 1) / 2
        mean_y = sum(window) / n
        num = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(window))
        den = sum((x - mean_x) ** 2 for x in range(n))
        out.append(num / den / 60.0)
    return out


class PlannerPolicy:
    """Drives slurm_idle.policy.plan() with Observations built from the simulated fleet."""

    name = "slurm-idle"
    auto_continue = False

    def __init__(self, sim: Simulation, config: Config) -> None:
        self.config = config
        policy = config.policy
        self.window_min = max(1, math.ceil(policy.scale_down_window_s / 60))
        self.sustain_min = math.ceil(policy.queue_sustain_s / 60)  # 0: the queue now counts
        self.window_max: dict[str, list[float]] = {}
        self.ahead_max: dict[str, list[float]] = {}
        self.later_max: dict[str, list[float]] = {}
        self.trend: dict[str, list[float]] = {}  # least-squares slope over the window, per s
        self.means: dict[str, list[float]] = {}  # mean over the window
        self.noise: dict[str, list[float | None]] = {}  # metrics.forecast.noise_from_changes
        self.lead_s: dict[str, float] = {}
        for model, demand in sim.demand.items():
            lead = max(1, math.ceil(default_forecast_lead_s(config, model) / 60))
            self.window_max[model] = _sliding_max(demand, self.window_min)
            self.ahead_max[model] = _ahead_max(demand, lead)
            self.later_max[model] = _ahead_max(demand, lead + self.window_min)
            self.trend[model] = _slopes(demand, self.window_min)
            self.means[model] = _means(demand, self.window_min)
            self.noise[model] = _noises(demand, NOISE_LAG_S // 60, NOISE_SPAN_S // 60)
            self.lead_s[model] = lead * 60.0
        self._views: dict[tuple[str, Phase, float], NodeView] = {}

    def _waiting(self, sim: Simulation, model: str, minute: int) -> float:
        """Requests queued in a past minute: demand beyond what the serving replicas deliver."""
        fleet = sim.fleet[model]
        capacity = sim.serving[model][minute] * fleet.tokens_per_s
        demand = sim.demand[model][minute]
        if demand <= capacity:
            return 0.0
        s = sim.trace.series[model]
        per_request = max(1.0, s.output_tokens[minute] + sim.params.prompt_weight * s.prompt_tokens[minute])
        return (demand - capacity) / per_request * 10.0  # ~10 s of excess requests

    def load(self, sim: Simulation, model: str, minute: int) -> ModelLoad:
        seen = max(0, minute - 1)
        s = sim.trace.series[model]
        demand = sim.demand[model]
        rps = s.rps[seen]
        offsets = [seen - offset for offset in (DAY_MIN, WEEK_MIN) if seen - offset >= 0]
        history = [(demand[i], self.ahead_max[model][i]) for i in offsets]
        history_later = [(demand[i], self.later_max[model][i]) for i in offsets]
        past = range(max(0, minute - max(self.window_min, self.sustain_min)), minute)
        waits = [self._waiting(sim, model, m) for m in past]
        waiting = waits[-1] if waits else 0.0
        recent = waits[-self.sustain_min:] if self.sustain_min else [waiting]
        # Minutes 0..m-1 have been seen: the window (or the sustain span) is covered once there
        # are that many, as the Prometheus source counts the points of its subquery.
        covered = minute >= self.window_min
        window = waits[-self.window_min:]
        serving = sim.serving[model][seen] if minute > 0 else sim.fleet[model].replicas
        capacity = serving * sim.fleet[model].tokens_per_s
        return ModelLoad(
            model=model,
            prompt_tokens_per_s=rps * s.prompt_tokens[seen],
            generation_tokens_per_s=rps * s.output_tokens[seen],
            waiting=waiting,
            waiting_min_recent=min(recent) if minute >= self.sustain_min else None,
            kv_cache_usage_max=min(1.0, demand[seen] / capacity) if capacity > 0 else 1.0,
            demand_tokens_per_s_max_window=self.window_max[model][seen] if covered else None,
            demand_tokens_per_s_mean_window=self.means[model][seen] if covered else None,
            demand_trend_per_s_window=self.trend[model][seen] if covered else None,
            demand_noise_tokens_per_s=self.noise[model][seen] if minute > 0 else None,
            waiting_max_window=max(window) if covered else None,
            waiting_min_window=min(window) if covered else None,
            forecast_demand_tokens_per_s=forecast_demand(
                demand[seen], history, self.trend[model][seen], self.lead_s[model]
            ),
            forecast_demand_tokens_per_s_max_window=forecast_demand(
                demand[seen], history_later, self.trend[model][seen],
                self.lead_s[model] + 60.0 * self.window_min,
            ),
        )

    def view(self, node: SimNode, gpus: int, per_node: int = 1) -> NodeView:
        key = (node.name, node.phase, node.since)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        lent = node.phase is Phase.LENT
        jobs = (
            (SlurmJob(job_id=1, name="idle-job", partition="idle", state="RUNNING", nodes=(node.name,),
                      start_time=node.lent_since, gpus=gpus),)
            if lent else ()
        )
        taking = takes_traffic(node.phase)
        loads = tuple(
            ReplicaLoad(model=node.model, node=node.name, url=f"http://{node.name}:{8000 + i}")
            for i in range(per_node)
        ) if taking and per_node > 1 else ()
        view = NodeView(
            node=SlurmNode(
                name=node.name,
                state="allocated" if lent else "idle",
                flags=frozenset() if lent else _DRAINED,
                gpus_total=gpus,
                gpus_used=gpus if lent else 0,
            ),
            model=node.model,
            phase=node.phase,
            phase_since=node.since,
            jobs=jobs,
            replica=ReplicaLoad(model=node.model, node=node.name) if taking else None,
            replicas=loads,
        )
        self._views[key] = view
        return view

    def decide(self, sim: Simulation, minute: int, now: float) -> list[Action]:
        """A full plan on tick minutes (every params.tick_s), a fast check (policy.fast_plan)
        on fast-check minutes between them, nothing otherwise (transitions wait for a pass)."""
        tick_min, fast_min = sim.params.tick_s // 60, sim.params.fast_s // 60
        if minute % tick_min == 0:
            planner = plan
        elif fast_min and minute % fast_min == 0:
            planner = fast_plan
        else:
            return []
        views = tuple(
            self.view(node, sim.fleet[model].gpus_per_node, sim.fleet[model].per_node)
            for model, nodes in sim.nodes.items()
            for node in nodes
        )
        loads = tuple(self.load(sim, model, minute) for model in sim.nodes)
        return planner(Observation(now=now, nodes=views, models=loads), self.config, now)
