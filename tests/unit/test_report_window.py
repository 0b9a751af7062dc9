"""report reads a period's journal from a day before it (report_io.window_records): the facts
it computes from that window and the phases nodes were left in before it are the facts of
the whole history, across rotated files, for nodes that stepped in the period, long before
it, or never."""

from __future__ import annotations

import bz2
import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest

from slurm_idle import journal_files
from slurm_idle.journal import Journal, iso
from slurm_idle.report import JournalFacts, journal_facts
from slurm_idle.report_io import window_records

from .test_journal_files import written_at

T0 = 1_796_205_600.0  # an hour's start
HOUR, DAY = 3600.0, 86400.0
SPAN_DAYS = 10
#: (from, to) of each step a node takes in turn; a lend is sometimes called off.
CYCLE = [("serving", "retiring"), ("retiring", "lending"), ("lending", "lent"),
         ("lent", "reclaiming"), ("reclaiming", "starting"), ("starting", "serving")]
NODES = ["gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6"]


def steps_of(rnd: random.Random, node: str, start: float, stop: float, dwell: float,
             outcomes: list[str]) -> list[tuple[float, dict[str, Any]]]:
    """A node's steps from `start` to `stop`, each journaled when it ends (written at
    ts + duration), dwelling about `dwell` seconds in settled phases."""
    out = []
    t, k = start, 0
    while t < stop:
        src, dst = CYCLE[k]
        if src == "retiring" and rnd.random() < 0.15:
            dst = "serving"  # called off
        dur = rnd.uniform(0.5, 150.0)
        outcome = rnd.choice(outcomes)
        out.append((t + dur, {"event": "transition", "ts": round(t, 3), "node": node,
                              "model": "m", "action": "step", "from": src, "to": dst,
                              "reason": "r", "outcome": outcome, "duration_s": round(dur, 3)}))
        t += dur
        if outcome == "ok":
            k = 0 if dst == "serving" else k + 1
            t += rnd.expovariate(1 / dwell) if dst in ("serving", "lent") else rnd.uniform(1, 120)
        else:
            t += rnd.uniform(30, 300)  # the next tick tries again
    return out


