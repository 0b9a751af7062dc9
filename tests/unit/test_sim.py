"""The simulator's accounting: replicas conserved, latencies respected, the oracle a true bound."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
    return Trace(start=0.0, minutes=n,
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


def test_oracle_reaches_the_bound_without_violations() -> None:
    """On random need sequences the oracle policy harvests exactly the analytic bound, violation-free."""
    rng = random.Random(7)
    for _ in range(300):
        replicas = rng.randint(1, 4)
        needs = [rng.randint(0, replicas) for _ in range(rng.randint(5, 40))]
        params = SimParams(utilisation=1.0, start_s=rng.choice([60.0, 300.0]),
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
