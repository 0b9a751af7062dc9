"""Runs of identical idle ticks are one journal record (idle_runs.py): they fold while nothing
differs, end (appended, then the new tick) when anything does, are read as the newest record
while pending, and report counts every tick whatever the folding."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.idle_runs import HOUR_S, continues, extend, idle, record_tick
from slurm_idle.journal import Journal, TickRecord
from slurm_idle.report import journal_facts

T0 = 1_796_205_600.0  # 2026-12-02T10:00:00Z, a UTC hour's start
CADENCE = 60.0
assert T0 % HOUR_S == 0


def tick(ts: float, **kw: Any) -> TickRecord:
    """A tick as the agent builds it (agent.Agent._journal_tick: no `time`)."""
    base: dict[str, Any] = {"duration_s": 1.0, "actions": 0, "errors": 0,
                            "phases": {"serving": 2, "lent": 1}, "needed": {"m": 2},
                            "serving": {"m": 2}}
    base.update(kw)
    return TickRecord(ts=ts, **base)


def ticks_of(journal: Journal) -> list[dict[str, Any]]:
    return [r for r in journal.records() if r.get("event") == "tick"]


def lines(journal: Journal) -> list[dict[str, Any]]:
    """What is in the journal file itself (not the pending run)."""
    return list(journal.records(pending=False))


def test_identical_idle_ticks_fold_into_one_record(tmp_path: Path) -> None:
    """Five identical idle ticks: nothing in the journal file yet, one pending record with
    count 5, until the last tick's start and the longest duration; records() reads it."""
    journal = Journal(tmp_path / "journal.jsonl")
    for i in range(5):
        record_tick(journal, tick(T0 + 60 * i, duration_s=1.0 + (i == 2)), CADENCE)
    assert lines(journal) == []
    [run] = ticks_of(journal)
    assert (run["ts"], run["count"], run["until"], run["duration_s"]) == (T0, 5, T0 + 240, 2.0)
    assert run["until_time"] == "2026-12-02T10:04:00Z"
    parsed = TickRecord.from_json(run)
    assert (parsed.count, parsed.last_ts) == (5, T0 + 240)


def test_a_single_idle_tick_is_pending_without_a_count(tmp_path: Path) -> None:
    """One idle tick is pending as a plain tick record (count 1 is not written)."""
    journal = Journal(tmp_path / "journal.jsonl")
    record_tick(journal, tick(T0), CADENCE)
    assert journal.pending_path.exists()
    [run] = ticks_of(journal)
    assert "count" not in run and "until" not in run and run["ts"] == T0


ENDERS: dict[str, dict[str, Any]] = {
    "actions": {"actions": 1},
    "errors": {"errors": 1},
    "error": {"error": "slurm down"},
    "phases": {"phases": {"serving": 3}},
    "needed": {"needed": {"m": 3}},
    "serving": {"serving": {"m": 1}},
    "dry_run": {"dry_run": True},
}


@pytest.mark.parametrize("what", list(ENDERS))
def test_a_different_tick_ends_the_run(tmp_path: Path, what: str) -> None:
    """A tick that acted, failed, or differs in counts or mode ends the run: the run is
    appended with its count, then the new tick (appended if it is not idle, pending if it is)."""
    journal = Journal(tmp_path / "journal.jsonl")
    for i in range(3):
        record_tick(journal, tick(T0 + 60 * i), CADENCE)
    new = tick(T0 + 180, **ENDERS[what])
    record_tick(journal, new, CADENCE)
    got = ticks_of(journal)
    assert [(r["ts"], r.get("count", 1)) for r in got] == [(T0, 3), (T0 + 180, 1)]
    assert got[0]["until"] == T0 + 120
    assert TickRecord.from_json(got[1]) == replace(new, time=got[1].get("time"))
    written = [r for r in lines(journal) if r.get("event") == "tick"]
    assert len(written) == (2 if not idle(new) else 1)
    assert journal.pending_path.exists() == idle(new)


def test_a_new_utc_hour_ends_the_run(tmp_path: Path) -> None:
    """The tick at the hour's turn starts a new run; the old one is appended within its hour."""
    journal = Journal(tmp_path / "journal.jsonl")
    for ts in (T0 + 3480, T0 + 3540, T0 + 3600, T0 + 3660):
        record_tick(journal, tick(ts), CADENCE)
    assert [(r["ts"], r.get("count", 1), r.get("until")) for r in lines(journal)] == [
        (T0 + 3480, 2, T0 + 3540)]
    assert [(r["ts"], r.get("count", 1)) for r in ticks_of(journal)] == [
        (T0 + 3480, 2), (T0 + 3600, 2)]


