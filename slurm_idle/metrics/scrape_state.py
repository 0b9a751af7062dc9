"""The scrape source's state file (`metrics.scrape_state`): the previous tick's readings of each
replica (rates span the time between ticks) and a short per-model demand and queue history (the
scale-down window, `policy.queue_sustain_s`), versioned and written atomically.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_idle import safefiles
from slurm_idle.errors import SlurmIdleError
from slurm_idle.logs import get_logger
from slurm_idle.metrics.history import Reading
from slurm_idle.metrics.parse import (
    EngineSnapshot,
    Histogram,
)

log = get_logger(__name__)

STATE_VERSION = 1


def _snap_to_json(s: EngineSnapshot) -> dict[str, Any]:
    return asdict(s)


def _snap_from_json(d: dict[str, Any]) -> EngineSnapshot:
    def hist(h: Any) -> Histogram | None:
        return Histogram(tuple((float(le), float(n)) for le, n in h["buckets"])) if h else None

    return EngineSnapshot(**{**d, "ttft": hist(d.get("ttft")), "queue_time": hist(d.get("queue_time"))})


@dataclass
class ScrapeState:
    """The previous scrape of each URL and a short per-model history of demand and queue."""

    scrapes: dict[str, tuple[float, list[EngineSnapshot]]]
    history: list[Reading]  # (t, model, demand tokens/s, waiting); None: unknown (history.py)

    @classmethod
    def load(cls, path: Path | None) -> ScrapeState:
        if path is None:
            return cls({}, [])
        try:
            doc = json.loads(safefiles.read_text(path) or "{}")
            if doc.get("version") != STATE_VERSION:
                return cls({}, [])
            scrapes = {
                url: (float(v["t"]), [_snap_from_json(e) for e in v["engines"]])
                for url, v in doc["scrapes"].items()
            }
            history: list[Reading] = [
                (float(t), str(m), None if d is None else float(d), None if w is None else float(w))
                for t, m, d, w in doc["history"]
            ]
            return cls(scrapes, history)
        except (OSError, ValueError, KeyError, TypeError):
            return cls({}, [])  # a lost or corrupt state only costs one double scrape

    def save(self, path: Path | None) -> None:
        if path is None:
            return
        doc = {
            "version": STATE_VERSION,
            "scrapes": {
                url: {"t": t, "engines": [_snap_to_json(e) for e in engines]}
                for url, (t, engines) in self.scrapes.items()
            },
            "history": [list(h) for h in self.history],
        }
        # In a checked directory, never through a symlink; a temp name of its own (two writers
        # never rename each other's file away); 0644: `status` as another user reads it.
        try:
            safefiles.atomic_write(path, json.dumps(doc), 0o644)
        except (OSError, SlurmIdleError) as exc:  # costs one double scrape; never the tick
            log.warning("cannot save the scrape state %s: %s", path, exc)
