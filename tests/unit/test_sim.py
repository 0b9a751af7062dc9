"""The simulator's accounting: replicas conserved, latencies respected, the oracle a true bound."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from slurm_idle.errors import ConfigError
from slurm_idle.model import Action, ActionKind, Phase
from slurm_idle.sim import POLICIES, FleetModel, SimParams, Simulation, parse_fleet, simulate
from slurm_idle.sim.baselines import Oracle
from slurm_idle.traces import Series, Trace, synthetic_trace

FLEET = [FleetModel("llama-70b", 20, 4, 2500.0)]


def needs_trace(needs: list[int]) -> Trace:
    """A trace whose minute m needs exactly needs[m] replicas (1 token/s per rps, 1 tok/s replicas)."""
    n = len(needs)
    return Trace(start=0.0, steps=n,
                 series={"m": Series(tuple(float(x) for x in needs), (0.0,) * n, (1.0,) * n)})


def unit_fleet(replicas: int) -> list[FleetModel]:
    return [FleetModel("m", replicas, 1, 1.0)]


@dataclass
class Scripted:
    """A test policy: fixed actions at fixed minutes (as LEND/RECLAIM of one node)."""

    at: dict[int, ActionKind]
    name: str = "scripted"
    auto_continue: bool = True
    seen: list[tuple[int, Phase]] = field(default_factory=list)

    def decide(self, sim: Simulation, minute: int, now: float) -> list[Action]:
        node = sim.nodes["m"][0]
        kind = self.at.get(minute)
        if kind is ActionKind.LEND:
            return [Action(kind, node.name, "m", Phase.SERVING, Phase.RETIRING, "test")]
        if kind is ActionKind.RECLAIM:
            return [Action(kind, node.name, "m", Phase.LENT, Phase.RECLAIMING, "test")]
        return []


@pytest.mark.parametrize("policy", POLICIES)
def test_replicas_are_conserved_every_minute(policy: str) -> None:
    """serving + starting + lent + reclaiming equals the replicas in every minute, any policy."""
    trace = synthetic_trace(days=2, seed=4)
    result = simulate(trace, FLEET, SimParams(), policy)
    assert len(result.timeline["llama-70b"]) == trace.minutes
    assert all(sum(row) == 20 for row in result.timeline["llama-70b"])


@pytest.mark.parametrize(("params", "back_at"), [(SimParams(), 16), (SimParams(wake_s=30.0), 12)])
def test_reclaim_takes_grace_then_start(params: SimParams, back_at: int) -> None:
    """A node lent at minute 0 serves that minute (draining), is lent from 1; reclaimed at 10 it
    spends the grace time reclaiming and the start (or wake) time starting before serving."""
    sim = Simulation(needs_trace([0] * 20), unit_fleet(1), replace_floor(params))
    result = sim.run(Scripted({0: ActionKind.LEND, 10: ActionKind.RECLAIM}))
    rows = result.timeline["m"]
    assert rows[0] == (1, 0, 0, 0)
    assert all(rows[m] == (0, 0, 1, 0) for m in range(1, 10))
    assert rows[10] == (0, 0, 0, 1)
    assert all(rows[m] == (0, 1, 0, 0) for m in range(11, back_at))
    assert rows[back_at] == (1, 0, 0, 0)
    assert result.preemptions == 1
    assert result.harvested_gpu_hours == pytest.approx(9 / 60)
    assert result.lost_gpu_hours == pytest.approx(9 / 60)  # lent 9 min, no checkpoint yet


def replace_floor(params: SimParams) -> SimParams:
    from dataclasses import replace

    return replace(params, floor=0)


def test_violation_is_serving_below_need() -> None:
    """A minute where fewer replicas serve than the trace needs is a violation."""
    sim = Simulation(needs_trace([0, 0, 1, 1, 1, 0]), unit_fleet(1), SimParams(floor=0))
    result = sim.run(Scripted({0: ActionKind.LEND, 2: ActionKind.RECLAIM}))
    assert result.slo_violation_minutes == 3  # minutes 2, 3, 4: the replica is coming back


@dataclass
class LendAll:
    """A test policy: lend every serving node of every model at minute 0, never reclaim."""

    name: str = "lend-all"
    auto_continue: bool = True

    def decide(self, sim: Simulation, minute: int, now: float) -> list[Action]:
        if minute:
            return []
        return [Action(ActionKind.LEND, n.name, n.model, Phase.SERVING, Phase.RETIRING, "test")
                for nodes in sim.nodes.values() for n in nodes]


def test_violations_count_per_model_minute() -> None:
    """A minute short for two models counts twice; the wall-clock count keeps it once."""
    n = 4
    trace = Trace(start=0.0, steps=n, series={
        name: Series((1.0,) * n, (0.0,) * n, (1.0,) * n) for name in ("a", "b")})
    fleet = [FleetModel("a", 1, 1, 1.0), FleetModel("b", 1, 1, 1.0)]
    result = Simulation(trace, fleet, SimParams(floor=0, utilisation=1.0)).run(LendAll())
    # minute 0 drains (still serving); minutes 1-3 both models are short
    assert result.violation_minutes_by_model == {"a": 3, "b": 3}
    assert result.slo_violation_minutes == 6
    assert result.slo_violation_wall_minutes == 3
    assert result.model_minutes == 8
    assert result.summary()["slo_violation_share"] == pytest.approx(0.75)


def test_oracle_reaches_the_bound_without_violations() -> None:
    """On random need sequences the oracle policy harvests exactly the analytic bound, violation-free."""
    rng = random.Random(7)
    for _ in range(300):
        replicas = rng.randint(1, 4)
        needs = [rng.randint(0, replicas) for _ in range(rng.randint(5, 40))]
        params = SimParams(utilisation=1.0, start_s=rng.choice([0.0, 60.0, 300.0]),
                           grace_s=rng.choice([0.0, 60.0]), drain_s=rng.choice([0.0, 60.0]),
                           floor=rng.choice([0, 1]))
        sim = Simulation(needs_trace(needs), unit_fleet(replicas), params)
        result = sim.run(Oracle())
        assert result.slo_violation_minutes == 0
        assert result.harvested_gpu_hours == pytest.approx(result.oracle_gpu_hours)


def test_no_policy_beats_the_oracle_at_equal_or_fewer_violations() -> None:
    """Any policy run without violations harvests at most the oracle's GPU-hours."""
    for seed in range(3):
        trace = synthetic_trace(days=2, seed=seed)
        for policy in POLICIES:
            result = simulate(trace, FLEET, SimParams(), policy)
            if result.slo_violation_minutes == 0:
                assert result.harvested_gpu_hours <= result.oracle_gpu_hours + 1e-9
    rng = random.Random(3)
    for _ in range(100):
        needs = [rng.randint(0, 3) for _ in range(30)]
        for policy in POLICIES:
            sim_result = simulate(needs_trace(needs), unit_fleet(3), SimParams(utilisation=1.0), policy)
            if sim_result.slo_violation_minutes == 0:
                assert sim_result.harvested_gpu_hours <= sim_result.oracle_gpu_hours + 1e-9