@pytest.mark.parametrize(("gap", "folds"), [(60.0, True), (2 * CADENCE + 1, True),
                                            (2 * CADENCE + 2, False), (600.0, False),
                                            (0.0, True), (-1.0, False)])
def test_a_gap_longer_than_two_cadences_ends_the_run(tmp_path: Path, gap: float, folds: bool) -> None:
    """Ticks up to two cadences (and a second) apart fold; a longer gap (an agent stopped in
    between) or a clock that went back starts a new run."""
    journal = Journal(tmp_path / "journal.jsonl")
    record_tick(journal, tick(T0 + 600), CADENCE)
    record_tick(journal, tick(T0 + 660), CADENCE)
    record_tick(journal, tick(T0 + 660 + gap), CADENCE)
    counts = [r.get("count", 1) for r in ticks_of(journal)]
    assert counts == ([3] if folds else [2, 1])


def test_continues_and_extend_directly() -> None:
    """continues() holds only for idle, equal ticks of one hour within the gap; extend adds
    the counts (a run extended by a run) and keeps the longest duration."""
    run = extend(tick(T0), tick(T0 + 60, duration_s=4.0))
    assert (run.count, run.last_ts, run.duration_s) == (2, T0 + 60, 4.0)
    assert continues(run, tick(T0 + 120), CADENCE)
    assert not continues(replace(run, actions=1), tick(T0 + 120), CADENCE)
    assert not continues(run, tick(T0 + 120, errors=2), CADENCE)
    assert not continues(run, tick(T0 + 3600), CADENCE)
    both = extend(run, extend(tick(T0 + 120), tick(T0 + 180)))
    assert (both.count, both.last_ts) == (4, T0 + 180)


def test_the_pending_run_is_the_newest_record(tmp_path: Path) -> None:
    """A record appended while a run is pending (an admin's pin) comes before the run in
    records() and after it in newest_first(); needles that a tick does not hold leave it out."""
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append({"event": "transition", "ts": T0 - 5, "node": "gpu1", "from": "lent",
                    "to": "reclaiming", "outcome": "ok", "reason": "load"})
    for i in range(3):
        record_tick(journal, tick(T0 + 60 * i), CADENCE)
    journal.append({"event": "admin", "ts": T0 + 130, "node": "gpu1", "command": "pin",
                    "phase": "serving", "outcome": "ok"})
    assert [(r["event"], r.get("count", 1)) for r in journal.records()] == [
        ("transition", 1), ("admin", 1), ("tick", 3)]
    assert [r["event"] for r in journal.records(pending=False)] == ["transition", "admin"]
    assert [(r["event"], r.get("count", 1)) for r in journal.newest_first()] == [
        ("tick", 3), ("admin", 1), ("transition", 1)]
    assert [r["event"] for r in journal.newest_first((b'"tick"',))] == ["tick"]
    assert [r["event"] for r in journal.newest_first((b'"transition"',))] == ["transition"]
    # With `since` too: the pending run is always the last record.
    assert [r["event"] for r in journal.records(since=T0 + 10 * 86400)][-1] == "tick"


# --- a double-appended run ---------------------------------------------------------------------


def test_a_run_left_pending_after_its_append_is_not_counted_twice(tmp_path: Path) -> None:
    """A tick that died after appending the run but before replacing the side file leaves
    both; the next tick that ends the run sees the run is the journal's last line and does
    not append it again: the report counts 3 + 1 ticks, not 3 + 3 + 1."""
    # Regression (this was a bug in idle_runs._already_appended): the run in the side file comes from the agent's
    # TickRecord, which has no `time`, so run.to_json() has no "time" key; Journal.append adds
    # "time" to the journal line, so the comparison `last == run.to_json()` is never true and
    # the run is appended a second time (journal_facts then counts 7 ticks).
    journal = Journal(tmp_path / "journal.jsonl")
    for i in range(3):
        record_tick(journal, tick(T0 + 60 * i), CADENCE)
    pending = journal.pending_run()
    assert pending is not None
    journal.record(TickRecord.from_json(pending))  # what record_tick does first; then it died
    record_tick(journal, tick(T0 + 240, actions=1), CADENCE)  # ends the run (does not continue)
    assert [(r["ts"], r.get("count", 1)) for r in ticks_of(journal)] == [(T0, 3), (T0 + 240, 1)]
    facts = journal_facts(journal.records(), since=T0, until=T0 + HOUR_S, now=T0 + HOUR_S)
    assert facts.ticks == 4


