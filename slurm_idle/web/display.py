"""How the web view shows a time and a log line to a person. Pure.

Every time on a page is in the site's timezone (policy.timezone): "18:30" on the day the page
was made, "Tue 8 Dec 18:30" on any other, so a reader never converts UTC or epoch seconds in
their head. Log lines keep their text; only a `t=<epoch seconds>` stamp (the runner's
`slurm-idle-run: ... t=...` lines, the demo job's) is shown as such a time, the raw stamp kept
as the element's title. The log file itself is never changed: this is display only.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import NamedTuple
from zoneinfo import ZoneInfo

# `t=` then 10 digits (2001-09-09 .. 2286: any real clock), optional fraction; not part of a
# longer word (`at=`, `t=...s`) or number. A counter with other digits is left alone.
STAMP = re.compile(r"(?<![\w.])t=(\d{10}(?:\.\d+)?)(?!\w|\.\d)")


class Piece(NamedTuple):
    """A run of a log line: plain text, or a stamp (`iso` and `raw` set) shown as `text`."""

    text: str
    iso: str | None = None
    raw: str | None = None


def _moment(value: str | float, tz: str) -> datetime:
    zone = ZoneInfo(tz)
    if isinstance(value, str):
        return datetime.fromisoformat(value).astimezone(zone)
    return datetime.fromtimestamp(value, zone)


def human_time(value: str | float | None, tz: str, now: str | float | None = None,
               seconds: bool = False) -> str:
    """`value` (ISO 8601 or unix seconds) in `tz`: "18:30" when on the same local day as `now`,
    else "Tue 8 Dec 18:30"; "-" when unknown."""
    if value is None or value == "":
        return "-"
    at = _moment(value, tz)
    clock = at.strftime("%H:%M:%S" if seconds else "%H:%M")
    if now is not None and now != "" and _moment(now, tz).date() == at.date():
        return clock
    return f"{at:%a} {at.day} {at:%b} {clock}"


def zone_name(tz: str, now: str | float | None) -> str:
    """"Europe/Berlin (CET)": the zone and its abbreviation at `now` ("UTC" alone for UTC)."""
    if now is None or now == "":
        return tz
    abbrev = _moment(now, tz).tzname() or tz
    return tz if abbrev == tz else f"{tz} ({abbrev})"


def log_pieces(line: str, tz: str, now: str | float | None = None) -> list[Piece]:
    """A log line split into text and `t=<epoch>` stamps, each stamp shown as a local time."""
    out: list[Piece] = []
    pos = 0
    for m in STAMP.finditer(line):
        if m.start() > pos:
            out.append(Piece(line[pos:m.start()]))
        t = float(m.group(1))
        out.append(Piece("t=" + human_time(t, tz, now, seconds=True),
                         iso=_moment(t, tz).isoformat(timespec="seconds"), raw=m.group(0)))
        pos = m.end()
    if pos < len(line) or not out:
        out.append(Piece(line[pos:]))
    return out


def shown_log(line: str, tz: str, now: str | float | None = None) -> str:
    """The line as the page shows it, as text (tests, and anything that wants it flat)."""
    return "".join(p.text for p in log_pieces(line, tz, now))


def age(seconds: float | None) -> str:
    """A duration as a person says it: "40 s", "12 min", "3.5 h"; "-" when unknown."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
