"""The SLO as clients feel it (slurm_idle/sim/clients.py): unserved demand, short minutes,
the fluid queue's delays and flaps, on series small enough to check by hand."""

from __future__ import annotations

import pytest

from slurm_idle.model import Action, ActionKind, Phase
from slurm_idle.sim import FleetModel, SimParams, Simulation, simulate
from slurm_idle.sim.clients import (
    Reversal,
    flaps,
    queue_delays,
    unserved,
    weighted_quantile,
)
from slurm_idle.traces import Series, Trace

from .test_sim import Scripted, needs_trace, unit_fleet


def test_unserved_demand_and_steps_short_by_more_than_five_percent() -> None:
    gap, short = unserved([100.0, 100.0, 100.0, 0.0], [100.0, 97.0, 50.0, 0.0])
    assert gap == pytest.approx(53.0)
    assert short == 1  # 3% short is felt less than 5%; 50% short counts


def test_no_queue_while_capacity_keeps_up() -> None:
    assert queue_delays([5.0, 10.0, 0.0], [10.0, 10.0, 10.0], 60.0) == [0.0, 0.0, 0.0]


def test_a_backlog_delays_until_it_drains_at_the_spare_capacity() -> None:
    """Demand 20 against capacity 10 for one 60 s step leaves 600 tokens queued; the next
    steps (demand 5, capacity 10) drain them at 5/s: the last arrival of step 0 is served 60 s
    into step 1 (its 600 queued tokens take 60 s at capacity 10, with step 1's arrivals
    behind them), and step 1's last arrival waits for the 300 tokens still queued then."""
    delays = queue_delays([20.0, 5.0, 5.0, 5.0], [10.0, 10.0, 10.0, 10.0], 60.0)
    assert delays[0] == pytest.approx(60.0)
    assert delays[1] == pytest.approx(30.0)
    assert delays[2] == pytest.approx(0.0) and delays[3] == 0.0


def test_a_backlog_left_at_the_end_waits_until_the_end() -> None:
    delays = queue_delays([20.0, 20.0], [10.0, 10.0], 10.0)
    assert delays == [10.0, 0.0]  # a lower bound: the trace ends with the queue


def test_zero_capacity_queues_until_capacity_returns() -> None:
    """No replica serving for two steps: the arrivals wait for the step that serves again,
    which works the 20 queued tokens off at 10/s: step 0's last at 1 s into step 2 (11 s after
    it came), step 1's at 2 s (2 s after)."""
    delays = queue_delays([1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 10.0, 10.0], 10.0)
    assert delays[0] == pytest.approx(11.0)
    assert delays[1] == pytest.approx(2.0)
    assert delays[2] == 0.0


def test_weighted_quantile() -> None:
    assert weighted_quantile([0.0, 10.0], [99.0, 1.0], 0.99) == 0.0
    assert weighted_quantile([0.0, 10.0], [98.0, 2.0], 0.99) == 10.0
    assert weighted_quantile([5.0], [0.0], 0.99) == 0.0


def test_flaps_are_quick_reversals_at_a_level_the_load_kept() -> None:
    demand = {"m": [100.0] * 10 + [200.0] * 10}
    noise = {"m": [5.0] * 20}
    still = Reversal("m", lent_at=0.0, undone_at=300.0)  # 5 min, no move: a flap
    moved = Reversal("m", lent_at=300.0, undone_at=660.0)  # the load doubled: a reason
    late = Reversal("m", lent_at=0.0, undone_at=1000.0)  # beyond the 900 s window
    assert flaps([still, moved, late], demand, noise, 0.0, 60.0, 900.0, 3.0) == 1
    # before the noise is on record, only a load that stood still makes a flap
    assert flaps([still], demand, {"m": [None] * 20}, 0.0, 60.0, 900.0, 3.0) == 1


