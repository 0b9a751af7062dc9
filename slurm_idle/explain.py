"""What `explain` shows of the journal: its events in the order they happened, and whether
they still describe the pool as it is now.

Records are appended when a step's outcome is known, so a router call made inside a step can
be written before the transition that began earlier; an admin reads a story, so the events
are sorted by their timestamps. A journal outlives the pool it describes (a sandbox or a
cluster restarted with the same journal path): a node whose phase now is not the one its
last records leave it in is named, so old lines are not read as today's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from slurm_idle.journal import AdminRecord, RouterRecord, StepOutcome, TransitionRecord

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