def test_night_window_lends_only_at_night() -> None:
    """night-window has nothing lent between 08:00 and 20:00 (UTC) once reclaims are done."""
    trace = synthetic_trace(days=2, seed=1)
    result = simulate(trace, FLEET, SimParams(), "night-window", night_lend=5)
    rows = result.timeline["llama-70b"]
    for day in range(2):
        assert all(rows[day * 1440 + m][2] == 0 for m in range(8 * 60 + 7, 20 * 60))
        assert rows[day * 1440 + 2 * 60][2] == 5


def test_slurm_idle_beats_the_baselines_on_a_short_diurnal_trace() -> None:
    """The real planner harvests more than night-window with fewer violations than reactive."""
    trace = synthetic_trace(days=3, seed=2)
    ours = simulate(trace, FLEET, SimParams(), "slurm-idle")
    assert ours.harvested_gpu_hours > simulate(trace, FLEET, SimParams(), "night-window").harvested_gpu_hours
    assert ours.slo_violation_minutes < simulate(trace, FLEET, SimParams(), "reactive").slo_violation_minutes
    assert ours.harvest_ratio > 0.9


def test_parse_fleet_and_errors() -> None:
    """--fleet specs parse; bad specs and fleets missing from the trace fail clearly."""
    assert parse_fleet("meta/llama=8:4:2500") == FleetModel("meta/llama", 8, 4, 2500.0)
    with pytest.raises(ConfigError, match="MODEL=REPLICAS"):
        parse_fleet("llama=8:4")
    with pytest.raises(ConfigError, match="not in the trace"):
        simulate(synthetic_trace(days=1), [FleetModel("other", 2, 1, 1.0)])
    with pytest.raises(ConfigError, match="drain"):
        SimParams(drain_s=120.0)