def test_the_engine_records_every_kind_of_undone_lend() -> None:
    """A lend aborted while draining, and a lend reclaimed once lent, are both reversals,
    each timed from its own lend decision."""
    sim = Simulation(needs_trace([0] * 30), unit_fleet(1),
                     SimParams(floor=0, drain_s=60, step_s=10))
    node = sim.nodes["m"][0].name

    class AbortThenLend(Scripted):
        def decide(self, sim: Simulation, step: int, now: float) -> list[Action]:
            if step == 2:  # 20 s into its 60 s drain
                return [Action(ActionKind.ABORT_LEND, node, "m", Phase.RETIRING,
                               Phase.SERVING, "test")]
            return super().decide(sim, step, now)

    result = sim.run(AbortThenLend({0: ActionKind.LEND, 5: ActionKind.LEND,
                                    12: ActionKind.RECLAIM}))
    assert [(r.lent_at, r.undone_at) for r in sim.reversals] == [(0.0, 20.0), (50.0, 120.0)]
    assert result.flaps == 2  # the demand stood still both times
    assert result.summary()["flaps"] == 2


def test_a_short_run_of_a_real_policy_reports_every_client_figure() -> None:
    """A 2-replica model whose demand triples for a while under the reactive policy: short
    minutes, unserved demand and queue delays all show, and the figures are in --json."""
    needs = [1] * 20 + [3] * 10 + [1] * 10
    fleet = [FleetModel("m", 3, 1, 1.0)]
    sim = Simulation(needs_trace(needs), fleet, SimParams(floor=1, utilisation=1.0,
                                                          prompt_weight=0.0))
    from slurm_idle.sim.baselines import Reactive

    summary = sim.run(Reactive()).summary()
    assert summary["unserved_share"] > 0 and summary["minutes_short_5pct"] > 0
    assert summary["queue_delay_max_s"] >= summary["queue_delay_p99_s"] > 0


def test_demand_beyond_the_whole_fleet_is_no_policys_shortfall() -> None:
    """Twice what every replica serves, all replicas serving: nothing unserved, no queue,
    no short minute (and no violation) for any policy; one replica lent, it shows."""
    fleet = [FleetModel("m", 2, 1, 1.0)]
    over = Simulation(needs_trace([4] * 5), fleet, SimParams(floor=0, utilisation=1.0,
                                                             prompt_weight=0.0))
    summary = over.run(Scripted({})).summary()
    assert summary["slo_violation_minutes"] == 0
    assert (summary["unserved_share"], summary["minutes_short_5pct"]) == (0.0, 0)
    assert summary["queue_delay_max_s"] == 0.0
    lent = Simulation(needs_trace([4] * 5), [FleetModel("m", 2, 1, 1.0)],
                      SimParams(floor=0, utilisation=1.0, prompt_weight=0.0))

    class LendOne(Scripted):
        def decide(self, sim: Simulation, step: int, now: float) -> list[Action]:
            if step:
                return []
            node = sim.nodes["m"][0]
            return [Action(ActionKind.LEND, node.name, "m", Phase.SERVING, Phase.RETIRING, "t")]

    short = lent.run(LendOne({})).summary()
    assert short["unserved_share"] > 0 and short["minutes_short_5pct"] > 0
    assert short["queue_delay_max_s"] > 0


def test_the_planner_does_not_flap_at_a_constant_load() -> None:
    """Poisson arrivals at a constant 12 req/s need 2.6 replicas of 4 (600 tok/s at 80%): the
    level sits near a replica boundary and the minute noise crosses it. The planner lends what
    holds and keeps it: no lend undone within the scale-down window (it was 11 in 6 hours
    while a noisy minute was planned for on top of its own margin, and lends were only checked
    over the reclaim lead)."""
    minutes = 6 * 60
    trace = Trace(start=0.0, steps=minutes,
                  series={"m": Series((12.0,) * minutes, (20.0,) * minutes, (100.0,) * minutes)})
    result = simulate(trace, [FleetModel("m", 4, 4, 600.0)], SimParams(arrivals="poisson"),
                      "slurm-idle").summary()
    assert result["flaps"] == 0
    assert result["preemptions"] <= 2
    assert result["harvest_ratio"] > 0.6
