"""The agent's journal: one JSON object per line, appended, never rewritten.

`explain` and `report` read it back, so its shape is a stable interface:

  transition record (one per phase change the agent attempted):
    {"event": "transition", "time": "2026-12-02T10:00:00Z", "ts": 1796205600.0,
     "node": "gpu1", "model": "m", "action": "reclaim", "from": "lent", "to": "reclaiming",
     "reason": "...", "outcome": "ok" | "error" | "timeout" | "dry-run" | "skipped",
     "error": "..." (only when outcome is error/timeout), "duration_s": 0.12}
  tick record (one per tick that got the lock):
    {"event": "tick", "time": ..., "ts": ..., "duration_s": 1.3, "actions": 2, "errors": 0,
     "dry_run": false, "phases": {"serving": 2, "lent": 2}, "needed": {"m": 2},
     "serving": {"m": 2}, "error": "..." (only if the tick itself failed)}
  job record (what a reclaim did to one job on the node, eviction.py):
    {"event": "job", "time": ..., "ts": ..., "node": "gpu1", "job_id": 42,
     "kind": "container" | "plain" | "interactive",
     "action": "signalled" | "requeued" | "cancelled" | "error", "detail": "..."}
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slurm_idle import safefiles
from slurm_idle.errors import SlurmIdleError


def iso(ts: float) -> str:
    """Unix seconds as an ISO-8601 UTC timestamp (second precision)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Journal:
    """Append-only JSON-lines file."""

    path: Path

    def append(self, record: dict[str, Any]) -> None:
        """Append one record; `time` is derived from `ts` if missing."""
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
            raise self._error("write", exc) from None

    def _error(self, verb: str, exc: OSError) -> SlurmIdleError:
        return SlurmIdleError(
            f"cannot {verb} the journal {self.path}: {exc.strerror or exc} (paths.journal in the config)"
        )

    def records(self) -> Iterator[dict[str, Any]]:
        """Every well-formed record, oldest first; a torn last line is skipped."""
        try:
            with self.path.open() as fh:
                for line in fh:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(record, dict):
                        yield record
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._error("read", exc) from None
