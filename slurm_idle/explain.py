"""What `explain` shows of the journal: its newest events, read from the journal's end, in
the order they happened, and whether they still describe the pool as it is now.

Records are appended when a step's outcome is known, so a router call made inside a step can
be written before the transition that began earlier; an admin reads a story, so the events
are sorted by their timestamps. A journal outlives the pool it describes (a sandbox or a
cluster restarted with the same journal path): a node whose phase now is not the one its
last records leave it in is named, so old lines are not read as today's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from slurm_idle.journal import (
    AdminRecord,
    Journal,
    PhasesRecord,
    RouterRecord,
    StepOutcome,
    TickRecord,
    TransitionRecord,
    parse_record,
)
from slurm_idle.journal_files import LAG_S, quoted

Event = TransitionRecord | RouterRecord | AdminRecord


def in_event_order(records: Iterable[Event]) -> list[Event]:
    """The records sorted by timestamp; records of the same instant keep the journal's order."""
    return sorted(records, key=lambda r: r.ts)


def _nodes_of(record: Event) -> tuple[str, ...]:
    if isinstance(record, TransitionRecord) and record.nodes:
        return record.nodes
    return (record.node,)


def _phases_left(record: Event) -> tuple[frozenset[str], str] | None:
    """The phases the node may be in after `record` and the one to name (None: the record
    says nothing of the phase).

    A step that did not complete leaves the node in its old phase or, carried on by the next
    tick, already in the new one: either agrees with the journal."""
    if isinstance(record, AdminRecord):
        return frozenset({record.phase}), record.phase
    if isinstance(record, TransitionRecord):
        if record.outcome == StepOutcome.OK:
            return frozenset({record.to_phase}), record.to_phase
        return frozenset({record.from_phase, record.to_phase}), record.to_phase
    return None


@dataclass(frozen=True)
class StaleNode:
    """A node whose journal ends before its current state began."""

    node: str
    last_record_ts: float
    journal_phase: str  # where its last phase-bearing record left it
    phase: str  # its phase now, as `status` shows it

    def line(self) -> str:
        hhmm = datetime.fromtimestamp(self.last_record_ts, UTC).strftime("%H:%M")
        return (f"journal predates the current state of {self.node} "
                f"(last record {hhmm}, node now {self.phase})")

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "last_record_ts": round(self.last_record_ts, 3),
                "journal_phase": self.journal_phase, "phase": self.phase}


def stale_nodes(records: Sequence[Event], phases: Mapping[str, str]) -> list[StaleNode]:
    """The nodes of `phases` (node -> its phase now) whose last phase-bearing record in
    `records` (in event order) leaves them in another phase, in node order of `phases`."""
    last_ts: dict[str, float] = {}
    left: dict[str, tuple[frozenset[str], str]] = {}
    for record in records:
        said = _phases_left(record)
        for node in _nodes_of(record):
            last_ts[node] = max(last_ts.get(node, record.ts), record.ts)
            if said is not None:
                left[node] = said
    out = []
    for node, phase in phases.items():
        if node in left and phase not in left[node][0]:
            out.append(StaleNode(node, last_ts[node], left[node][1], phase))
    return out


# --- reading only what is shown ---------------------------------------------------------------

#: Lines that may hold an event explain shows (a cheap test before a line is parsed).
EVENT_NEEDLES = (b'"transition"', b'"router"', b'"admin"')


@dataclass(frozen=True)
class Recent:
    """The newest events explain shows, in event order, and the newest tick record."""

    events: list[Event]
    last_tick: TickRecord | None


def read_recent(journal: Journal, wanted: Callable[[Event], bool], last: int) -> Recent:
    """The `last` newest events `wanted` keeps, read from the journal's end: memory and time
    follow what is shown, not the history's length. Records are written up to LAG_S out of
    time order, so the reading goes on LAG_S past the last-th newest before it stops."""
    tick = None
    for rec in journal.newest_first((b'"tick"',)):
        parsed = parse_record(rec)
        if isinstance(parsed, TickRecord):
            tick = parsed
            break
    events: list[Event] = []
    cutoff: float | None = None
    for rec in journal.newest_first(EVENT_NEEDLES):
        parsed = parse_record(rec)
        if not isinstance(parsed, TransitionRecord | RouterRecord | AdminRecord):
            continue
        if cutoff is not None and parsed.ts < cutoff:
            break
        if not wanted(parsed):
            continue
        events.append(parsed)
        if len(events) >= last:
            cutoff = sorted(e.ts for e in events)[-last] - LAG_S
    # Read newest first: reversed, records of one instant keep the journal's order.
    return Recent(in_event_order(reversed(events))[-last:], tick)


def stale_in_history(journal: Journal, shown: Sequence[Event],
                     phases: Mapping[str, str]) -> list[StaleNode]:
    """stale_nodes of `phases`, the nodes the shown events leave without a phase looked up
    further back: every event naming one of them, newest first, until its newest phase-bearing
    record or the day's phases record (journal_snapshots.py) is found, or the history ends."""
    said = {n for r in shown if _phases_left(r) is not None for n in _nodes_of(r)}
    missing = set(phases) - said
    found: list[Event] = []
    snapshot: dict[str, tuple[float, str]] = {}  # node -> (when, phase) of a phases record
    if missing:
        for rec in journal.newest_first(quoted(missing)):  # lines naming one of them
            parsed = parse_record(rec)
            if isinstance(parsed, PhasesRecord):
                for node in missing & parsed.nodes.keys():
                    snapshot[node] = (parsed.ts, parsed.nodes[node])
                missing -= parsed.nodes.keys()
            elif isinstance(parsed, TransitionRecord | RouterRecord | AdminRecord):
                named = missing & set(_nodes_of(parsed))
                if named:
                    found.append(parsed)
                    if _phases_left(parsed) is not None:
                        missing -= named
            if not missing:
                break
    stale = {n.node: n for n in stale_nodes(in_event_order([*reversed(found), *shown]), phases)}
    for node, (ts, phase) in snapshot.items():
        if phases[node] != phase:
            last = max([ts, *(r.ts for r in found if node in _nodes_of(r))])
            stale[node] = StaleNode(node, last, phase, phases[node])
    return [stale[n] for n in phases if n in stale]
