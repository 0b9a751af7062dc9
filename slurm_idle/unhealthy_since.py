"""Since when each replica meant to serve has been seen unhealthy, kept from tick to tick.

How long an engine has been down is what tells a blip from an outage, and a one-shot `status`
cannot know it. The agent sees every replica at each tick (every minute under cron), so each
tick records, in a small JSON file beside the journal, the replicas it saw unhealthy and the
time it first saw each; `status` reads it and says `unhealthy: ... since 12:01`. The file is
rewritten only when that set changes, atomically and never through a symlink (safefiles); a
file that cannot be read or written costs the `since`, never the tick.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path

from slurm_idle import safefiles
from slurm_idle.logs import get_logger

log = get_logger(__name__)

FILE_NAME = "unhealthy-since.json"


def since_path(journal: str) -> Path:
    """The file beside the journal (the agent's own directory)."""
    return Path(journal).parent / FILE_NAME


def read(path: Path) -> dict[str, float]:
    """Replica name -> unix time a tick first saw it unhealthy; {} when missing or unreadable
    (an admin's `status` may not read the agent's directory: no `since` then, nothing else)."""
    try:
        text = safefiles.read_text(path)
        doc = json.loads(text) if text else {}
    except (OSError, ValueError, safefiles.UnsafePath):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {str(k): float(v) for k, v in doc.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def remember(path: Path, unhealthy: Iterable[str], now: float) -> dict[str, float]:
    """Record this tick's unhealthy replicas: each keeps the time it was first seen, a new one
    gets `now`, one seen healthy again is dropped. Returns the new map."""
    before = read(path)
    after = {name: before.get(name, now) for name in sorted(set(unhealthy))}
    if after != before:
        try:
            safefiles.atomic_write(path, json.dumps(after, sort_keys=True) + "\n", mode=0o644)
        except (OSError, safefiles.UnsafePath) as exc:
            log.warning("cannot record unhealthy replicas in %s: %s", path, exc)
    return after


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clock_time(iso_time: str, now: float) -> str:
    """`12:01` (UTC, as `explain` writes times), or `Dec 05 12:01` when not today."""
    when = datetime.fromisoformat(iso_time)
    today = datetime.fromtimestamp(now, UTC).date()
    return when.strftime("%H:%M" if when.date() == today else "%b %d %H:%M")


def annotate(rows: Iterable[dict[str, object]], since: Mapping[str, float]) -> None:
    """Each row gets `unhealthy_since` (`status --json`): the UTC time a tick first saw it
    unhealthy, None when it is healthy, not meant to serve, or no tick has seen it so yet."""
    for row in rows:
        ts = since.get(str(row.get("name"))) if row.get("health_reason") else None
        row["unhealthy_since"] = iso(ts) if ts is not None else None
