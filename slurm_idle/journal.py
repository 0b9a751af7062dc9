"""The agent's journal: one JSON object per line, appended, never rewritten.

`explain` and `report` read it back, so its shape is a stable interface, written down once
here as the record dataclasses below: the writers (transitions.StepResult, agent ticks,
eviction, router/sync.py, admin.py, jobdriver.py) build them, `Journal.append` writes their `to_json()`, and
readers get them back from `parse_record` / `Journal.typed()` (a record that is not ours, or
malformed, is skipped there, so every reader skips the same ones).

Over 400 lines on purpose: the records are the journal's one written-down interface (each
dataclass beside its JSON shape below); split apart, a writer and a reader could drift.

  transition (one per phase change the agent attempted, TransitionRecord):
    {"event": "transition", "time": "2026-12-02T10:00:00Z", "ts": 1796205600.0,
     "node": "gpu1", "model": "m", "action": "reclaim", "from": "lent", "to": "reclaiming",
     "reason": "...", "outcome": "ok" | "waiting" | "error" | "stuck" | "skipped",
     "duration_s": 0.12, "error": "..." (error/stuck/skipped), "detail": "..." (why waiting),
     "nodes": ["gpu6", "gpu7"] (a multi-node lend group, keyed by `node`)}
  tick (one per tick that got the lock and acted, failed, or journals empty passes, TickRecord;
  a run of identical idle ticks is one record, idle_runs.py):
    {"event": "tick", "time": ..., "ts": ..., "duration_s": 1.3, "actions": 2, "errors": 0,
     "dry_run": false, "phases": {"serving": 2, "lent": 2}, "needed": {"m": 2},
     "serving": {"m": 2}, "error": "..." (only if the tick itself failed),
     "count": 34, "until": ..., "until_time": ... (a run: its ticks, the last one's start)}
  job (what a reclaim did to one job on the node, eviction.py, JobRecord):
    {"event": "job", "time": ..., "ts": ..., "node": "gpu1", "job_id": 42,
     "kind": "container" | "plain" | "interactive",
     "action": "signalled" | "requeued" | "cancelled" | "error", "detail": "..."}
  foreign_job (what a reclaim did to a job of another partition on the node, e.g. the serve
  partition's, that is not one of our replica jobs, eviction.py, ForeignJobRecord):
    {"event": "foreign_job", "time": ..., "ts": ..., "node": "gpu1", "job_id": 43,
     "kind": "foreign", "action": "signalled" | "requeued" | "cancelled" | "error",
     "detail": "...", "partition": "inference", "user": "alice"}
  router (one call to a model's router, router/sync.py, RouterRecord):
    {"event": "router", "time": ..., "ts": ..., "node": "gpu1", "model": "m",
     "router": "haproxy", "call": "remove" | "add", "reason": "...",
     "replica": "gpu5-1" (only for one of several replicas on the node), "outcome": "ok" | "error",
     "duration_s": 0.01 (ok), "error": "..." (error)}
  admin (an admin's pin or unpin, admin.py, AdminRecord):
    {"event": "admin", "time": ..., "ts": ..., "node": "gpu1", "command": "pin" | "unpin",
     "phase": "serving", "outcome": "ok" | "error", "detail": "..."}
  duplicate-replica-job (two jobs of ours for one replica, the extra ones cancelled,
  jobdriver.py, DuplicateJobRecord):
    {"event": "duplicate-replica-job", "time": ..., "ts": ..., "replica": "m-0", "model": "m",
     "kept": 41, "cancelled": [42], "error": "..." (only if the scancel failed)}
  foreign-replica-job (a job shaped like a replica job that is not the agent's, replicatrust.py:
  ignored as a replica, never cancelled for its slot; journaled once per job, agent.py,
  ForeignReplicaJobRecord):
    {"event": "foreign-replica-job", "time": ..., "ts": ..., "job_id": 77, "user": "mallory",
     "nodes": ["gpu8"], "replica": "m#1", "why": "user mallory is not the agent's (root)"}
  phases (every pool node's phase after the first tick of a UTC day, journal_snapshots.py,
  PhasesRecord):
    {"event": "phases", "time": ..., "ts": ..., "nodes": {"gpu1": "serving", "gpu2": "lent"}}
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from slurm_idle import journal_files, safefiles
from slurm_idle.errors import SlurmIdleError

log = logging.getLogger("slurm_idle.journal")


class JournalWriteError(SlurmIdleError):
    """A record could not be written (disk full, I/O error): the action it records happened."""


def iso(ts: float) -> str:
    """Unix seconds as an ISO-8601 UTC timestamp (second precision)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Journal:
    """Append-only JSON-lines file."""

    path: Path
    # What every record gets besides its own keys (the leader's epoch and instance, leadership.py).
    stamp: Callable[[], Mapping[str, Any]] | None = field(default=None, compare=False)

    def append(self, record: JournalRecord | dict[str, Any]) -> None:
        """Append one record; `time` is derived from `ts` if missing."""
        if not isinstance(record, dict):
            record = record.to_json()
        if self.stamp is not None:
            record = {**record, **{k: v for k, v in self.stamp().items() if k not in record}}
        if "ts" in record and "time" not in record:
            record = {"time": iso(float(record["ts"])), **record}
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        try:
            # One write() of a short line with O_APPEND is atomic enough for concurrent readers;
            # in a checked directory, never through a symlink (safefiles).
            safefiles.append_line(self.path, line.encode())
        except safefiles.UnsafePath as exc:
            raise SlurmIdleError(f"unsafe journal {self.path}: {exc} (paths.journal in the config)") from None
        except OSError as exc:
            raise JournalWriteError(str(self._error("write", exc))) from None

    def record(self, record: JournalRecord | dict[str, Any]) -> None:
        """Append, and on a failed write (a full disk) log an error and go on: the service
        action being recorded must not stop between a transition and its next step (a tick
        that failed at its first journal write left nodes `starting` until space freed)."""
        try:
            self.append(record)
        except JournalWriteError as exc:
            log.error("%s: this record is lost, the action goes on", exc)

    def _error(self, verb: str, exc: OSError) -> SlurmIdleError:
        return SlurmIdleError(
            f"cannot {verb} the journal {self.path}: {exc.strerror or exc} (paths.journal in the config)"
        )

    def records(self, since: float | None = None, pending: bool = True) -> Iterator[dict[str, Any]]:
        """Every well-formed record of the history (rotated siblings, the live file, then the
        run of idle ticks still being counted), oldest first; with `since`, from about
        `since - journal_files.LAG_S` on: the caller still filters by time.

        A bad line (not UTF-8, not JSON, nested too deep for the parser) is skipped and
        counted, and the count said once, as a warning, when the reading is done: one bad
        line must not make `explain` or `report` fail. A torn last line (a write in
        progress) is skipped silently.
        """
        bad = 0
        try:
            for raw in journal_files.forward(self.path, since):
                record = journal_files.parse(raw)
                if record is None:
                    bad += bool(raw.strip()) and raw.endswith(b"\n")
                    continue
                yield record
        except OSError as exc:
            raise self._error("read", exc) from None
        if bad:
            log.warning("journal %s: skipped %d malformed line(s)", self.path, bad)
        if pending:
            run = self.pending_run()
            if run is not None:
                yield run

    def newest_first(self, needles: tuple[bytes, ...] = ()) -> Iterator[dict[str, Any]]:
        """The records newest first (the idle run being counted, then the history from its
        end); with `needles`, only lines holding one of them are parsed (see
        journal_files.backward). Malformed lines are skipped silently."""
        run = self.pending_run()
        if run is not None and (not needles or any(n.decode() in json.dumps(run) for n in needles)):
            yield run
        try:
            for raw in journal_files.backward(self.path, needles):
                record = journal_files.parse(raw)
                if record is not None:
                    yield record
        except OSError as exc:
            raise self._error("read", exc) from None

    @property
    def pending_path(self) -> Path:
        """The run of identical idle ticks still being counted (idle_runs.py), one JSON
        record rewritten in place, appended to the journal when the run ends."""
        return self.path.with_name(self.path.name + ".idle-run")

    def pending_run(self) -> dict[str, Any] | None:
        """The run being counted, as a record (None: no run, or an unreadable side file)."""
        try:
            text = safefiles.read_text(self.pending_path)
        except OSError:
            return None
        return journal_files.parse(text.encode()) if text else None

    def typed(self) -> Iterator[JournalRecord]:
        """Every record of a known kind, oldest first, as its dataclass (see parse_record)."""
        return typed_records(self.records())


