"""The `slurm-idle` policy in the simulator: the real `policy.plan()` fed simulated Observations.

Nothing of the policy is re-implemented here; this module only plays the part of the metrics
adapter and of Slurm. At the tick of step m (a minute, or `SimParams.step_s`) the agent sees
what Prometheus would show then: the rates of the step that just ended (m-1), maxima and
minima over the scale-down window (None until the trace has run for the whole window, as
Prometheus' coverage check), the queue's minimum over `queue_sustain_s`, and the forecast
computed by `policy.forecast_demand` from the same moments 1 day and 7 days earlier (the
demand then as window means centred on each moment, as the Prometheus query reads it). Windows
are in seconds, counted in whole steps. The agent's cadence is simulated too: a full
`policy.plan()` every `tick_s`, the fast check (`policy.fast_plan`) every `fast_s` between. A model whose serving replicas cannot keep up shows a
queue and a hot KV cache. The planner is configured like the simulated fleet: its lead time
from the simulated grace and start, its utilisation and prompt weight from the demand model.
"""

from __future__ import annotations

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
from slurm_idle.sim.series import ahead_max, centred_means, means, noises, sliding_max, slopes

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

DAY_S = 86400
WEEK_S = 7 * DAY_S
_DRAINED = frozenset({"DRAIN"})


