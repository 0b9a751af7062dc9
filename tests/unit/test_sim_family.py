"""The benchmark family: deterministic by seed, wide ranges, split fixed by seed."""

from __future__ import annotations

from slurm_idle.sim.family import HELD_OUT, TUNING, member, members, split_of, trace
from slurm_idle.sim.family_bench import goals, run, stats


def test_members_are_deterministic_and_split_by_seed() -> None:
    """The same seed gives the same member and trace; odd seeds are held out, even ones tune."""
    assert member(5) == member(5)
    assert trace(member(5)).series == trace(member(5)).series
    assert split_of(1) == HELD_OUT and split_of(2) == TUNING
    assert [m.split for m in members(4)] == [HELD_OUT, TUNING, HELD_OUT, TUNING]


def test_ranges_are_wide() -> None:
    """Over 60 members: 1-14 days, 1-3 models, noise within 1-10%, some with 10-minute steps."""
    ms = members(60)
    assert {m.days for m in ms} <= set(range(1, 15)) and min(m.days for m in ms) <= 3
    assert max(m.days for m in ms) >= 12
    assert {len(m.fleet) for m in ms} == {1, 2, 3}
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
