"""A year of journal, generated the way an agent writes it (scripts/bench-journal).

Five nodes of one model: four each lent twice a day (drain, lend, lent; reclaim, start,
serving: six transitions and two router calls per cycle, 48 transitions a day in all), the
fifth kept serving by the floor (it never steps), a tick every `cadence_s` seconds in between
and every node's phase once a day (journal_snapshots.py). With `fold`, runs of identical idle ticks are one record, as
the agent writes them now (idle_runs.py, the same rule); without, one record per tick, as
journals written before that look (and as a site upgrading keeps them for years).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_idle.idle_runs import continues, extend, idle
from slurm_idle.journal import PhasesRecord, RouterRecord, TickRecord, TransitionRecord, iso
from slurm_idle.model import Phase

DAY_S = 86400
NODES = ("gpu1", "gpu2", "gpu3", "gpu4")
FLOOR_NODE = "gpu5"  # the replica the floor keeps serving: it never steps
MODEL = "llama"
LEND = ((Phase.SERVING, Phase.RETIRING), (Phase.RETIRING, Phase.LENDING), (Phase.LENDING, Phase.LENT))
RECLAIM = ((Phase.LENT, Phase.RECLAIMING), (Phase.RECLAIMING, Phase.STARTING),
           (Phase.STARTING, Phase.SERVING))


@dataclass(frozen=True)
class Year:
    """What was written: records, ticks, transitions, bytes."""

    path: Path
    records: int
    ticks: int
    transitions: int
    bytes: int
    start: float
    end: float


def _transition(ts: float, node: str, src: Phase, dst: Phase, why: str) -> TransitionRecord:
    return TransitionRecord(ts=ts, node=node, model=MODEL, action="lend" if dst in
                            (Phase.RETIRING, Phase.LENDING, Phase.LENT) else "reclaim",
                            from_phase=src.value, to_phase=dst.value, reason=why,
                            outcome="ok", duration_s=0.4)


def _day_events(day_start: float, rng: random.Random) -> list[tuple[float, Any]]:
    """One day's cycles: each node lent in the night and at midday, back in the morning and
    the afternoon (times jittered), with the router calls of each."""
    out: list[tuple[float, Any]] = []
    for i, node in enumerate(NODES):
        for lend_h, back_h in ((0.5 + i * 0.4, 7.0 + i * 0.3), (12.5 + i * 0.2, 15.0 + i * 0.2)):
            t = day_start + lend_h * 3600 + rng.uniform(0, 600)
            out.append((t, RouterRecord(ts=t, node=node, model=MODEL, router="haproxy",
                                        call="remove", reason="load below need for 15 min",
                                        outcome="ok", duration_s=0.01)))
            for k, (src, dst) in enumerate(LEND):
                out.append((t + 60 * k, _transition(t + 60 * k, node, src, dst,
                                                    "llama needs 2 of 4 replicas for 15 min")))
            t = day_start + back_h * 3600 + rng.uniform(0, 600)
            for k, (src, dst) in enumerate(RECLAIM):
                out.append((t + 120 * k, _transition(t + 120 * k, node, src, dst,
                                                     "llama needs 4 replicas: queue 12 > 8")))
            out.append((t + 240, RouterRecord(ts=t + 240, node=node, model=MODEL, router="haproxy",
                                              call="add", reason="replica healthy again",
                                              outcome="ok", duration_s=0.01)))
    return sorted(out, key=lambda e: e[0])


def _records(start: float, days: int, cadence_s: float, fold: bool, seed: int
             ) -> Iterator[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    phases = dict.fromkeys(NODES, Phase.SERVING)
    run: TickRecord | None = None
    for day in range(days):
        events = _day_events(start + day * DAY_S, rng)
        e = 0
        t = start + day * DAY_S
        while t < start + (day + 1) * DAY_S:
            acted = 0
            while e < len(events) and events[e][0] <= t:
                rec = events[e][1]
                if isinstance(rec, TransitionRecord):
                    phases[rec.node] = Phase(rec.to_phase)
                    acted += 1
                yield rec.EVENT, rec.to_json()
                e += 1
            if t == start + day * DAY_S:  # the day's first tick: every node's phase
                yield "phases", PhasesRecord(ts=t, nodes={**{n: p.value for n, p in phases.items()},
                                                          FLOOR_NODE: Phase.SERVING.value}).to_json()
            counts = {p.value: 0 for p in Phase}
            for p in phases.values():
                counts[p.value] += 1
            serving = counts[Phase.SERVING.value]
            tick = TickRecord(ts=t, duration_s=0.3 + rng.random() * 0.4, actions=acted, errors=0,
                              phases=counts, needed={MODEL: max(1, serving)},
                              serving={MODEL: serving})
            if not fold:
                yield "tick", tick.to_json()
            elif run is not None and continues(run, tick, cadence_s):
                run = extend(run, tick)
            else:
                if run is not None:
                    yield "tick", run.to_json()
                run = tick if idle(tick) else None
                if run is None:
                    yield "tick", tick.to_json()
            t += cadence_s
    if run is not None:
        yield "tick", run.to_json()


def write_year(path: Path, *, days: int = 365, cadence_s: float = 60.0, fold: bool = False,
               start: float = 1_764_547_200.0, seed: int = 7) -> Year:
    """Write `days` of journal at `cadence_s` to `path` (replaced)."""
    records = ticks = transitions = 0
    with path.open("w") as fh:
        for event, rec in _records(start, days, cadence_s, fold, seed):
            fh.write(json.dumps({"time": iso(rec["ts"]), **rec}) + "\n")
            records += 1
            ticks += rec.get("count", 1) if event == "tick" else 0
            transitions += event == "transition"
    return Year(path, records, ticks, transitions, path.stat().st_size, start, start + days * DAY_S)
