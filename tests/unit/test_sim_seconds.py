"""The simulator in seconds (`SimParams.step_s`, `traces.resample`): latencies timed to the
step instead of whole minutes, minutes reported fractional, the minute results unchanged."""

from __future__ import annotations

import pytest

from slurm_idle.errors import ConfigError
from slurm_idle.model import ActionKind
from slurm_idle.sim import FleetModel, SimParams, Simulation, simulate
from slurm_idle.sim.series import slopes
from slurm_idle.traces import (
    Series,
    Trace,
    format_trace,
    parse_azure_trace,
    parse_csv_trace,
    resample,
    synthetic_trace,
    with_arrivals,
)

from .test_sim import Scripted, needs_trace, unit_fleet


def test_hold_repeats_each_minute_and_linear_draws_between_centres() -> None:
    trace = Trace(start=0.0, steps=3, series={"m": Series((0.0, 6.0, 6.0), (1.0,) * 3,
                                                          (2.0,) * 3)})
    held = resample(trace, 20)
    assert (held.steps, held.step_s, held.minutes) == (9, 20, 3.0)
    assert held.series["m"].rps == (0.0,) * 3 + (6.0,) * 6
    assert held.timestamp(4) == 80.0
    drawn = resample(trace, 20, "linear").series["m"].rps
    # fine centres at 10, 30, 50, 70, 90 s ...; the minutes' at 30 s (0.0) and 90 s (6.0):
    # held before the first centre, then a third of the way up every 20 s
    assert drawn[:2] == (0.0, 0.0) and drawn[2:5] == pytest.approx((2.0, 4.0, 6.0))
    assert drawn[5:] == (6.0,) * 4
    assert resample(trace, 60) is trace


@pytest.mark.parametrize("step", [7, 0, 90])
def test_a_step_that_does_not_divide_the_minute_is_refused(step: int) -> None:
    trace = Trace(start=0.0, steps=1, series={"m": Series((1.0,), (1.0,), (1.0,))})
    with pytest.raises(ConfigError, match="divide|whole number"):
        resample(trace, step)


def test_a_reclaim_takes_its_grace_and_wake_in_seconds() -> None:
    """Lent at step 0, reclaimed at step 30 (5 min): a 30 s grace and a 10 s wake bring it
    back 4 steps later in 10 s steps (it took 2 whole minutes by the minute)."""
    params = SimParams(step_s=10, tick_s=60, wake_s=10.0, grace_s=30.0, floor=0)
    sim = Simulation(needs_trace([0] * 10), unit_fleet(1), params)
    result = sim.run(Scripted({0: ActionKind.LEND, 30: ActionKind.RECLAIM}))
    rows = result.timeline["m"]
    assert len(rows) == 60 and result.minutes == 10.0
    assert rows[29] == (0, 0, 1, 0)
    assert all(rows[s] == (0, 0, 0, 1) for s in (30, 31, 32))  # the grace: 3 steps
    assert rows[33] == (0, 1, 0, 0)  # the wake: 1 step
    assert rows[34] == (1, 0, 0, 0)
    # lent once drained (60 s: steps 0-5 retiring), until the reclaim at step 30
    assert rows[5] == (1, 0, 0, 0) and rows[6] == (0, 0, 1, 0)
    assert result.harvested_gpu_hours == pytest.approx(24 * 10 / 3600)


def test_violation_minutes_are_fractional_in_steps() -> None:
    """Short 4 steps of 10 s: 0.67 model-minutes, its share of the steps."""
    params = SimParams(step_s=10, tick_s=60, wake_s=10.0, grace_s=30.0, floor=0)
    sim = Simulation(needs_trace([0, 1, 1]), unit_fleet(1), params)
    result = sim.run(Scripted({0: ActionKind.LEND, 6: ActionKind.RECLAIM}))
    assert result.slo_violation_steps == 4  # steps 6-9: reclaiming 3, starting 1
    summary = result.summary()
    assert summary["slo_violation_minutes"] == 0.67 and summary["step_s"] == 10
    assert summary["slo_violation_share"] == pytest.approx(4 / 18, abs=1e-6)
    assert summary["minutes"] == 3.0


