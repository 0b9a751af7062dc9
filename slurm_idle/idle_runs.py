"""Idle minutes that do not pile up: a run of identical idle ticks is one journal record.

An agent ticks every minute for years and most ticks change nothing: one record each was half
a million lines a year. A tick that acted on nothing, failed in nothing and left every count
as the tick before it extends the current run instead: the run is kept in a side file beside
the journal (`<journal>.idle-run`, rewritten in place, read by every reader as the newest
record) and appended to the journal as one tick record with `count` and `until` when a tick
differs, the UTC hour turns, or the ticks stopped for more than two cadences. Capping a run at
its hour keeps the journal in time order within an hour and report's tick counts exact for
any period cut at an hour (TickRecord.ticks_in spreads a run's ticks evenly otherwise).
Transitions, errors and actions are journaled as before, each tick its own record.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

from slurm_idle import safefiles
from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import Journal, TickRecord, iso

log = logging.getLogger("slurm_idle.idle_runs")

HOUR_S = 3600
TAIL = 1 << 16


def idle(tick: TickRecord) -> bool:
    """A tick that may join a run: nothing done, nothing failed."""
    return not (tick.actions or tick.errors or tick.error)


def continues(run: TickRecord, tick: TickRecord, cadence_s: float) -> bool:
    """Does idle `tick` extend `run`: the same counts and mode, in the same UTC hour, and no
    gap longer than two cadences (an agent stopped in between starts a new run)?"""
    return (idle(tick) and idle(run) and tick.dry_run == run.dry_run
            and tick.phases == run.phases and tick.needed == run.needed
            and tick.serving == run.serving
            and int(tick.ts // HOUR_S) == int(run.ts // HOUR_S)
            and 0 <= tick.ts - run.last_ts <= 2 * cadence_s + 1)


def extend(run: TickRecord, tick: TickRecord) -> TickRecord:
    """The run with `tick` as its last tick (the longest tick's duration kept)."""
    return replace(run, count=run.count + tick.count, until=tick.last_ts,
                   duration_s=max(run.duration_s, tick.duration_s))


def record_tick(journal: Journal, tick: TickRecord, cadence_s: float) -> None:
    """Journal one tick: into the idle run it continues, or after the run it ends.

    Never raises for a write that failed (a full disk): like Journal.record, the tick's
    actions happened and the agent goes on; the error is logged."""
    pending = journal.pending_run()
    run = TickRecord.from_json(pending) if pending is not None else None
    if run is not None and _already_appended(journal, run):
        run = None  # a tick died between appending the run and replacing the side file
    if run is not None and continues(run, tick, cadence_s):
        _write_pending(journal, extend(run, tick))
        return
    if run is not None:
        journal.record(run)
    if idle(tick):
        _write_pending(journal, tick)
        return
    _drop_pending(journal, had=pending is not None)
    journal.record(tick)


def _already_appended(journal: Journal, run: TickRecord) -> bool:
    """Is the run in the live journal already? A tick that died between appending it and
    replacing the side file must not count the run twice, nor extend it; the next tick may
    have journaled its steps since, so the run is looked for among the file's last 64 KiB."""
    try:
        with journal.path.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - TAIL))
            tail = fh.read()
    except OSError:
        return False
    from slurm_idle import journal_files

    want = json.loads(json.dumps(_with_time(run).to_json()))
    stamp = {"epoch", "instance"} if journal.stamp is not None else set()  # leadership.stamp

    def same(line: bytes) -> bool:
        got = journal_files.parse(line)
        return isinstance(got, dict) and {k: v for k, v in got.items() if k not in stamp} == want

    return any(same(line) for line in tail.split(b"\n") if b'"tick"' in line)


def _with_time(run: TickRecord) -> TickRecord:
    """The run as the journal holds it (Journal.append adds `time` from `ts`)."""
    return run if run.time is not None else replace(run, time=iso(run.ts))


def _write_pending(journal: Journal, run: TickRecord) -> None:
    try:
        safefiles.atomic_write(journal.pending_path, json.dumps(_with_time(run).to_json()) + "\n")
    except (OSError, SlurmIdleError) as exc:
        log.error("cannot write the idle run %s (%s): this tick is journaled alone",
                  journal.pending_path, exc)
        journal.record(run)


def _drop_pending(journal: Journal, had: bool) -> None:
    if not had:
        return
    try:
        journal.pending_path.unlink(missing_ok=True)
    except OSError as exc:
        log.error("cannot remove the idle run %s: %s", journal.pending_path, exc)
