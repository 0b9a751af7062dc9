"""Time buckets for reports: local days (DST-safe) and hours, and how an interval spreads over them.

Buckets are sorted, contiguous `(start, end)` pairs of unix seconds clipped to the period.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

HOUR = 3600.0

Bounds = Sequence[tuple[float, float]]


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def bucket_of(ts: float, bounds: Bounds) -> int | None:
    """Index of the [start, end) bucket holding ts (buckets sorted, contiguous)."""
    i = bisect_right(bounds, (ts, math.inf)) - 1
    return i if 0 <= i < len(bounds) and bounds[i][0] <= ts < bounds[i][1] else None


def overlaps(lo: float, hi: float, bounds: Bounds) -> Iterator[tuple[int, float]]:
    """(index, seconds) of every bucket that [lo, hi) overlaps."""
    if hi <= lo:
        return
    i = max(0, bisect_right(bounds, (lo, math.inf)) - 1)
    while i < len(bounds) and bounds[i][0] < hi:
        seconds = overlap(lo, hi, *bounds[i])
        if seconds > 0:
            yield i, seconds
        i += 1


def day_bounds(since: float, until: float, tz: ZoneInfo) -> list[tuple[float, float]]:
    """[start, end) of every local day touching the period, clipped to it (DST-safe)."""
    bounds: list[tuple[float, float]] = []
    day = datetime.fromtimestamp(since, tz).date()
    while True:
        d0 = datetime.combine(day, datetime.min.time(), tz).timestamp()
        d1 = datetime.combine(day + timedelta(days=1), datetime.min.time(), tz).timestamp()
        lo, hi = max(d0, since), min(d1, until)
        if lo >= until:
            break
        if hi > lo:
            bounds.append((lo, hi))
        day += timedelta(days=1)
    return bounds


def hour_bounds(since: float, until: float) -> list[tuple[float, float]]:
    start = math.floor(since / HOUR) * HOUR
    bounds = []
    h = start
    while h < until:
        bounds.append((h, h + HOUR))
        h += HOUR
    return bounds
