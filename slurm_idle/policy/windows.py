"""Lending windows: the hours (in the policy's time zone) during which nodes may be lent.

`"20:00-08:00"` wraps over midnight. No windows configured means lending is always allowed.
Outside every window lent nodes are brought back, so jobs can rely on the window's end.
"""

from __future__ import annotations

import re
from datetime import datetime
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from slurm_idle.errors import ConfigError

_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


def parse_window(text: str) -> tuple[int, int]:
    """`"HH:MM-HH:MM"` as (start, end) minutes of the day; ConfigError when malformed."""
    match = _WINDOW.match(text)
    if not match:
        raise ConfigError(f"lending window {text!r} is not HH:MM-HH:MM (e.g. \"20:00-08:00\")")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    if h1 > 24 or h2 > 24 or m1 > 59 or m2 > 59 or h1 * 60 + m1 > 1440 or h2 * 60 + m2 > 1440:
        raise ConfigError(f"lending window {text!r} has an hour or minute out of range")
    return h1 * 60 + m1, h2 * 60 + m2


@lru_cache(maxsize=16)
def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"policy.timezone {name!r} is not a known time zone (e.g. Europe/Paris)") from None


def minute_of_day(now: float, timezone: str) -> int:
    """Minutes since local midnight in `timezone` at unix time `now`."""
    local = datetime.fromtimestamp(now, _zone(timezone))
    return local.hour * 60 + local.minute


def in_windows(now: float, windows: tuple[str, ...], timezone: str) -> bool:
    """True when `now` falls inside one of `windows` (always True without windows)."""
    if not windows:
        return True
    minute = minute_of_day(now, timezone)
    for text in windows:
        start, end = parse_window(text)
        if start == end:
            return True  # "00:00-24:00" or "08:00-08:00": the whole day
        if start < end:
            if start <= minute < end:
                return True
        elif minute >= start or minute < end:
            return True
    return False