def test_the_oracle_bound_counts_the_reclaim_in_steps() -> None:
    """Free for 5 minutes between two needs: by the minute the 2-minute reclaim (30 s grace
    + 10 s wake, each a whole minute) leaves 3 lendable minutes; in 10 s steps 40 s."""
    needs = [1] + [0] * 5 + [1]
    by_minute = Simulation(needs_trace(needs), unit_fleet(1),
                           SimParams(wake_s=10.0, grace_s=30.0, floor=0, drain_s=0))
    by_step = Simulation(needs_trace(needs), unit_fleet(1),
                         SimParams(step_s=10, wake_s=10.0, grace_s=30.0, floor=0, drain_s=0))
    assert by_minute.oracle_bound() == pytest.approx(3 / 60)
    assert by_step.oracle_bound() == pytest.approx((300 - 40) / 3600)


def test_slopes_by_running_sums_match_least_squares() -> None:
    """The linear-time slope equals a least-squares fit of each window, any step."""
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0, 5.0]
    for width in (1, 2, 3, 5, 11, 20):
        for i, got in enumerate(slopes(values, width, step_s=10.0)):
            window = values[max(0, i - width + 1): i + 1]
            n = len(window)
            if n < 2:
                assert got == 0.0
                continue
            mx, my = (n - 1) / 2, sum(window) / n
            want = (sum((x - mx) * (y - my) for x, y in enumerate(window))
                    / sum((x - mx) ** 2 for x in range(n)) / 10.0)
            assert got == pytest.approx(want, abs=1e-9), (width, i)


@pytest.mark.parametrize("policy", ["slurm-idle", "reactive", "oracle"])
def test_held_steps_of_a_minute_trace_keep_the_score_near_the_minutes(policy: str) -> None:
    """Minute latencies (300 s start, 60 s grace) and a minute cadence: simulated in 10 s steps
    of the held trace, every policy harvests about what it does by the minute, and the
    replicas are conserved at every step."""
    trace = synthetic_trace(days=2, seed=4)
    fleet = [FleetModel("llama-70b", 20, 4, 2500.0)]
    by_minute = simulate(trace, fleet, SimParams(), policy)
    by_step = simulate(trace, fleet, SimParams(step_s=10), policy)
    assert len(by_step.timeline["llama-70b"]) == 6 * len(by_minute.timeline["llama-70b"])
    assert all(sum(row) == 20 for row in by_step.timeline["llama-70b"])
    assert by_step.harvested_gpu_hours == pytest.approx(by_minute.harvested_gpu_hours, rel=0.02)
    assert by_step.oracle_gpu_hours == pytest.approx(by_minute.oracle_gpu_hours, rel=0.01)


def test_fast_checks_every_ten_seconds_run_between_minute_ticks() -> None:
    """With a fast check every 10 s, a reclaim starts within the minute the queue builds, so
    a sudden rise is short for less time than with minute ticks alone."""
    needs = [2] * 30 + [8] * 20
    fleet = [FleetModel("m", 8, 1, 1.0)]
    trace = needs_trace(needs)
    ticks, fast = (simulate(trace, fleet, SimParams(
        step_s=10, tick_s=60, fast_s=fast_s, wake_s=10.0, grace_s=30.0, floor=1,
        utilisation=1.0, prompt_weight=0.0), "slurm-idle") for fast_s in (0, 10))
    assert ticks.slo_violation_steps > 0
    assert fast.slo_violation_steps < ticks.slo_violation_steps


def test_a_finer_trace_is_averaged_with_tokens_weighed_by_requests() -> None:
    """Six 10 s steps to one minute: the mean rate, tokens per request weighed by requests;
    a partial last step averages what it has."""
    trace = Trace(start=0.0, steps=8, step_s=10, series={"m": Series(
        (1.0, 3.0, 0.0, 0.0, 0.0, 2.0, 4.0, 4.0), (10.0, 30.0, 99.0, 99.0, 99.0, 20.0, 5.0, 7.0),
        (1.0,) * 8)})
    minute = resample(trace, 60)
    assert (minute.steps, minute.step_s) == (2, 60)
    assert minute.series["m"].rps == pytest.approx((1.0, 4.0))
    assert minute.series["m"].prompt_tokens[0] == pytest.approx((10 + 90 + 40) / 6)
    assert minute.series["m"].prompt_tokens[1] == pytest.approx(6.0)
    with pytest.raises(ConfigError, match="whole number"):
        resample(trace, 25)


