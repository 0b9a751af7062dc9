"""Dates on the command line as sacct takes them, read in the site's timezone.

Researchers and admins already type `sacct -S now-1day` or `-S 2026-12-01`; `jobs --since` and
`report --since/--until` take the same words so a habit carries over:

- `now`, `now-90` (seconds), `now-1day`, `now+2hours` (seconds, minutes, hours, days, weeks;
  singular or plural, as Slurm's parse_time reads them);
- `today`, `yesterday`, `tomorrow` (local midnight; `yesterday` is ours, Slurm has no word for it);
- `midnight`, `noon`, `elevenses` (11:00), `fika` (15:00), `teatime` (16:00), `HH:MM[:SS]`:
  that time today;
- `YYYY-MM-DD` (local midnight) and ISO datetimes (`2026-12-01T08:00[:00]`, naive = local,
  or with `Z` / an offset).

Pure: `now` is handed in, so every form is unit-tested against a fixed clock.
"""

from __future__ import annotations

import re
from datetime import date, datetime, time, timedelta
from zoneinfo import ZoneInfo

from slurm_idle.errors import ConfigError

#: Slurm's units for `now{+|-}COUNT[UNIT]` (src/common/parse_time.c), in seconds.
UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}
#: Slurm's words for an hour of today.
HOURS = {"midnight": 0, "noon": 12, "elevenses": 11, "fika": 15, "teatime": 16}
#: Our words for a day's midnight, as days from today.
DAYS = {"today": 0, "yesterday": -1, "tomorrow": 1}

_RELATIVE = re.compile(r"now\s*(?:([+-])\s*(\d+)\s*([a-z]*))?$")
_CLOCK = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?$")

FORMS = ("now-1day, now-2hours, today, yesterday, noon, 08:00, 2026-12-01 or "
         "2026-12-01T08:00[:00][Z]")


def parse_when(text: str, tz: str, now: float) -> float:
    """One of the forms above -> unix time (ConfigError, exit 2, naming the forms otherwise)."""
    value = text.strip().lower()
    zone = ZoneInfo(tz)
    today = datetime.fromtimestamp(now, zone).date()
    if match := _RELATIVE.match(value):
        return now + _delta(match, text)
    if value in DAYS:
        return _local(today + timedelta(days=DAYS[value]), time(0), zone)
    if value in HOURS:
        return _local(today, time(HOURS[value]), zone)
    if match := _CLOCK.match(value):
        hour, minute, second = (int(g or 0) for g in match.groups())
        if hour > 23 or minute > 59 or second > 59:
            raise _bad(text)
        return _local(today, time(hour, minute, second), zone)
    return _iso(text.strip(), zone)


def _delta(match: re.Match[str], text: str) -> float:
    sign, count, unit = match.groups()
    if sign is None:
        return 0.0
    seconds = 1 if not unit else UNITS.get(unit.removesuffix("s"))
    if seconds is None:
        raise ConfigError(f"bad date {text!r}: unknown unit {unit!r} (use seconds, minutes, "
                          "hours, days or weeks, as sacct does)")
    return (1 if sign == "+" else -1) * int(count) * float(seconds)


def _iso(value: str, zone: ZoneInfo) -> float:
    try:
        if len(value) == 10:
            return _local(date.fromisoformat(value), time(0), zone)
        moment = datetime.fromisoformat(value.replace(" ", "T", 1))
    except ValueError:
        raise _bad(value) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=zone)
    return moment.timestamp()


def _local(day: date, clock: time, zone: ZoneInfo) -> float:
    return datetime.combine(day, clock, zone).timestamp()


def _bad(text: str) -> ConfigError:
    return ConfigError(f"bad date {text!r}: use {FORMS}")
