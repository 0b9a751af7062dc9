"""What the agent remembers of each replica's engine from tick to tick: its failed starts or
wakes (for the backoff, the one cold restart and giving up) and the GPU memory it left behind
when it was lent (its residue, which the GPU gate allows it to find again).

A cron tick is a fresh process, and Slurm has nowhere for these per-replica facts, so they
live in a small JSON file beside the journal, like unhealthy_since.py: rewritten atomically
and never through a symlink (safefiles) when something changes. A file that cannot be read or
written costs one retry or a tighter allowance, never safety: without a recorded residue a
sleeping engine is allowed `gpu.max_residue_mib` (what a lend accepts) and a stopped one none.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_idle import safefiles
from slurm_idle.logs import get_logger

log = get_logger(__name__)

FILE_NAME = "engine-notes.json"
#: The first retry of a failed start or wake waits this long; each next one twice as long, up
#: to the engine's start_timeout_s (a wake is expected in seconds, a cold start in minutes).
BACKOFF_BASE_S = 15.0


def notes_path(journal: str) -> Path:
    """The file beside the journal (the agent's own directory)."""
    return Path(journal).parent / FILE_NAME


@dataclass(frozen=True)
class StartFailures:
    """A replica's starts or wakes that failed since it last served."""

    attempts: int
    last_ts: float
    last_error: str
    cold_restarted: bool = False  # the one cold restart (stop + start commands) was issued
    given_up: bool = False  # every attempt spent: the replica's node goes to the admin

    def next_try(self, cap_s: float) -> float:
        """When the next start or wake may be tried (after a cold restart: once a cold start
        has had its time)."""
        wait = cap_s if self.cold_restarted else min(BACKOFF_BASE_S * 2 ** (self.attempts - 1), cap_s)
        return self.last_ts + wait

    def to_json(self) -> dict[str, Any]:
        return {"attempts": self.attempts, "last_ts": self.last_ts, "last_error": self.last_error,
                "cold_restarted": self.cold_restarted, "given_up": self.given_up}


def _failures(doc: Any) -> StartFailures | None:
    if not isinstance(doc, dict):
        return None
    attempts, last_ts = doc.get("attempts"), doc.get("last_ts")
    if not isinstance(attempts, int) or attempts < 1 or not isinstance(last_ts, int | float):
        return None
    if not math.isfinite(last_ts):
        return None
    return StartFailures(attempts, float(last_ts), str(doc.get("last_error", "")),
                         bool(doc.get("cold_restarted", False)), bool(doc.get("given_up", False)))


def _residue(doc: Any) -> dict[int, int] | None:
    if not isinstance(doc, dict):
        return None
    out = {}
    for k, v in doc.items():
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0 and str(k).isdigit()):
            return None
        out[int(k)] = v
    return out


class EngineNotes:
    """The notes file, read once per driver and written on each change (thread-safe: the
    driver runs one thread per group)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._doc: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        if self.path is None:
            return {}
        try:
            text = safefiles.read_text(self.path)
            doc = json.loads(text) if text else {}
        except (OSError, ValueError, safefiles.UnsafePath):
            return {}
        if not isinstance(doc, dict):
            return {}
        return {str(k): v for k, v in doc.items() if isinstance(v, dict)}

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            safefiles.atomic_write(self.path, json.dumps(self._doc, sort_keys=True) + "\n", mode=0o644)
        except (OSError, safefiles.UnsafePath) as exc:
            log.warning("cannot record engine notes in %s: %s", self.path, exc)

    def _set(self, replica: str, key: str, value: Any) -> None:
        with self._lock:
            entry = dict(self._doc.get(replica, {}))
            if value is None:
                if key not in entry:
                    return
                entry.pop(key)
            else:
                entry[key] = value
            if entry:
                self._doc[replica] = entry
            else:
                self._doc.pop(replica, None)
            self._save()

    # -- failed starts and wakes --------------------------------------------------------------

    def failures(self, replica: str) -> StartFailures | None:
        with self._lock:
            return _failures(self._doc.get(replica, {}).get("start_failures"))

    def failed(self, replica: str, error: str, now: float) -> StartFailures:
        """Count one more failed start or wake of `replica`."""
        before = self.failures(replica)
        after = StartFailures((before.attempts if before else 0) + 1, now, error[:300],
                              before.cold_restarted if before else False)
        self._set(replica, "start_failures", after.to_json())
        return after

    def cold_restarted(self, replica: str, now: float) -> None:
        """The one cold restart was issued now."""
        self._update(replica, last_ts=now, cold_restarted=True)

    def give_up(self, replica: str) -> None:
        """Every attempt is spent."""
        self._update(replica, given_up=True)

    def _update(self, replica: str, **changes: Any) -> None:
        before = self.failures(replica) or StartFailures(1, 0.0, "")
        self._set(replica, "start_failures", {**before.to_json(), **changes})

    def served(self, replica: str) -> None:
        """The replica serves (or was handed to the admin): its failures are forgotten."""
        self._set(replica, "start_failures", None)

    def failed_starts(self) -> frozenset[str]:
        """Replicas with a failed start or wake since they last served."""
        with self._lock:
            return frozenset(r for r, e in self._doc.items() if _failures(e.get("start_failures")))

    # -- the residue at lend ------------------------------------------------------------------

    def residue(self, replica: str) -> dict[int, int] | None:
        """MiB per GPU index the engine left when it was lent; None when not recorded."""
        with self._lock:
            return _residue(self._doc.get(replica, {}).get("residue_mib"))

    def record_residue(self, replica: str, per_gpu: dict[int, int] | None) -> None:
        self._set(replica, "residue_mib", {str(k): v for k, v in sorted(per_gpu.items())}
                  if per_gpu is not None else None)

    def released_at(self, replica: str, now: float, lend_began: float | None) -> float:
        """When the engine's stop (or sleep) was first seen to have taken effect in this lend
        (begun at `lend_began`): the residue is read from samples after it, however many ticks
        that takes. A time from an earlier, abandoned lend is not this lend's."""
        with self._lock:
            ts = self._doc.get(replica, {}).get("released_at")
        if isinstance(ts, int | float) and math.isfinite(ts) and (lend_began is None or ts >= lend_began):
            return float(ts)
        self._set(replica, "released_at", now)
        return now

    def forget_release(self, replica: str) -> None:
        """The lend went through (or was abandoned): the next one waits for its own release."""
        self._set(replica, "released_at", None)

    # -- lends refused ------------------------------------------------------------------------

    def refuse_lend(self, replica: str, why: str, now: float) -> None:
        """The engine left more than gpu.max_residue_mib behind: not lent again until an admin
        says so (`slurm-idle unpin`)."""
        self._set(replica, "lend_refused", {"ts": now, "why": why[:300]})

    def lend_refused(self, replica: str) -> str | None:
        with self._lock:
            entry = self._doc.get(replica, {}).get("lend_refused")
        return str(entry.get("why", "")) if isinstance(entry, dict) else None

    def allow_lend(self, replica: str) -> None:
        self._set(replica, "lend_refused", None)

    def refused(self) -> frozenset[str]:
        """Replicas whose lend was refused for their residue."""
        with self._lock:
            return frozenset(r for r, e in self._doc.items() if isinstance(e.get("lend_refused"), dict))
