"""The scrape source's kept history: a window counts only when its readings cover it."""

from __future__ import annotations

import pytest

from slurm_idle.metrics.history import Reading, covered, recent_min, tick_spacing, trend, window

M = "m"
NOW = 10_000.0


def ticks(offsets: list[float], demand: float = 100.0, unknown: tuple[float, ...] = ()) -> list[Reading]:
    """Readings at NOW + each offset; those in `unknown` are unknown (None, None)."""
    return [(NOW + dt, M, None, None) if dt in unknown else (NOW + dt, M, demand, 0.0) for dt in offsets]


def every_minute(span_s: int) -> list[float]:
    return [-float(k) for k in range(span_s, -1, -60)]


def test_a_full_window_of_minute_ticks_is_covered() -> None:
    """A reading every minute from before the window's start to now covers it."""
    history = ticks(every_minute(600))
    assert tick_spacing(history, M, NOW) == 60.0
    assert covered(history, M, NOW, 300, 120)
    assert window(history, M, NOW, 300, 120) == (100.0, 0.0, 0.0)


def test_a_gap_inside_the_window_is_not_covered() -> None:
    """Old readings around the window's start and one now are not a window: 4 minutes of it
    were never seen (the oldest reading alone being old enough is not enough)."""
    history = ticks([-310.0, -300.0, -250.0, 0.0])
    assert not covered(history, M, NOW, 300, 120)
    assert window(history, M, NOW, 300, 120) == (None, None, None)


def test_coverage_needs_ninety_percent_of_the_ticks() -> None:
    """One missed tick of 5 (300 s) is too many; one of 15 (900 s) is fine, as Prometheus'
    count_over_time check allows."""
    short = ticks([t for t in every_minute(600) if t != -120.0])
    assert not covered(short, M, NOW, 300, 120)
    long = ticks([t for t in every_minute(1200) if t != -420.0])
    assert covered(long, M, NOW, 900, 120)


def test_unknown_readings_count_as_missing() -> None:
    """Unknown ticks (an outage) are holes: two of 15 fall below 90%, and a run of them longer
    than the staleness limit breaks the window however long it is."""
    base = every_minute(1200)
    assert covered(ticks(base, unknown=(-420.0,)), M, NOW, 900, 120)
    assert not covered(ticks(base, unknown=(-420.0, -600.0)), M, NOW, 900, 120)
    run = ticks(every_minute(3600), unknown=(-1200.0, -1260.0))  # 3 minutes without a reading
    assert covered(run, M, NOW, 900, 120)  # the run is older than this window
    assert not covered(run, M, NOW, 1800, 120)  # 28 of 30 ticks, but a hole of 180 s


def test_unknown_readings_do_not_enter_the_extremes() -> None:
    """The window's max and min come from known readings only."""
    history = ticks(every_minute(1200), unknown=(-420.0,))
    history.append((NOW - 360.0, M, 500.0, 3.0))
    history.sort()
    assert window(history, M, NOW, 900, 120) == (500.0, 3.0, 0.0)


def test_the_last_reading_must_be_recent() -> None:
    """A window whose latest known reading is older than the staleness limit is not covered."""
    history = ticks(every_minute(600), unknown=(0.0, -60.0, -120.0))
    assert not covered(history, M, NOW, 300, 120)


@pytest.mark.parametrize(
    ("unknown", "expected"),
    [((), 0.0), ((-60.0,), 0.0), ((-60.0, -120.0), None)],
)
def test_recent_min_skips_unknown_readings_within_the_gap_limit(
    unknown: tuple[float, ...], expected: float | None
) -> None:
    """The queue's recent minimum reads known readings; unknown ones longer than the staleness
    limit make it unknown."""
    assert recent_min(ticks(every_minute(300), unknown=unknown), M, NOW, 120, 120) == expected


def test_trend_ignores_unknown_readings() -> None:
    """deriv over known readings only: unknown ones are not zeros."""
    history: list[Reading] = [(NOW - 240.0 + 60 * k, M, 100.0 * k, 0.0) for k in range(5)]
    history.insert(2, (NOW - 150.0, M, None, None))
    assert trend(history, M, NOW, 300) == pytest.approx(100.0 / 60.0)