def fleet_config(fleet: Sequence[FleetModel], params: SimParams, policy: PolicyConfig) -> Config:
    """A Config for the simulated pool (node names as the engine makes them); the job grace and
    the engine's start (or wake) are the simulated ones, so the forecast's lead matches them."""
    kind = "http-sleep" if params.wake_s is not None else "command"

    def engine_starting_in(seconds: float) -> EngineConfig:
        return EngineConfig.model_validate({
            "kind": kind, "start_command": "true", "stop_command": "true",
            "expected_start_s": seconds,
        })

    engine = engine_starting_in(params.engine_start_s)
    # A `placement: jobs` model is played as nodes here (one replica per lend unit); its
    # reclaim also waits for Slurm to start the replica job, which the planner counts in its
    # lead time as job.expected_queue_s: the same lead, handed over as the engine's start.
    jobs_engine = engine_starting_in(params.engine_start_s + params.queue_s)
    slurm = SlurmConfig.model_validate({"requeue_grace_s": params.grace_s})
    names_of = fleet_node_names(fleet)
    models = tuple(
        ModelConfig(
            name=f.name,
            gpus_per_replica=f.gpus_per_replica,
            tokens_per_s_per_replica=f.tokens_per_s,
            min_serving_replicas=min(params.floor, f.replicas),
            engine=jobs_engine if f.placement == "jobs" else None,
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


class PlannerPolicy:
    """Drives slurm_idle.policy.plan() with Observations built from the simulated fleet."""

    name = "slurm-idle"
    auto_continue = False

    def __init__(self, sim: Simulation, config: Config) -> None:
        self.config = config
        policy = config.policy
        p = sim.params
        self.step_s = p.step_s
        self.window = max(1, p.steps(policy.scale_down_window_s))  # in steps
        self.sustain = p.steps(policy.queue_sustain_s)  # 0: the queue now counts
        self.day, self.week = DAY_S // p.step_s, WEEK_S // p.step_s
        self.tick_every = p.tick_s // p.step_s
        self.fast_every = p.fast_s // p.step_s
        self.window_max: dict[str, list[float]] = {}
        self.ahead_max: dict[str, list[float]] = {}
        self.later_max: dict[str, list[float]] = {}
        self.then: dict[str, list[float]] = {}  # the demand as the forecast reads the past
        self.trend: dict[str, list[float]] = {}  # least-squares slope over the window, per s
        self.means: dict[str, list[float]] = {}  # mean over the window
        self.noise: dict[str, list[float | None]] = {}  # metrics.forecast.noise_from_changes
        self.lead_s: dict[str, float] = {}
        for model, demand in sim.demand.items():
            lead = max(1, p.steps(default_forecast_lead_s(config, model)))
            self.window_max[model] = sliding_max(demand, self.window)
            # Yesterday's ramp on the demand's window means centred on each moment, as the
            # Prometheus forecast query reads it: a noisy minute back then is no ramp.
            past = centred_means(demand, self.window)
            self.then[model] = past
            self.ahead_max[model] = ahead_max(past, lead)
            self.later_max[model] = ahead_max(past, lead + self.window)
            self.trend[model] = slopes(demand, self.window, p.step_s)
            self.means[model] = means(demand, self.window)
            self.noise[model] = noises(demand, p.steps(NOISE_LAG_S), p.steps(NOISE_SPAN_S))
            self.lead_s[model] = lead * float(p.step_s)
        self._views: dict[tuple[str, Phase, float], NodeView] = {}
        # the queue of each step gone by, per model (grown as the run goes: it depends on what
        # was serving then)
        self._waits: dict[str, list[float]] = {model: [] for model in sim.demand}

    def _waiting(self, sim: Simulation, model: str, step: int) -> float:
        """Requests queued in a past step: demand beyond what the serving replicas deliver."""
        fleet = sim.fleet[model]
        capacity = sim.serving[model][step] * fleet.tokens_per_s
        demand = sim.demand[model][step]
        if demand <= capacity:
            return 0.0
        s = sim.trace.series[model]
        per_request = max(1.0, s.output_tokens[step] + sim.params.prompt_weight * s.prompt_tokens[step])
        return (demand - capacity) / per_request * 10.0  # ~10 s of excess requests

    def _waits_until(self, sim: Simulation, model: str, step: int) -> list[float]:
        """The queues of steps 0 .. step-1 (computed once each)."""
        waits = self._waits[model]
        for i in range(len(waits), step):
            waits.append(self._waiting(sim, model, i))
        return waits

    def load(self, sim: Simulation, model: str, step: int) -> ModelLoad:
        seen = max(0, step - 1)
        s = sim.trace.series[model]
        demand = sim.demand[model]
        rps = s.rps[seen]
        offsets = [seen - offset for offset in (self.day, self.week) if seen - offset >= 0]
        then = self.then[model]
        history = [(then[i], self.ahead_max[model][i]) for i in offsets]
        history_later = [(then[i], self.later_max[model][i]) for i in offsets]
        all_waits = self._waits_until(sim, model, step)
        waits = all_waits[max(0, step - max(self.window, self.sustain)):step]
        waiting = waits[-1] if waits else 0.0
        recent = waits[-self.sustain:] if self.sustain else [waiting]
        # Steps 0..m-1 have been seen: the window (or the sustain span) is covered once there
        # are that many, as the Prometheus source counts the points of its subquery.
        covered = step >= self.window
        window = waits[-self.window:]
        serving = sim.serving[model][seen] if step > 0 else sim.fleet[model].replicas
        capacity = serving * sim.fleet[model].tokens_per_s
        return ModelLoad(
            model=model,
            prompt_tokens_per_s=rps * s.prompt_tokens[seen],
            generation_tokens_per_s=rps * s.output_tokens[seen],
            waiting=waiting,
            waiting_min_recent=min(recent) if step >= self.sustain else None,
            kv_cache_usage_max=min(1.0, demand[seen] / capacity) if capacity > 0 else 1.0,
            demand_tokens_per_s_max_window=self.window_max[model][seen] if covered else None,
            demand_tokens_per_s_mean_window=self.means[model][seen] if covered else None,
            demand_trend_per_s_window=self.trend[model][seen] if covered else None,
            demand_noise_tokens_per_s=self.noise[model][seen] if step > 0 else None,
            waiting_max_window=max(window) if covered else None,
            waiting_min_window=min(window) if covered else None,
            forecast_demand_tokens_per_s=forecast_demand(
                demand[seen], history, self.trend[model][seen], self.lead_s[model]
            ),
            forecast_demand_tokens_per_s_max_window=forecast_demand(
                demand[seen], history_later, self.trend[model][seen],
                self.lead_s[model] + self.step_s * self.window,
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

    def decide(self, sim: Simulation, step: int, now: float) -> list[Action]:
        """A full plan on tick steps (every params.tick_s), a fast check (policy.fast_plan)
        on fast-check steps between them, nothing otherwise (transitions wait for a pass)."""
        if step % self.tick_every == 0:
            planner = plan
        elif self.fast_every and step % self.fast_every == 0:
            planner = fast_plan
        else:
            return []
        views = tuple(
            self.view(node, sim.fleet[model].gpus_per_node, sim.fleet[model].per_node)
            for model, nodes in sim.nodes.items()
            for node in nodes
        )
        loads = tuple(self.load(sim, model, step) for model in sim.nodes)
        return planner(Observation(now=now, nodes=views, models=loads), self.config, now)
