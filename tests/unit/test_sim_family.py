"""The benchmark family: deterministic by seed, wide ranges, split fixed by seed."""

from __future__ import annotations

import math
import random
import statistics

from slurm_idle.sim.engine import SimParams
from slurm_idle.sim.family import HELD_OUT, TUNING, member, members, split_of, trace
from slurm_idle.sim.family_bench import goals, run, stats
from slurm_idle.sim.twists import Twists, apply_twists, heavy_factor


def test_members_are_deterministic_and_split_by_seed() -> None:
    """The same seed gives the same member and trace; odd seeds are held out, even ones tune."""
    assert member(5) == member(5)
    assert trace(member(5)).series == trace(member(5)).series
    assert split_of(1) == HELD_OUT and split_of(2) == TUNING
    assert [m.split for m in members(4)] == [HELD_OUT, TUNING, HELD_OUT, TUNING]


def test_ranges_are_wide() -> None:
    """Over 60 members: 1-14 days, 1-4 models, noise within 1-10%, some with 10-minute steps."""
    ms = members(60)
    assert {m.days for m in ms} <= set(range(1, 15)) and min(m.days for m in ms) <= 3
    assert max(m.days for m in ms) >= 12
    assert {len(m.fleet) for m in ms} == {1, 2, 3, 4}
    noises = [s.noise for m in ms for s in m.shapes]
    assert all(0.01 <= n <= 0.10 for n in noises) and min(noises) < 0.02 and max(noises) > 0.07
    assert any(m.steps_10min for m in ms) and not all(m.steps_10min for m in ms)
    assert len({s.zone_h for m in ms for s in m.shapes}) >= 4


def test_steps_hold_the_rate_for_ten_minutes() -> None:
    """A member with 10-minute steps changes its rate only at multiples of 10 minutes (bursts
    aside: checked on a member without any)."""
    m = next(m for m in members(200) if m.steps_10min and all(s.bursts_per_week == 0 for s in m.shapes))
    for series in trace(m).series.values():
        changes = [i for i in range(1, len(series.rps)) if series.rps[i] != series.rps[i - 1]]
        assert changes and all(i % 10 == 0 for i in changes)


def test_bench_rows_stats_and_goals() -> None:
    """Two small members through two policies: a row each, stats per set, goals checked on the
    held-out set only (the oracle has no violations)."""
    rows = run(2, ("oracle", "reactive"), first_seed=1)
    assert len(rows) == 4
    assert {r["set"] for r in rows} == {HELD_OUT, TUNING}
    table = stats(rows)
    oracle = next(s for s in table if s["policy"] == "oracle" and s["set"] == HELD_OUT)
    assert oracle["share_worst"] == 0 and oracle["harvest_median"] == 1.0
    assert not [f for f in goals(rows, policy="oracle") if "share" in f]


def test_the_family_holds_every_kind_of_surprise() -> None:
    """Over 60 members: flash crowds, weekday levels, trends, level shifts, heavy tails, two
    time zones, and cold starts other than 300 s / 60 s on some members but not all."""
    twists = [s.twists for m in members(60) for s in m.shapes]
    assert any(t.flashes for t in twists) and not all(t.flashes for t in twists)
    assert any(t.weekdays for t in twists) and any(t.growth > 0.2 for t in twists)
    assert any(t.growth < -0.1 for t in twists) and any(t.shifts for t in twists)
    assert any(t.heavy_tail for t in twists) and not all(t.heavy_tail for t in twists)
    assert any(t.second_zone_h is not None for t in twists)
    latencies = {m.latencies for m in members(60)}
    assert "300/60" in latencies and len(latencies) >= 6


def test_base_shapes_do_not_move_with_the_twists() -> None:
    """The twists come from a second stream: a member's first three models keep the shape
    (zone, noise, fleet) they had in the narrow family."""
    m = member(1)
    assert [(s.zone_h, round(s.noise, 4)) for s in m.shapes[:3]] == [(8.0, 0.0311), (8.0, 0.0171),
                                                                    (-5.0, 0.018)]
    assert [(f.replicas, f.gpus_per_replica) for f in m.fleet[:3]] == [(15, 8), (18, 4), (16, 1)]


def test_twists_shape_the_level() -> None:
    """A flash crowd peaks at its factor and fades; a shift holds from its minute on; the
    trend runs from 1 to 1 + growth."""
    flash = Twists(flashes=((100, 3.0, 2.0, 10.0),))
    assert apply_twists(flash, 99, 1000) == 1.0
    assert apply_twists(flash, 102, 1000) == 3.0
    assert 1.0 < apply_twists(flash, 120, 1000) < 1.5
    assert apply_twists(Twists(shifts=((10, 0.5),)), 9, 100) == 1.0
    assert apply_twists(Twists(shifts=((10, 0.5),)), 99, 100) == 0.5
    grow = Twists(growth=0.4)
    assert apply_twists(grow, 0, 101) == 1.0 and math.isclose(apply_twists(grow, 100, 101), 1.4)


def test_heavy_tailed_noise_keeps_its_scale_with_fatter_tails() -> None:
    """Student-t(3) draws scaled to unit variance: spread like a normal's in the middle, far
    more draws beyond 4 sigma."""
    rng = random.Random(3)
    draws = [rng.gauss(0.0, 1.0) * heavy_factor(rng) for _ in range(20000)]
    iqr = statistics.quantiles(draws, n=4)
    assert 0.6 < iqr[2] - iqr[0] < 1.35  # a normal's is 1.35; t3 scaled to variance 1: ~0.92
    assert sum(abs(d) > 4 for d in draws) > 20  # a normal: ~1 in 20000


def test_members_draw_their_latencies() -> None:
    """A member's cold start and grace go into its simulation parameters."""
    m = next(m for m in members(20) if m.latencies != "300/60")
    assert m.params != SimParams()
    assert m.params.engine_start_s == float(m.latencies.split("/")[0])