def test_a_csv_trace_recorded_every_ten_seconds_keeps_its_step() -> None:
    """The CSV step is what the timestamps fall on; written back, it reads the same."""
    text = ("timestamp,model,rps,prompt_tokens,output_tokens\n"
            "2026-01-05T10:00:00Z,m,1.0,100,10\n2026-01-05T10:00:10Z,m,2.0,100,10\n"
            "2026-01-05T10:00:30Z,m,4.0,100,10\n")
    trace = parse_csv_trace(text)
    assert (trace.step_s, trace.steps) == (10, 4)
    assert trace.series["m"].rps == (1.0, 2.0, 0.0, 4.0)  # a step without a row: no traffic
    again = parse_csv_trace(format_trace(trace))
    assert again == trace
    minute = parse_csv_trace("timestamp,model,rps,prompt_tokens,output_tokens\n"
                             "2026-01-05T10:00:00Z,m,1.0,1,1\n2026-01-05T10:02:00Z,m,1.0,1,1\n")
    assert (minute.step_s, minute.steps) == (60, 3)


def test_an_azure_trace_aggregates_to_the_simulations_step() -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens\n",
             "2026-01-05 10:00:01,100,10\n", "2026-01-05 10:00:02,300,30\n",
             "2026-01-05 10:00:15,200,20\n"]
    by_10s = parse_azure_trace(lines, "m", step_s=10)
    assert (by_10s.step_s, by_10s.steps) == (10, 2)
    assert by_10s.series["m"].rps == pytest.approx((0.2, 0.1))
    assert by_10s.series["m"].prompt_tokens == pytest.approx((200.0, 200.0))
    assert parse_azure_trace(lines, "m").series["m"].rps == pytest.approx((3 / 60,))


def test_simulate_states_how_the_trace_met_the_step() -> None:
    """A 10 s trace simulated by the minute is averaged, at 10 s used as it is; a minute
    trace at 10 s is held (or drawn)."""
    fine = Trace(start=0.0, steps=60, step_s=10, series={"m": Series(
        (1.0,) * 60, (0.0,) * 60, (1.0,) * 60)})
    fleet = unit_fleet(2)
    by_minute = Simulation(fine, fleet, SimParams(floor=1)).run(Scripted({}))
    as_is = Simulation(fine, fleet, SimParams(floor=1, step_s=10)).run(Scripted({}))
    assert (by_minute.resampled, by_minute.trace_step_s, by_minute.steps) == ("mean", 10, 10)
    assert (as_is.resampled, as_is.steps) == ("none", 60)
    coarse = needs_trace([1] * 3)
    drawn = Simulation(coarse, fleet, SimParams(floor=1, step_s=10, resample="linear"))
    assert drawn.run(Scripted({})).summary()["resampled"] == "linear"


def test_poisson_arrivals_keep_the_mean_and_add_the_counting_noise() -> None:
    """Drawn per 10 s step, 2 requests/s keep their mean and vary as a Poisson count does
    (variance = mean of the count); seeded, so a run repeats; `mean` changes nothing."""
    n = 6000
    trace = Trace(start=0.0, steps=n, step_s=10, series={"m": Series((2.0,) * n, (1.0,) * n,
                                                                    (1.0,) * n)})
    drawn = with_arrivals(trace, "poisson", seed=3)
    counts = [r * 10 for r in drawn.series["m"].rps]
    mean = sum(counts) / n
    variance = sum((c - mean) ** 2 for c in counts) / n
    assert mean == pytest.approx(20.0, rel=0.02) and variance == pytest.approx(20.0, rel=0.1)
    assert all(c == int(c) for c in counts)
    assert with_arrivals(trace, "poisson", seed=3) == drawn
    assert with_arrivals(trace, "mean") is trace
    big = with_arrivals(Trace(start=0.0, steps=2000, series={"m": Series(
        (100.0,) * 2000, (1.0,) * 2000, (1.0,) * 2000)}), "poisson")  # 6000 a minute: normal
    assert sum(big.series["m"].rps) / 2000 == pytest.approx(100.0, rel=0.01)
    with pytest.raises(ConfigError, match="arrivals"):
        with_arrivals(trace, "bursty")