def test_a_run_with_a_time_left_pending_after_its_append_is_not_counted_twice(tmp_path: Path) -> None:
    """The same with a run whose record carries `time` (as it reads back from the journal):
    the guard compares equal records and appends nothing."""
    journal = Journal(tmp_path / "journal.jsonl")
    for i in range(3):
        record_tick(journal, tick(T0 + 60 * i, time="2026-12-02T10:00:00Z"), CADENCE)
    pending = journal.pending_run()
    assert pending is not None and pending["time"] == "2026-12-02T10:00:00Z"
    journal.record(TickRecord.from_json(pending))
    record_tick(journal, tick(T0 + 240, errors=1), CADENCE)
    assert [(r["ts"], r.get("count", 1)) for r in ticks_of(journal)] == [(T0, 3), (T0 + 240, 1)]


def test_a_run_left_pending_after_its_append_is_not_extended(tmp_path: Path) -> None:
    """If the tick after the crash is idle and like the run (it continues it, two cadences
    after its last tick), the already-appended run must not be extended and appended again:
    the report counts the ticks written, 3 + 1, not 3 + 4."""
    # Regression (this was a bug in idle_runs.record_tick): `_already_appended` is only consulted on the path where the
    # tick does not continue the run; a continuing tick extends the side file's run, which is
    # already in the journal, and the extended run (count 4, from the same ts) is appended
    # when it ends: its 3 first ticks are counted twice.
    journal = Journal(tmp_path / "journal.jsonl")
    for i in range(3):
        record_tick(journal, tick(T0 + 60 * i, time="2026-12-02T10:00:00Z"), CADENCE)
    pending = journal.pending_run()
    assert pending is not None
    journal.record(TickRecord.from_json(pending))  # appended, then the tick died
    record_tick(journal, tick(T0 + 240), CADENCE)  # idle, alike, 2 cadences after: continues
    record_tick(journal, tick(T0 + 300, actions=1), CADENCE)  # ends whatever run is pending
    facts = journal_facts(journal.records(), since=T0, until=T0 + HOUR_S, now=T0 + HOUR_S)
    assert facts.ticks == 3 + 1 + 1


# --- report's counts ----------------------------------------------------------------------------


def tick_sequence(seed: int, n: int = 300, jitter: bool = False) -> list[TickRecord]:
    """`n` ticks a minute apart (a few seconds off with `jitter`) over several hours: long idle
    runs, a changed count now and then, a tick that acted or failed, a stopped agent."""
    rnd = random.Random(seed)
    ts = T0 + rnd.randrange(0, 3600)
    phases = {"serving": 2, "lent": 1}
    out = []
    for _ in range(n):
        roll = rnd.random()
        kw: dict[str, Any] = {}
        if roll < 0.03:
            phases = {"serving": rnd.randrange(4), "lent": rnd.randrange(4)}
        elif roll < 0.06:
            kw = {"actions": rnd.randrange(1, 3)}
        elif roll < 0.08:
            kw = {"errors": 1} if rnd.random() < 0.5 else {"error": "boom"}
        out.append(tick(ts, phases=dict(phases), **kw))
        ts += CADENCE + (rnd.uniform(-3, 3) if jitter else 0)
        if rnd.random() < 0.01:
            ts += rnd.choice([300.0, 4000.0])  # the agent stopped for a while
    return out


def folded_and_plain(tmp_path: Path, ticks: list[TickRecord]) -> tuple[Journal, Journal]:
    folded, plain = Journal(tmp_path / "folded.jsonl"), Journal(tmp_path / "plain.jsonl")
    for t in ticks:
        record_tick(folded, t, CADENCE)
        plain.append(t)
    return folded, plain