def ticks_of(rnd: random.Random, stop: float) -> list[tuple[float, dict[str, Any]]]:
    """Ticks every 5 minutes: an hour's idle run as one record written at its end (up to an
    hour after its ts), now and then a tick that acted or failed, alone."""
    out = []
    for h in range(int((stop - T0) // HOUR)):
        start = T0 + h * HOUR + 7
        run = [start + 300 * i for i in range(12)]
        special = rnd.random() < 0.3 and T0 + (h + 1) * HOUR < stop  # the last hour idle
        if special:
            i = rnd.randrange(12)
            tick = {"event": "tick", "ts": run[i], "duration_s": 1.0, "actions": 1,
                    "errors": int(rnd.random() < 0.5)}
            out.append((run[i] + 1, tick))
            runs = [run[:i], run[i + 1:]]
        else:
            runs = [run]
        for r in runs:
            if not r:
                continue
            rec: dict[str, Any] = {"event": "tick", "ts": r[0], "duration_s": 1.0, "actions": 0,
                                   "errors": 0}
            if len(r) > 1:
                rec.update(count=len(r), until=r[-1])
            out.append((r[-1] + 1, rec))
    return out


def make_history(tmp_path: Path, seed: int) -> Journal:
    """Ten days: gpu1/gpu2 step every few hours, gpu3 every couple of days, gpu4 only on the
    first day, gpu5 never, gpu6 only failed steps; rotated into .3.gz, .2.bz2, .1 and the
    live file at days 3, 5 and 7; the last hour's idle run pending in the side file."""
    rnd = random.Random(seed)
    stop = T0 + SPAN_DAYS * DAY
    lines = ticks_of(rnd, stop)
    lines += steps_of(rnd, "gpu1", T0 + 100, stop, 3 * HOUR, ["ok"] * 5 + ["waiting", "error"])
    lines += steps_of(rnd, "gpu2", T0 + 900, stop, 5 * HOUR, ["ok"] * 8 + ["skipped"])
    lines += steps_of(rnd, "gpu3", T0 + 200, stop, 1.5 * DAY, ["ok"])
    lines += steps_of(rnd, "gpu4", T0 + 300, T0 + 0.8 * DAY, 2 * HOUR, ["ok"])
    lines += steps_of(rnd, "gpu6", T0 + 400, stop, DAY, ["error"])
    lines.sort(key=lambda w: w[0])
    live = tmp_path / "journal.jsonl"
    # The newest tick record (the last hour's idle run) is the run still being counted.
    last_tick = max(i for i, (_, rec) in enumerate(lines) if rec["event"] == "tick")
    live.with_name(live.name + ".idle-run").write_text(json.dumps(lines.pop(last_tick)[1]) + "\n")
    cuts = [T0 + 3 * DAY, T0 + 5 * DAY, T0 + 7 * DAY]
    files: list[list[bytes]] = [[], [], [], []]
    for written, rec in lines:
        files[sum(written >= c for c in cuts)].append(
            (json.dumps({"time": iso(rec["ts"]), **rec}) + "\n").encode())
    (tmp_path / "journal.jsonl.3.gz").write_bytes(gzip.compress(b"".join(files[0])))
    (tmp_path / "journal.jsonl.2.bz2").write_bytes(bz2.compress(b"".join(files[1])))
    (tmp_path / "journal.jsonl.1").write_bytes(b"".join(files[2]))
    live.write_bytes(b"".join(files[3]))
    for name, lines_of in zip((".3.gz", ".2.bz2", ".1"), files[:3], strict=True):
        written_at(tmp_path / f"journal.jsonl{name}", lines_of)
    return Journal(live)


def comparable(facts: JournalFacts) -> tuple[Any, ...]:
    return (facts.lends, facts.reclaims, sorted(facts.reclaim_latencies_s),
            sorted(facts.intervals, key=lambda i: (i.node, i.start)), facts.ticks,
            facts.tick_errors)


def periods(rnd: random.Random) -> list[tuple[float, float, float]]:
    """(since, until, now): starts from 2.5 days into the history on, some at hours, some
    running past the journal's end, some with `now` inside the period."""
    end = T0 + SPAN_DAYS * DAY
    out = [(T0 + 3 * DAY, T0 + 4 * DAY, end + HOUR), (T0 + 8 * DAY, end + DAY, end),
           (T0 + 6 * DAY + 7, T0 + 6 * DAY + 7 + 600 * 5, end)]
    for _ in range(4):
        since = rnd.uniform(T0 + 2.5 * DAY, end - HOUR)
        if rnd.random() < 0.3:
            since = since // HOUR * HOUR
        until = since + rnd.uniform(HOUR, 2 * DAY)
        now = rnd.choice([end + HOUR, rnd.uniform(since, until)])
        out.append((since, until, now))
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bisect", [False, True])
def test_window_facts_are_the_whole_historys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              seed: int, bisect: bool) -> None:
    """journal_facts over window_records and its phases_before equals journal_facts over the
    whole history: lends, reclaims, reclaim latencies, every node's phase intervals clipped
    to the period, ticks and failed ticks; with `bisect`, the live file is bisected too."""
    if bisect:  # small enough a block that this small live file is bisected, not read whole
        monkeypatch.setattr(journal_files, "BLOCK", 4096)
        monkeypatch.setattr(journal_files, "BISECT_MIN", 4096)
    journal = make_history(tmp_path, seed)
    every = list(journal.records())
    assert journal.pending_path.exists()
    for since, until, now in periods(random.Random(seed)):
        records, before = window_records(journal, since, NODES)
        # The files before the one holding since - LAG_S are not read (each spans <= 3 days).
        first = min(r["ts"] for r in records)
        assert first >= since - journal_files.LAG_S - 3 * DAY - HOUR
        if since - journal_files.LAG_S > T0 + 3 * DAY + HOUR:
            assert first >= T0 + 3 * DAY - HOUR and len(records) < len(every)
        whole = journal_facts(every, since=since, until=until, now=now)
        window = journal_facts(records, since=since, until=until, now=now, phases_before=before)
        assert comparable(window) == comparable(whole), (since, until, now)
        nodes = {i.node for i in whole.intervals}
        assert {"gpu1", "gpu2", "gpu3", "gpu4"} <= nodes and not nodes & {"gpu5", "gpu6"}
        # phases_before: exactly the nodes that stepped, but not in the window's records.
        assert set(before) == {"gpu1", "gpu2", "gpu3", "gpu4"} - stepped(records)
        if since - journal_files.LAG_S > T0 + 3 * DAY + HOUR:  # .3.gz, gpu4's steps, not read
            assert "gpu4" in before


def stepped(records: list[dict[str, Any]]) -> set[str]:
    return {r["node"] for r in records if r["event"] == "transition" and r["outcome"] == "ok"}


def test_a_node_last_stepped_long_before_the_period(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose last step was days before the period (its record not read: the live file
    is bisected to the day before the period) is in the phase it left it in for the whole
    period (phases_before), from the period's start to its end or now; a failed step after
    it does not change it; a node that never stepped has no phase."""
    monkeypatch.setattr(journal_files, "BLOCK", 16)  # a bisection to the byte
    monkeypatch.setattr(journal_files, "BISECT_MIN", 1)
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append({"event": "transition", "ts": T0, "node": "gpu1", "from": "lending",
                    "to": "lent", "outcome": "ok", "reason": "idle", "duration_s": 2.0})
    journal.append({"event": "transition", "ts": T0 + 60, "node": "gpu1", "from": "lent",
                    "to": "reclaiming", "outcome": "error", "reason": "load"})
    for d in range(1, 6):
        journal.append({"event": "tick", "ts": T0 + d * DAY, "duration_s": 1.0, "actions": 0,
                        "errors": 0})
    since = T0 + 4 * DAY
    records, before = window_records(journal, since, ["gpu1", "gpu2"])
    # From a record or two before since - LAG_S on (the bisection probes three lines at a
    # time): the steps of the first day are not read.
    got = [r["ts"] for r in records]
    assert got[-3:] == [T0 + 3 * DAY, T0 + 4 * DAY, T0 + 5 * DAY] and len(got) <= 5
    assert all(r["event"] == "tick" for r in records)
    assert before == {"gpu1": "lent"}
    facts = journal_facts(records, since=since, until=since + DAY, now=since + HOUR,
                          phases_before=before)
    assert [(i.node, i.phase, i.start, i.end) for i in facts.intervals] == [
        ("gpu1", "lent", since, since + HOUR)]
    assert comparable(facts) == comparable(journal_facts(
        journal.records(), since=since, until=since + DAY, now=since + HOUR))


def test_a_malformed_transition_does_not_fail_the_window(tmp_path: Path) -> None:
    """A transition line without a node (hand-edited, or another tool's) is skipped, as
    journal_facts skips it over the whole history: the report does not fail."""
    # Regression (this was a bug in report_io.window_records): `stepped = {r["node"] for r in records if ...}` indexes
    # every `"event": "transition", "outcome": "ok"` record, so one without "node" raises
    # KeyError (and a non-string node such as a list, TypeError) where journal_facts and
    # TransitionRecord.from_json skip it ("one bad line must not make explain or report fail").
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append({"event": "transition", "ts": T0, "from": "lending", "to": "lent",
                    "outcome": "ok"})
    journal.append({"event": "transition", "ts": T0 + 1, "node": "gpu1", "from": "lending",
                    "to": "lent", "outcome": "ok", "reason": "idle"})
    whole = journal_facts(journal.records(), since=T0, until=T0 + DAY, now=T0 + HOUR)
    records, before = window_records(journal, T0, ["gpu1"])
    window = journal_facts(records, since=T0, until=T0 + DAY, now=T0 + HOUR,
                           phases_before=before)
    assert comparable(window) == comparable(whole)
