"""The scrape source's short per-model history, and what may be read from it.

Each tick of the scrape source appends one reading per model: (t, model, demand tokens/s,
waiting), or (t, model, None, None) when that tick's reading is unknown (no replica of the
model answered, or a replica that was busy at its last answer went dark, so the sum would
under-report). Unknown readings are kept, not dropped, so that an outage stays visible as a
hole in the window instead of vanishing between the readings around it.

A window's extremes count only when the history covers it, as the Prometheus source demands
with `count_over_time`: known readings at >= WINDOW_COVERAGE of the ticks expected over the
window (at the history's own tick spacing, the scrape interval of this source), and no stretch
longer than the staleness limit without one (from the window's start to now). Without that,
"load stayed low for the whole window" is not known, and the planner lends nothing.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from itertools import pairwise

from slurm_idle.metrics.forecast import NOISE_LAG_S, NOISE_SPAN_S, noise_from_changes, slope_per_s

#: A window counts as covered when data exists at this share of its expected points (a scrape
#: missed here and there is fine; 2 minutes of history for a 15-minute window is not). Both
#: sources use it: the Prometheus one on its subqueries' `count_over_time`.
WINDOW_COVERAGE = 0.9

#: (t, model, demand tokens/s or None, waiting or None); None: unknown at that tick.
Reading = tuple[float, str, float | None, float | None]


def _known(history: Sequence[Reading], model: str, now: float) -> list[tuple[float, float, float]]:
    return sorted(
        (t, d, w)
        for t, m, d, w in history
        if m == model and t <= now and d is not None and w is not None
    )


def tick_spacing(history: Sequence[Reading], model: str, now: float) -> float | None:
    """Median time between the model's readings, known or not (the ticks' cadence)."""
    times = sorted({t for t, m, _, _ in history if m == model and t <= now})
    gaps = [b - a for a, b in pairwise(times)]
    return statistics.median(gaps) if gaps else None


def covered(
    history: Sequence[Reading], model: str, now: float, span_s: float, max_gap_s: float
) -> bool:
    """Whether the known readings cover [now - span_s, now] (see the module doc)."""
    start = now - span_s
    known = [t for t, _, _ in _known(history, model, now)]
    if span_s <= 0:
        return bool(known) and known[-1] >= now
    inside = [t for t in known if t > start]  # (start, now], as a PromQL range
    if not inside:
        return False
    before = [t for t in known if t <= start]
    edges = [before[-1] if before else start, *inside, now]
    if any(b - a > max_gap_s for a, b in pairwise(edges)):
        return False
    spacing = tick_spacing(history, model, now)
    return spacing is not None and spacing > 0 and len(inside) >= WINDOW_COVERAGE * (span_s / spacing)


def window(
    history: Sequence[Reading], model: str, now: float, window_s: float, max_gap_s: float
) -> tuple[float | None, float | None, float | None]:
    """(max demand, max waiting, min waiting) over the window, or Nones unless it is covered."""
    if not covered(history, model, now, window_s, max_gap_s):
        return (None, None, None)
    inside = [(d, w) for t, d, w in _known(history, model, now) if t > now - window_s or t >= now]
    return (max(d for d, _ in inside), max(w for _, w in inside), min(w for _, w in inside))


def recent_min(
    history: Sequence[Reading], model: str, now: float, span_s: float, max_gap_s: float
) -> float | None:
    """Min of the model's queue over [now - span_s, now]: the known readings inside and the last
    one at or before the span's start (the queue it began with). None without such a reading or
    when two consecutive known readings are more than max_gap_s apart (ticks missed or unknown:
    nothing known between)."""
    points = [(t, w) for t, _, w in _known(history, model, now)]
    start = now - span_s
    before = [p for p in points if p[0] <= start]
    if not before:
        return None
    span = [before[-1], *(p for p in points if p[0] > start)]
    if any(b[0] - a[0] > max_gap_s for a, b in pairwise(span)):
        return None
    return min(w for _, w in span)


def trend(history: Sequence[Reading], model: str, now: float, window_s: float) -> float | None:
    """Least-squares slope of the known demand over the scale-down window, per second (as PromQL
    `deriv(...[window])`: points in (now - window, now]); None without two points or window."""
    if window_s <= 0:
        return None
    return slope_per_s([(t, d) for t, d, _ in _known(history, model, now) if now - window_s < t])


def window_mean(
    history: Sequence[Reading], model: str, now: float, window_s: float, max_gap_s: float
) -> float | None:
    """Mean of the known demand over the window (PromQL `avg_over_time`), None unless covered."""
    if window_s <= 0 or not covered(history, model, now, window_s, max_gap_s):
        return None
    inside = [d for t, d, _ in _known(history, model, now) if t > now - window_s]
    return sum(inside) / len(inside) if inside else None


def noise(history: Sequence[Reading], model: str, now: float, max_gap_s: float) -> float | None:
    """forecast.noise_from_changes of the demand's NOISE_LAG_S changes over the last
    NOISE_SPAN_S (each reading against the last one at least the lag before it), None unless
    the history covers span + lag."""
    if not covered(history, model, now, NOISE_SPAN_S + NOISE_LAG_S, max_gap_s):
        return None
    points = [(t, d) for t, d, _ in _known(history, model, now)]
    times = [t for t, _ in points]
    changes = []
    for t, d in points:
        if t <= now - NOISE_SPAN_S:
            continue
        i = bisect.bisect_right(times, t - NOISE_LAG_S) - 1
        if i >= 0 and t - NOISE_LAG_S - times[i] <= max_gap_s:
            changes.append(d - points[i][1])
    return noise_from_changes(changes)