def windows(ticks: list[TickRecord], rnd: random.Random) -> list[tuple[float, float]]:
    """Periods cutting runs on tick starts, between ticks, at hours, and around everything."""
    tss = [t.ts for t in ticks]
    out = [(tss[0] - 10, tss[-1] + 10), (tss[0], tss[-1]), (tss[1], tss[-2] + 1)]
    for _ in range(30):
        a, b = sorted(rnd.sample(tss, 2))
        out.append((a, b))  # on tick boundaries
        out.append((a + 0.5, b + 17.25))  # between ticks
    hour = (tss[0] // HOUR_S + 1) * HOUR_S
    out += [(hour, hour + HOUR_S), (hour + HOUR_S, hour + 3 * HOUR_S), (tss[0], hour)]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_report_counts_every_tick_whatever_the_folding(tmp_path: Path, seed: int) -> None:
    """journal_facts(...).ticks (and tick_errors) is the number of ticks begun in the period,
    from a folded journal as from one record per tick, for periods cutting runs anywhere
    (ticks evenly spaced within a run, as the agent's cadence makes them)."""
    ticks = tick_sequence(seed)
    folded, plain = folded_and_plain(tmp_path, ticks)
    folded_records, plain_records = list(folded.records()), list(plain.records())
    assert len(folded_records) < len(plain_records) / 3  # the folding did happen
    assert sum(r.get("count", 1) for r in folded_records) == len(ticks)
    for since, until in windows(ticks, random.Random(seed)):
        want = sum(since <= t.ts < until for t in ticks)
        want_err = sum(since <= t.ts < until and t.failed for t in ticks)
        now = until + 1
        a = journal_facts(folded_records, since=since, until=until, now=now)
        b = journal_facts(plain_records, since=since, until=until, now=now)
        assert (a.ticks, a.tick_errors) == (b.ticks, b.tick_errors) == (want, want_err), (since, until)


@pytest.mark.parametrize("seed", range(4))
def test_report_counts_are_exact_at_hours_with_uneven_ticks(tmp_path: Path, seed: int) -> None:
    """Ticks a few seconds off their cadence: a run never spans an hour, so any period cut
    at hours counts exactly the ticks begun in it."""
    ticks = tick_sequence(seed, jitter=True)
    folded, _ = folded_and_plain(tmp_path, ticks)
    records = list(folded.records())
    first = ticks[0].ts // HOUR_S * HOUR_S
    for a in range(8):
        for b in range(a + 1, 9):
            since, until = first + a * HOUR_S, first + b * HOUR_S
            want = sum(since <= t.ts < until for t in ticks)
            assert journal_facts(records, since=since, until=until, now=until).ticks == want


# --- ticks_in ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("since", "until", "n"), [
    (T0, T0 + 300, 5), (T0, T0 + 240, 4), (T0, T0 + 240.001, 5), (T0 + 60, T0 + 240, 3),
    (T0 + 60.001, T0 + 240, 2), (T0 + 59.999, T0 + 60, 0), (T0 + 59.999, T0 + 60.001, 1), (T0 + 240, T0 + 241, 1),
    (T0 + 240.001, T0 + 999, 0), (T0 - 100, T0, 0), (T0 - 100, T0 + 0.001, 1),
    (T0 + 120, T0 + 120, 0), (T0 + 200, T0 + 100, 0), (T0 - 1e9, T0 + 1e9, 5),
])
def test_ticks_in_a_run_at_its_edges(since: float, until: float, n: int) -> None:
    """A run of 5 ticks at T0, +60, ..., +240: [since, until) counts the ticks begun in it,
    a tick at `since` in, one at `until` out."""
    run = TickRecord(ts=T0, duration_s=1.0, actions=0, errors=0, count=5, until=T0 + 240)
    assert run.ticks_in(since, until) == n


def test_ticks_in_a_single_tick_and_a_degenerate_run() -> None:
    """A single tick counts 1 in a period holding its start; a run without `until` (or with
    until == ts) counts whole where its start is."""
    one = tick(T0)
    assert (one.ticks_in(T0, T0 + 1), one.ticks_in(T0 - 1, T0), one.ticks_in(T0 + 0.5, T0 + 9)) == (1, 0, 0)
    for run in (replace(one, count=3), replace(one, count=3, until=T0)):
        assert (run.ticks_in(T0, T0 + 1), run.ticks_in(T0 + 0.5, T0 + 99)) == (3, 0)


def test_a_run_appended_before_a_crash_is_found_behind_the_next_ticks_steps(tmp_path: Path) -> None:
    """The tick after the crash journals its steps before its tick record: the run appended
    before the crash is no longer the last line, and must still not be appended again."""
    journal = Journal(tmp_path / "journal.jsonl")
    for i in range(3):
        record_tick(journal, tick(T0 + 60 * i), CADENCE)
    pending = journal.pending_run()
    assert pending is not None
    journal.record(TickRecord.from_json(pending))  # appended; the side file stays (a crash)
    journal.record({"event": "transition", "ts": T0 + 240, "node": "gpu1", "model": "m",
                    "action": "lend", "from": "serving", "to": "retiring", "reason": "r",
                    "outcome": "ok", "duration_s": 0.1})
    record_tick(journal, tick(T0 + 240, actions=1), CADENCE)
    assert [(r["ts"], r.get("count", 1)) for r in ticks_of(journal)] == [(T0, 3), (T0 + 240, 1)]


def test_a_one_tick_run_left_after_its_append_is_not_counted_twice(tmp_path: Path) -> None:
    """A run of one tick has no `until`: it is still recognised in the journal after a crash."""
    journal = Journal(tmp_path / "journal.jsonl")
    record_tick(journal, tick(T0), CADENCE)
    pending = journal.pending_run()
    assert pending is not None and "until" not in pending
    journal.record(TickRecord.from_json(pending))  # appended; the side file stays (a crash)
    record_tick(journal, tick(T0 + 60, actions=1), CADENCE)
    assert [(r["ts"], r.get("count", 1)) for r in ticks_of(journal)] == [(T0, 1), (T0 + 60, 1)]