@pytest.mark.parametrize("utilisation", [0.6, 0.9])
def test_slurm_idle_plans_against_the_simulated_slo_line(utilisation: float) -> None:
    """--utilisation moves the SLO line and the planner's target with it (at SIM_POLICY's
    margin): few violations at any line, not 95% of minutes at 0.6 as when the planner kept 0.78."""
    trace = synthetic_trace(days=2, seed=1)
    params = SimParams(utilisation=utilisation)
    result = simulate(trace, FLEET, params, "slurm-idle")
    assert result.slo_violation_minutes <= 0.005 * result.minutes
    assert result.harvest_ratio > 0.85


def test_sim_policy_follows_the_demand_model() -> None:
    """Without --config the planner's utilisation is SIM_POLICY's share of the SLO line
    (0.975 x U) and its prompt weight the demand model's; the defaults give SIM_POLICY itself."""
    from slurm_idle.sim import SIM_POLICY, sim_policy

    assert sim_policy(SimParams()) == SIM_POLICY
    knobs = sim_policy(SimParams(utilisation=0.6, prompt_weight=0.3))
    assert knobs.target_utilisation == pytest.approx(0.6)
    assert knobs.prompt_token_weight == 0.3
    assert sim_policy(SimParams(utilisation=1.0)).target_utilisation <= 1.0


def test_simulated_planner_reclaims_with_the_simulated_latencies() -> None:
    """The planner's forecast lead is the simulated grace + start (or wake) + a tick."""
    from slurm_idle.policy import default_forecast_lead_s
    from slurm_idle.sim import SIM_POLICY
    from slurm_idle.sim.planner_driver import fleet_config

    cold = fleet_config(FLEET, SimParams(start_s=600.0, grace_s=120.0), SIM_POLICY)
    assert default_forecast_lead_s(cold, "llama-70b") == 120.0 + 600.0 + 60.0
    wake = fleet_config(FLEET, SimParams(wake_s=30.0), SIM_POLICY)
    assert default_forecast_lead_s(wake, "llama-70b") == 60.0 + 30.0 + 60.0


def test_no_lending_before_the_window_has_history() -> None:
    """An idle fleet lends nothing until the trace has run a whole scale-down window (15 min),
    as the metrics sources report no window maximum before."""
    result = simulate(needs_trace([0] * 40), unit_fleet(3), SimParams(), "slurm-idle")
    lent = [row[2] for row in result.timeline["m"]]
    assert not any(lent[:15])
    assert lent[20] == 2  # down to the floor of 1


def test_simulated_queue_signal_covers_the_sustain_span() -> None:
    """The driver's waiting_min_recent is the queue's minimum over the last queue_sustain_s of
    minutes (None before that much has run); window fields are None before the window has."""
    from slurm_idle.config import PolicyConfig
    from slurm_idle.sim.planner_driver import PlannerPolicy, fleet_config

    needs = [2, 0, 2, 2, 2, 0] * 5
    sim = Simulation(needs_trace(needs), unit_fleet(1), SimParams(utilisation=1.0))
    sim.serving["m"] = [1] * len(needs)  # demand 2 tok/s on 1 tok/s of capacity queues
    config = fleet_config(list(sim.fleet.values()), sim.params, PolicyConfig(queue_sustain_s=120))
    driver = PlannerPolicy(sim, config)
    assert driver.load(sim, "m", 1).waiting_min_recent is None
    queued = [driver.load(sim, "m", m) for m in range(2, 16)]
    for minute, load in enumerate(queued, start=2):
        assert (load.waiting > 0) is (needs[minute - 1] == 2)
        assert ((load.waiting_min_recent or 0.0) > 0) is (needs[minute - 2] == needs[minute - 1] == 2)
        assert (load.demand_tokens_per_s_max_window is None) is (minute < 15)
        assert (load.waiting_max_window is None) is (minute < 15)


