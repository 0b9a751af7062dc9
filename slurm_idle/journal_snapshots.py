"""Every pool node's phase, journaled once a UTC day, so no reader reads back years.

A node that never changes phase (a replica the floor always keeps serving) has no step in the
journal for months: `report` and the web view, which need every node's phase at the start of
their period, and `explain`, which checks a node's last phase against Slurm, would read the
whole history to learn it has none. After the first tick of each UTC day the agent appends one
`phases` record (journal.PhasesRecord) naming every node's phase; reading backward, whichever
comes first, a node's last step or such a record, answers. The day of the last one is kept in
`<journal>.phases-day` beside the journal (cron ticks are separate processes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from slurm_idle import safefiles
from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import Journal, PhasesRecord

log = logging.getLogger("slurm_idle.journal_snapshots")

DAY_S = 86400


def day_path(journal: Journal) -> Path:
    return journal.path.with_name(journal.path.name + ".phases-day")


def snapshot_if_new_day(journal: Journal, phases: Mapping[str, str], now: float) -> bool:
    """Append the phases of `phases` (node -> phase) if none was appended this UTC day; True if
    one was. A failed write is logged, and tried again at the next tick."""
    day = int(now // DAY_S)
    path = day_path(journal)
    try:
        last = int((safefiles.read_text(path) or "").strip() or -1)
    except (OSError, ValueError):
        last = -1
    if last == day or not phases:
        return False
    journal.record(PhasesRecord(ts=now, nodes=dict(phases)))
    try:
        safefiles.atomic_write(path, f"{day}\n")
    except (OSError, SlurmIdleError) as exc:
        log.error("cannot write %s (%s): the next tick journals the phases again", path, exc)
    return True
