"""Command-line dates (when.py): sacct's forms, `yesterday`, ISO, in the site's timezone."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from slurm_idle.errors import ConfigError
from slurm_idle.when import parse_when

#: 2026-12-07 17:30 UTC = 18:30 in Paris.
NOW = datetime(2026, 12, 7, 17, 30, tzinfo=UTC).timestamp()


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()  # type: ignore[misc]


def test_date_only_is_local_midnight_of_the_timezone() -> None:
    """2026-12-01 in Europe/Paris is 2026-11-30T23:00Z."""
    assert parse_when("2026-12-01", "Europe/Paris", NOW) == utc(2026, 11, 30, 23)


def test_iso_datetime_with_and_without_offset() -> None:
    """An explicit Z wins over the timezone; a naive datetime is in the timezone."""
    assert parse_when("2026-12-01T08:00:00Z", "Europe/Paris", NOW) == utc(2026, 12, 1, 8)
    assert parse_when("2026-12-01T08:00", "Europe/Paris", NOW) == utc(2026, 12, 1, 7)
    assert parse_when("2026-12-01 08:00", "UTC", NOW) == utc(2026, 12, 1, 8)


@pytest.mark.parametrize(("text", "seconds"), [
    ("now", 0), ("NOW", 0), ("now-90", -90), ("now+30", 30), ("now-1day", -86400),
    ("now-2days", -2 * 86400), ("now-1hour", -3600), ("now - 3 hours", -3 * 3600),
    ("now-15minutes", -900), ("now-1minute", -60), ("now-1week", -7 * 86400),
    ("now-10seconds", -10), ("now+2weeks", 14 * 86400),
])
def test_now_with_a_count_of_slurms_units(text: str, seconds: float) -> None:
    assert parse_when(text, "Europe/Paris", NOW) == NOW + seconds


@pytest.mark.parametrize(("text", "expected"), [
    ("today", utc(2026, 12, 6, 23)),  # Paris midnight of the 7th
    ("yesterday", utc(2026, 12, 5, 23)),
    ("tomorrow", utc(2026, 12, 7, 23)),
    ("midnight", utc(2026, 12, 6, 23)),
    ("noon", utc(2026, 12, 7, 11)),
    ("elevenses", utc(2026, 12, 7, 10)),
    ("fika", utc(2026, 12, 7, 14)),
    ("teatime", utc(2026, 12, 7, 15)),
    ("08:00", utc(2026, 12, 7, 7)),
    ("8:05:30", utc(2026, 12, 7, 7, 5, 30)),
])
def test_words_and_clock_times_are_of_the_local_day(text: str, expected: float) -> None:
    assert parse_when(text, "Europe/Paris", NOW) == expected


def test_the_local_day_is_the_timezones_not_utcs() -> None:
    """At 23:30 UTC it is already tomorrow in Tokyo: `today` is Tokyo's day."""
    late = utc(2026, 12, 7, 23, 30)
    assert parse_when("today", "Asia/Tokyo", late) == utc(2026, 12, 7, 15)
    assert parse_when("today", "UTC", late) == utc(2026, 12, 7)


@pytest.mark.parametrize("text", ["last tuesday", "now-1fortnight", "25:00", "now-",
                                  "2026-13-01", "12:61"])
def test_bad_dates_are_clear_config_errors(text: str) -> None:
    """A date in no known form says which forms are accepted (exit 2)."""
    with pytest.raises(ConfigError, match="bad date"):
        parse_when(text, "UTC", NOW)