def test_oracle_reclaims_and_lends_in_one_tick_when_reclaims_take_no_time() -> None:
    """Regression: with zero grace and start a node needed for one minute between two lent
    spans is reclaimed and lent again in the same tick, as the bound counts."""
    sim = Simulation(needs_trace([0, 0, 0, 1, 1, 1, 0, 1, 0, 1]), unit_fleet(1),
                     SimParams(utilisation=1.0, start_s=0.0, grace_s=0.0, floor=0))
    result = sim.run(Oracle())
    assert result.slo_violation_minutes == 0
    assert result.harvested_gpu_hours == pytest.approx(result.oracle_gpu_hours)
    assert result.oracle_gpu_hours == pytest.approx(4 / 60)


def test_models_with_the_same_last_name_part_get_their_own_nodes() -> None:
    """org1/llama and org2/llama each get their replicas (nodes used to collide on `llama`);
    the real planner accepts the fleet and the oracle reaches its bound."""
    from slurm_idle.sim.engine import fleet_node_names
    from slurm_idle.traces import SyntheticModel

    fleet = [FleetModel("org1/llama", 6, 1, 2500.0), FleetModel("org2/llama", 4, 1, 2500.0),
             FleetModel("Org1/Llama", 2, 1, 2500.0)]
    names = fleet_node_names(fleet)
    every = [n for ns in names.values() for n in ns]
    assert len(every) == len(set(every)) == 12
    assert names["org1/llama"][0] == "org1-llama-000" and names["org2/llama"][0] == "org2-llama-000"
    trace = synthetic_trace(days=1, seed=1, models=[
        SyntheticModel(name=f.name, peak_rps=15.0) for f in fleet])
    oracle = simulate(trace, fleet, SimParams(), "oracle")
    assert oracle.harvest_ratio == pytest.approx(1.0) and oracle.slo_violation_minutes == 0
    ours = simulate(trace, fleet, SimParams(), "slurm-idle")
    assert all(sum(row) == f.replicas for f in fleet for row in ours.timeline[f.name])


def test_a_model_given_twice_in_the_fleet_is_refused() -> None:
    """Two --fleet entries for one model are a clear error, not a silently merged fleet."""
    fleet = [FleetModel("llama-70b", 4, 1, 2500.0), FleetModel("llama-70b", 2, 1, 2500.0)]
    with pytest.raises(ConfigError, match="llama-70b given more than once"):
        simulate(synthetic_trace(days=1), fleet)