# --- the records -----------------------------------------------------------------------------


class StepOutcome(StrEnum):
    """How one attempted phase change ended (a str: compares and serialises as its value)."""

    OK = "ok"  # the edge was taken; the new phase is written in Slurm
    WAITING = "waiting"  # blocked on a condition at the tick's deadline: the next tick carries on
    ERROR = "error"  # an effector failed; the phase stays, the next tick retries
    STUCK = "stuck"  # still waiting past the phase's timeout (reported, retried)
    SKIPPED = "skipped"  # an admin took the node meanwhile: left alone, nothing done


class RouterOutcome(StrEnum):
    OK = "ok"
    ERROR = "error"


E = TypeVar("E", bound=StrEnum)


def _member(kind: type[E], value: str) -> E | str:
    """The enum member of `value`, or the string itself when this release does not know it."""
    try:
        return kind(value)
    except ValueError:
        return value


def _str(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _num(value: Any, default: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _counts(value: Any) -> dict[str, int]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}


def _head(event: str, ts: float, time: str | None) -> dict[str, Any]:
    """The keys every record starts with, in the journal's order (`time` first when known)."""
    out: dict[str, Any] = {"time": time} if time is not None else {}
    out.update(event=event, ts=round(ts, 3))
    return out


@dataclass(frozen=True)
class TransitionRecord:
    """One attempted phase change (transitions.StepResult, journaled)."""

    EVENT: ClassVar[str] = "transition"

    ts: float
    node: str
    model: str
    action: str  # the ActionKind's value: lend, reclaim, adopt, ...
    from_phase: str
    to_phase: str
    reason: str
    outcome: StepOutcome | str  # a str only for an outcome this release does not know
    duration_s: float
    error: str | None = None
    detail: str | None = None  # why a step is still waiting (carried over to the next tick)
    nodes: tuple[str, ...] = ()  # every node of a multi-node lend group (`node` is its key)
    time: str | None = None  # ISO-8601, as read back (Journal.append derives it from ts)

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec.update({"node": self.node, "model": self.model, "action": self.action,
                    "from": self.from_phase, "to": self.to_phase, "reason": self.reason,
                    "outcome": str(self.outcome), "duration_s": round(self.duration_s, 3)})
        if self.error:
            rec["error"] = self.error
        if self.detail:
            rec["detail"] = self.detail
        if self.nodes:
            rec["nodes"] = list(self.nodes)
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> TransitionRecord | None:
        node, src, dst = rec.get("node"), rec.get("from"), rec.get("to")
        if not (isinstance(node, str) and isinstance(src, str) and isinstance(dst, str)):
            return None
        outcome = _str(rec.get("outcome"))
        nodes = rec.get("nodes")
        return cls(
            ts=_num(rec.get("ts")), node=node, model=_str(rec.get("model")),
            action=_str(rec.get("action")), from_phase=src, to_phase=dst,
            reason=_str(rec.get("reason")),
            outcome=_member(StepOutcome, outcome),
            duration_s=max(0.0, _num(rec.get("duration_s"))), error=_opt_str(rec.get("error")),
            detail=_opt_str(rec.get("detail")),
            nodes=tuple(n for n in nodes if isinstance(n, str)) if isinstance(nodes, list) else (),
            time=_opt_str(rec.get("time")),
        )

    @property
    def all_nodes(self) -> tuple[str, ...]:
        return self.nodes or (self.node,)


@dataclass(frozen=True)
class TickRecord:
    """One tick that got the lock (agent.Agent._journal_tick)."""

    EVENT: ClassVar[str] = "tick"

    ts: float
    duration_s: float
    actions: int
    errors: int
    phases: dict[str, int] = field(default_factory=dict)  # nodes per phase after the steps
    needed: dict[str, int] = field(default_factory=dict)  # model -> replicas needed
    serving: dict[str, int] = field(default_factory=dict)  # model -> replicas serving
    error: str | None = None  # the tick itself failed
    dry_run: bool = False
    time: str | None = None
    # A run of identical idle ticks is one record (idle_runs.py): `count` ticks from `ts` to
    # `until` (the last one's start), `duration_s` the longest of them.
    count: int = 1
    until: float | None = None

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec.update({"duration_s": round(self.duration_s, 3), "actions": self.actions,
                    "errors": self.errors, "dry_run": self.dry_run, "phases": dict(self.phases),
                    "needed": dict(self.needed), "serving": dict(self.serving)})
        if self.error:
            rec["error"] = self.error
        if self.count > 1:
            rec["count"] = self.count
            rec["until"] = round(self.last_ts, 3)
            rec["until_time"] = iso(self.last_ts)
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> TickRecord:
        return cls(ts=_num(rec.get("ts")), duration_s=_num(rec.get("duration_s")),
                   actions=_int(rec.get("actions")), errors=_int(rec.get("errors")),
                   phases=_counts(rec.get("phases")), needed=_counts(rec.get("needed")),
                   serving=_counts(rec.get("serving")), error=_opt_str(rec.get("error")),
                   dry_run=rec.get("dry_run") is True, time=_opt_str(rec.get("time")),
                   count=max(1, _int(rec.get("count", 1))),
                   until=_num(rec.get("until")) if _is_number(rec.get("until")) else None)

    @property
    def failed(self) -> bool:
        return bool(self.errors or self.error)

    @property
    def last_ts(self) -> float:
        """When the last tick of the record began."""
        return self.until if self.until is not None and self.count > 1 else self.ts

    def ticks_in(self, since: float, until: float) -> int:
        """How many of the record's ticks began in [since, until): a run's ticks are taken as
        evenly spaced from `ts` to `last_ts` (the agent's cadence), so a period that cuts a run
        counts the ticks on its side."""
        if self.count <= 1 or self.last_ts <= self.ts:
            return self.count if since <= self.ts < until else 0
        step = (self.last_ts - self.ts) / (self.count - 1)
        first = max(0, math.ceil((since - self.ts) / step))
        last = min(self.count - 1, math.ceil((until - self.ts) / step) - 1)
        return max(0, last - first + 1)


class JobAction(StrEnum):
    """What a reclaim did to one job (eviction.py)."""

    SIGNALLED = "signalled"
    REQUEUED = "requeued"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class JobRecord:
    """What a reclaim did to one job on the node (eviction.py)."""

    EVENT: ClassVar[str] = "job"

    ts: float
    node: str
    job_id: int
    kind: str  # container | plain | interactive
    action: JobAction | str
    detail: str
    time: str | None = None

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec.update({"node": self.node, "job_id": self.job_id, "kind": self.kind,
                    "action": str(self.action), "detail": self.detail})
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> JobRecord | None:
        node, job_id = rec.get("node"), rec.get("job_id")
        if not isinstance(node, str) or not isinstance(job_id, int):
            return None
        action = _str(rec.get("action"))
        return cls(ts=_num(rec.get("ts")), node=node, job_id=job_id, kind=_str(rec.get("kind")),
                   action=_member(JobAction, action),
                   detail=_str(rec.get("detail")), time=_opt_str(rec.get("time")))


@dataclass(frozen=True)
class ForeignJobRecord(JobRecord):
    """What a reclaim did to a job that is neither the lend partition's nor one of our replica
    jobs (eviction.py): signalled, then cancelled (or requeued) after the grace. Its own event,
    with the partition and user, so an admin finds who held a lent node up."""

    EVENT: ClassVar[str] = "foreign_job"

    partition: str = ""
    user: str = ""

    def to_json(self) -> dict[str, Any]:
        rec = super().to_json()
        rec.update({"partition": self.partition, "user": self.user})
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> ForeignJobRecord | None:
        base = JobRecord.from_json(rec)
        if base is None:
            return None
        return cls(ts=base.ts, node=base.node, job_id=base.job_id, kind=base.kind,
                   action=base.action, detail=base.detail, time=base.time,
                   partition=_str(rec.get("partition")), user=_str(rec.get("user")))


@dataclass(frozen=True)
class RouterRecord:
    """One call to a model's router (router/sync.py)."""

    EVENT: ClassVar[str] = "router"

    ts: float
    node: str
    model: str
    router: str  # the router's kind
    call: str  # remove | add
    reason: str
    outcome: RouterOutcome | str
    duration_s: float | None = None  # ok calls
    error: str | None = None  # failed calls
    replica: str | None = None  # one of several replicas on `node` (its name)
    time: str | None = None

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec.update({"node": self.node, "model": self.model, "router": self.router,
                    "call": self.call, "reason": self.reason})
        if self.replica is not None:
            rec["replica"] = self.replica
        rec["outcome"] = str(self.outcome)
        if self.error is not None:
            rec["error"] = self.error
        if self.duration_s is not None:
            rec["duration_s"] = round(self.duration_s, 3)
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> RouterRecord | None:
        node = rec.get("node")
        if not isinstance(node, str):
            return None
        outcome = _str(rec.get("outcome"))
        duration = rec.get("duration_s")
        return cls(ts=_num(rec.get("ts")), node=node, model=_str(rec.get("model")),
                   router=_str(rec.get("router")), call=_str(rec.get("call")),
                   reason=_str(rec.get("reason")),
                   outcome=_member(RouterOutcome, outcome),
                   duration_s=_num(duration) if duration is not None else None,
                   error=_opt_str(rec.get("error")), replica=_opt_str(rec.get("replica")),
                   time=_opt_str(rec.get("time")))


@dataclass(frozen=True)
class AdminRecord:
    """An admin's pin or unpin of a node, or a `lend --force` that overrode a rule (admin.py);
    lend and reclaim journal transitions."""

    EVENT: ClassVar[str] = "admin"

    ts: float
    node: str
    command: str  # pin | unpin | lend --force
    phase: str  # the node's phase at the time
    outcome: StepOutcome | str
    detail: str = ""
    time: str | None = None

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec.update({"node": self.node, "command": self.command, "phase": self.phase,
                    "outcome": str(self.outcome), "detail": self.detail})
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> AdminRecord | None:
        node = rec.get("node")
        if not isinstance(node, str):
            return None
        outcome = _str(rec.get("outcome"))
        return cls(ts=_num(rec.get("ts")), node=node, command=_str(rec.get("command")),
                   phase=_str(rec.get("phase")),
                   outcome=_member(StepOutcome, outcome),
                   detail=_str(rec.get("detail")), time=_opt_str(rec.get("time")))


@dataclass(frozen=True)
class DuplicateJobRecord:
    """Two jobs of ours for one replica (`placement: jobs`): the one kept and the ones cancelled
    (jobdriver.py)."""

    EVENT: ClassVar[str] = "duplicate-replica-job"

    ts: float
    replica: str
    model: str
    kept: int | None  # the replica's job (running, else the oldest)
    cancelled: tuple[int, ...]
    error: str | None = None  # the scancel failed
    time: str | None = None

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec.update({"replica": self.replica, "model": self.model, "kept": self.kept,
                    "cancelled": list(self.cancelled)})
        if self.error is not None:
            rec["error"] = self.error
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> DuplicateJobRecord | None:
        replica, cancelled = rec.get("replica"), rec.get("cancelled")
        if not isinstance(replica, str) or not isinstance(cancelled, list):
            return None
        kept = rec.get("kept")
        return cls(ts=_num(rec.get("ts")), replica=replica, model=_str(rec.get("model")),
                   kept=kept if isinstance(kept, int) and not isinstance(kept, bool) else None,
                   cancelled=tuple(j for j in cancelled if isinstance(j, int) and not isinstance(j, bool)),
                   error=_opt_str(rec.get("error")), time=_opt_str(rec.get("time")))


@dataclass(frozen=True)
class ForeignReplicaJobRecord:
    """A job with our replica Comment's shape that is not the agent's (replicatrust.py): its
    slot counted as empty, the job itself left alone (it is a user's)."""

    EVENT: ClassVar[str] = "foreign-replica-job"

    ts: float
    job_id: int
    user: str
    nodes: tuple[str, ...]
    replica: str  # the replica it claims, MODEL#INDEX
    why: str
    time: str | None = None

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec.update({"job_id": self.job_id, "user": self.user, "nodes": list(self.nodes),
                    "replica": self.replica, "why": self.why})
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> ForeignReplicaJobRecord | None:
        job_id, nodes = rec.get("job_id"), rec.get("nodes")
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            return None
        return cls(ts=_num(rec.get("ts")), job_id=job_id, user=_str(rec.get("user")),
                   nodes=tuple(n for n in nodes if isinstance(n, str)) if isinstance(nodes, list) else (),
                   replica=_str(rec.get("replica")), why=_str(rec.get("why")),
                   time=_opt_str(rec.get("time")))


@dataclass(frozen=True)
class PhasesRecord:
    """Every pool node's phase after a tick, once a UTC day (journal_snapshots.py): a reader
    looking for the phase of a node that has not stepped for months stops here."""

    EVENT: ClassVar[str] = "phases"

    ts: float
    nodes: dict[str, str]  # node (or replica job) -> phase
    time: str | None = None

    def to_json(self) -> dict[str, Any]:
        rec = _head(self.EVENT, self.ts, self.time)
        rec["nodes"] = dict(self.nodes)
        return rec

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> PhasesRecord | None:
        nodes = rec.get("nodes")
        if not isinstance(nodes, Mapping):
            return None
        return cls(ts=_num(rec.get("ts")), time=_opt_str(rec.get("time")),
                   nodes={str(k): v for k, v in nodes.items() if isinstance(v, str)})


JournalRecord = (TransitionRecord | TickRecord | JobRecord | ForeignJobRecord | RouterRecord
                 | AdminRecord | DuplicateJobRecord | ForeignReplicaJobRecord | PhasesRecord)

_KINDS: dict[str, Any] = {k.EVENT: k for k in (TransitionRecord, TickRecord, JobRecord,
                                               ForeignJobRecord, RouterRecord, AdminRecord,
                                               DuplicateJobRecord, ForeignReplicaJobRecord,
                                               PhasesRecord)}


def parse_record(rec: Mapping[str, Any]) -> JournalRecord | None:
    """The record's dataclass; None for another event, or one without a numeric `ts` or the
    keys that say what it is about (a hand-edited or foreign line)."""
    kind = _KINDS.get(rec.get("event"))  # type: ignore[arg-type]
    ts = rec.get("ts")
    if kind is None or isinstance(ts, bool) or not isinstance(ts, int | float):
        return None
    parsed: JournalRecord | None = kind.from_json(rec)
    return parsed


def typed_records(records: Iterable[Mapping[str, Any]]) -> Iterator[JournalRecord]:
    """The records of a known kind among `records`, as dataclasses, in order."""
    for rec in records:
        parsed = parse_record(rec)
        if parsed is not None:
            yield parsed