def _bench_sim() -> object:
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench-sim"
    loader = importlib.machinery.SourceFileLoader("bench_sim", str(path))
    spec = importlib.util.spec_from_loader("bench_sim", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sim"] = module
    loader.exec_module(module)
    return module


def test_bench_sim_goals_beat_reactive_on_diurnal_and_match_it_on_bursts() -> None:
    """bench-sim: diurnal traces must have strictly fewer violation minutes than reactive,
    bursty ones no more; diurnal-noisy is shown, not judged."""
    bench: Any = _bench_sim()

    def rows(violations: dict[str, tuple[int, int]]) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for trace in bench.TRACES:
            ours, reactive = violations.get(trace, (0, 10))
            base = {"trace": trace, "minutes": 20160, "model_minutes": 20160, "harvest_ratio": 0.96}
            out += [
                {**base, "policy": "slurm-idle", "slo_violation_minutes": ours,
                 "slo_violation_share": ours / 20160, "harvested_gpu_hours": 100.0},
                {**base, "policy": "reactive", "slo_violation_minutes": reactive,
                 "harvested_gpu_hours": 100.0},
                {**base, "policy": "night-window", "slo_violation_minutes": 0,
                 "harvested_gpu_hours": 40.0},
                {**base, "policy": "oracle", "slo_violation_minutes": 0, "harvested_gpu_hours": 104.0},
            ]
        return out

    assert bench.goals(rows({})) == []
    assert bench.goals(rows({"diurnal": (5, 5)})) == [
        "diurnal: does not beat reactive on violation minutes"]
    assert bench.goals(rows({"bursty": (5, 5)})) == []
    assert bench.goals(rows({"bursty": (6, 5)})) == ["bursty: more violation minutes than reactive"]
    assert bench.goals(rows({"diurnal-noisy": (50, 5)})) == []
    # the fast path: at most 0.05% of model-minutes short
    assert bench.goals(rows({"diurnal-fast": (10, 20)})) == []
    assert bench.goals(rows({"diurnal-fast": (11, 20)})) == [
        "diurnal-fast: violation share 0.055% > 0.05%"]


def test_noise_is_the_same_in_the_simulator_and_the_scrape_history() -> None:
    """The simulator's running noise estimate equals the scrape history's on the same minutes
    (one function, metrics.forecast.noise_from_changes, defines it for every source)."""
    from slurm_idle.metrics import history
    from slurm_idle.sim.series import noises

    rng = random.Random(3)
    values = [1000.0 * (1 + 0.05 * rng.gauss(0, 1)) + 2 * i for i in range(150)]
    sim = noises(values, 10, 60)
    kept = [(60.0 * i, "m", v, 0.0) for i, v in enumerate(values)]
    for i in (69, 100, 149):
        assert history.noise(kept, "m", 60.0 * i, 120.0) == pytest.approx(sim[i])
    assert sim[68] is None and history.noise(kept, "m", 60.0 * 50, 120.0) is None


def test_fast_checks_between_sparse_ticks_cut_violations() -> None:
    """With a full tick every 5 minutes, fast checks every minute (reclaims on pressure only)
    leave fewer violation minutes than ticks alone; cadences off the step grid are refused."""
    trace = synthetic_trace(days=3, seed=1)
    sparse = simulate(trace, FLEET, SimParams(tick_s=300), "slurm-idle")
    fast = simulate(trace, FLEET, SimParams(tick_s=300, fast_s=60), "slurm-idle")
    assert fast.slo_violation_minutes < sparse.slo_violation_minutes
    with pytest.raises(ConfigError, match="whole number of steps"):
        SimParams(tick_s=30)
    with pytest.raises(ConfigError, match="whole steps"):
        SimParams(step_s=20, tick_s=60, fast_s=30)
    with pytest.raises(ConfigError, match="a divisor of 60"):
        SimParams(step_s=7, tick_s=70)
    SimParams(step_s=10, tick_s=60, fast_s=10)  # the fast path: checks every 10 s



def test_level_oracle_plans_for_the_level_ahead_in_whole_nodes() -> None:
    """Without a margin, the level oracle serves the centred level: a minute before a rise
    already needs more (the window reaches ahead), replicas count in whole nodes of two, and
    the floor holds where the level needs less."""
    from slurm_idle.sim.baselines import LevelOracle

    trace = Trace(start=0.0, steps=20, series={
        "m": Series((1.6,) * 10 + (4.0,) * 10, (0.0,) * 20, (1.0,) * 20)})
    fleet = [FleetModel("m", 6, 1, 1.0, per_node=2)]
    oracle = LevelOracle(sigmas=0.0, noise="trace", half_width=2)
    # levels 1.6 .. 1.6, 2.08, 2.56, 3.04, 3.52, 4.0 ..: replicas at 80% 2, 3, 4, 4, 5, 5
    assert oracle.needs(Simulation(trace, fleet, SimParams()))["m"] == [1] * 8 + [2, 2, 2] + [3] * 9
    floored = LevelOracle(sigmas=0.0, noise="trace", half_width=2)
    assert floored.needs(Simulation(trace, fleet, SimParams(floor=3)))["m"][:8] == [2] * 8


def test_level_oracle_plans_each_simulation_and_holds_the_noise_figure_asked() -> None:
    """One instance run on two simulations plans each from its own trace; the hourly noise
    figure keeps no margin in a calm hour where the whole-trace figure does; keyword-only
    fields, and an unknown noise figure is refused."""
    from slurm_idle.sim.baselines import LevelOracle

    oracle = LevelOracle(sigmas=3.0)
    first, second = synthetic_trace(days=1, seed=4), synthetic_trace(days=1, seed=5)
    assert oracle.needs(Simulation(first, FLEET, SimParams())) == LevelOracle(sigmas=3.0).needs(
        Simulation(first, FLEET, SimParams()))
    assert oracle.needs(Simulation(second, FLEET, SimParams())) == LevelOracle(sigmas=3.0).needs(
        Simulation(second, FLEET, SimParams()))
    rng = random.Random(2)
    calm_then_noisy = [1000.0] * 200 + [1000.0 * (1 + 0.2 * rng.gauss(0, 1)) for _ in range(200)]
    trace = Trace(start=0.0, steps=400, series={
        "m": Series(tuple(calm_then_noisy), (0.0,) * 400, (1.0,) * 400)})
    fleet = [FleetModel("m", 40, 1, 100.0)]
    hour = LevelOracle(sigmas=3.0).needs(Simulation(trace, fleet, SimParams()))["m"]
    whole = LevelOracle(sigmas=3.0, noise="trace").needs(Simulation(trace, fleet, SimParams()))["m"]
    assert hour[100:190] == [13] * 90  # 1000 / 80 tok/s, no noise in the last hour
    assert min(whole[100:190]) > 13
    # In the noisy part: the planner's figure as it stood a reclaim before the minute (16
    # minutes of grace + start, +1), widened as the planner widens it for a 15-minute start
    # (lead 17 minutes: x1.5)
    from slurm_idle.policy.capacity import replicas_for
    from slurm_idle.sim.baselines import centred_means
    from slurm_idle.sim.series import noises

    slow = SimParams(start_s=900.0)
    planned = LevelOracle(sigmas=3.0).needs(Simulation(trace, fleet, slow))["m"]
    level, noise = centred_means(calm_then_noisy, 7), noises(calm_then_noisy, 10, 60)
    expected = [min(40, max(1, replicas_for(level[m] + 3 * 1.5 * (noise[m - 17] or 0.0), 100.0, 0.8)))
                for m in range(280, 400)]
    assert planned[280:400] == expected
    with pytest.raises(TypeError):
        LevelOracle(3.0)  # type: ignore[misc]
    with pytest.raises(ValueError, match="hour, trace"):
        LevelOracle(noise="day")


def test_level_oracle_knows_the_level_not_the_noise() -> None:
    """The reference of scripts/bench-sim-bound: it sizes for the centred level plus sigmas x a
    noise figure (the planner's hourly one by default). Without a margin minute noise leaves it
    short; a margin of
    4 sigma nearly never, for less harvest and within the oracle's bound (short minutes are
    how the bare one can lend more than the oracle)."""
    from slurm_idle.sim.baselines import LevelOracle, centred_means, relative_noise

    assert centred_means([1.0, 2.0, 3.0, 4.0, 5.0], 1) == [1.5, 2.0, 3.0, 4.0, 4.5]
    assert relative_noise([0.9, 1.1, 0.9, 1.1], [1.0] * 4) == pytest.approx(0.1)
    assert relative_noise([1.0, 2.0], [0.0, 0.0]) == 0.0
    trace = synthetic_trace(days=2, seed=4)
    bare = Simulation(trace, FLEET, SimParams()).run(LevelOracle(sigmas=0.0))
    wide = Simulation(trace, FLEET, SimParams()).run(LevelOracle(sigmas=4.0))
    assert bare.slo_violation_minutes > 5 * max(1, wide.slo_violation_minutes)
    assert wide.harvested_gpu_hours < min(bare.harvested_gpu_hours, wide.oracle_gpu_hours)
