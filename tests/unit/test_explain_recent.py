"""`explain` reads only the newest events it shows (explain.read_recent, stale_in_history):
the same events, in the same order, as sorting the whole history and keeping the last N,
without reading the whole history; and the last tick, a pending idle run, says it is one."""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from slurm_idle import journal_files
from slurm_idle.explain import Event, in_event_order, read_recent, stale_in_history, stale_nodes
from slurm_idle.idle_runs import record_tick
from slurm_idle.journal import (
    AdminRecord,
    Journal,
    RouterRecord,
    TickRecord,
    TransitionRecord,
    iso,
    typed_records,
)
from slurm_idle.model import Phase

from .test_cli_explain import CONFIG, run_with_phases

T0 = 1_796_205_600.0
NODES = ("gpu1", "gpu2", "gpu3", "gpu4")
CYCLE = ("serving", "retiring", "lending", "lent", "reclaiming", "starting")


def history(seed: int, steps: int = 60, span_s: float = 900.0) -> list[dict[str, Any]]:
    """A journal as the agent writes it, in write order: per node, steps one after another,
    each journaled when it ends (its `ts` is its start, up to 3 min earlier); router calls made
    inside a step journaled before it; an admin's pin between steps; a tick a minute."""
    rnd = random.Random(seed)
    out: list[tuple[float, dict[str, Any]]] = []  # (written at, record)
    end = T0
    for node in NODES:
        t, phase = T0 + rnd.uniform(0, 600), 0
        for _ in range(rnd.randrange(steps // 2, steps)):
            dur = rnd.uniform(0.1, 180.0)
            nxt = (phase + 1) % len(CYCLE)
            outcome = rnd.choice(["ok", "ok", "ok", "waiting", "error"])
            out.append((t + dur, {"event": "transition", "ts": round(t, 3), "node": node,
                                  "model": "m", "action": "step", "from": CYCLE[phase],
                                  "to": CYCLE[nxt], "reason": f"r{len(out)}",
                                  "outcome": outcome, "duration_s": round(dur, 3)}))
            if rnd.random() < 0.5:
                at = t + rnd.uniform(0, dur)
                out.append((at, {"event": "router", "ts": round(at, 3), "node": node,
                                 "router": "h", "call": rnd.choice(["add", "remove"]),
                                 "reason": "x", "outcome": "ok"}))
            if outcome == "ok":
                phase = nxt
            t += dur + rnd.uniform(1.0, span_s)
            if rnd.random() < 0.1:
                out.append((t - 0.5, {"event": "admin", "ts": round(t - 0.5, 3), "node": node,
                                      "command": rnd.choice(["pin", "unpin"]),
                                      "phase": CYCLE[phase], "outcome": "ok"}))
        end = max(end, t)
    for k in range(int((end - T0) // 60)):
        out.append((T0 + 60 * k + 0.25, {"event": "tick", "ts": T0 + 60 * k + 0.25,
                                         "duration_s": 1.0, "actions": 0, "errors": 0}))
    out.sort(key=lambda w: w[0])
    return [r for _, r in out]


def write_journal(path: Path, records: list[dict[str, Any]]) -> Journal:
    """Lines straight to the file (what Journal.append writes, much faster for big ones)."""
    with path.open("w") as fh:
        for r in records:
            fh.write(json.dumps({"time": iso(r["ts"]), **r}) + "\n")
    return Journal(path)


def whole_file(journal: Journal, wanted: Callable[[Event], bool]) -> list[Event]:
    """The method explain used before read_recent: every event of the history, in event order."""
    return in_event_order(r for r in typed_records(journal.records())
                          if isinstance(r, TransitionRecord | RouterRecord | AdminRecord)
                          and wanted(r))


WANTED: dict[str, Callable[[Event], bool]] = {
    "all": lambda e: True,
    "gpu2": lambda e: e.node == "gpu2",
    "gpu1 or gpu4": lambda e: e.node in ("gpu1", "gpu4"),
    "router": lambda e: isinstance(e, RouterRecord),
    "nothing": lambda e: False,
}


@pytest.mark.parametrize("seed", range(5))
def test_read_recent_is_the_last_n_of_the_whole_history(tmp_path: Path, seed: int) -> None:
    """For journals written out of time order by up to 3 minutes, read_recent's events are
    the whole-file method's last N, for N from 1 to more than there are, for any filter; its
    last tick is the journal's last tick record."""
    journal = write_journal(tmp_path / "journal.jsonl", history(seed))
    ticks = [r for r in typed_records(journal.records()) if isinstance(r, TickRecord)]
    for name, wanted in WANTED.items():
        every = whole_file(journal, wanted)
        assert name == "nothing" or len(every) > 20
        for last in (1, 2, 5, 17, len(every), len(every) + 3):
            got = read_recent(journal, wanted, last)
            assert got.events == every[-last:], (name, last)
            assert got.last_tick == ticks[-1]


def test_read_recent_finds_an_event_written_long_after_its_time(tmp_path: Path) -> None:
    """An event written first but with the newest time is found behind ten newer lines
    holding older times (the reading goes on LAG_S past the N-th newest)."""
    lines = [{"event": "transition", "ts": T0 + 500, "node": "gpu1", "from": "lent",
              "to": "reclaiming", "outcome": "ok", "reason": "late"}]
    lines += [{"event": "router", "ts": T0 + i, "node": "gpu2", "router": "h", "call": "add",
               "outcome": "ok", "reason": f"r{i}"} for i in range(10)]
    journal = write_journal(tmp_path / "journal.jsonl", lines)
    got = read_recent(journal, lambda e: True, 2)
    assert [(type(e).__name__, e.ts) for e in got.events] == [
        ("RouterRecord", T0 + 9), ("TransitionRecord", T0 + 500)]
    assert got.last_tick is None


def test_read_recent_keeps_the_journal_order_of_events_of_one_instant(tmp_path: Path) -> None:
    """Events with the same `ts` (a frozen clock, or two records of one millisecond) are
    shown in the journal's order, as in_event_order promises and as the whole-file method
    did, and the N kept are the last written."""
    # Regression (this was a bug in explain.read_recent): `events` is collected newest first and then sorted by ts with
    # a stable sort, so events of one instant come out in *reverse* journal order
    # (in_event_order(events)[-last:] with events reversed): here [router, transition]
    # instead of [transition, router], and -n 1 shows the transition instead of the router.
    lines = [{"event": "transition", "ts": T0, "node": "gpu1", "from": "lent",
              "to": "reclaiming", "outcome": "ok", "reason": "first"},
             {"event": "router", "ts": T0, "node": "gpu1", "router": "h", "call": "remove",
              "outcome": "ok", "reason": "second"}]
    journal = write_journal(tmp_path / "journal.jsonl", lines)
    def reasons(events: list[Event]) -> list[str]:
        return [e.reason for e in events if not isinstance(e, AdminRecord)]

    assert reasons(whole_file(journal, WANTED["all"])) == ["first", "second"]
    assert reasons(read_recent(journal, WANTED["all"], 5).events) == ["first", "second"]
    assert reasons(read_recent(journal, WANTED["all"], 1).events) == ["second"]


class CountingParse:
    """journal_files.parse, counting the lines it is given."""

    def __init__(self) -> None:
        self.calls = 0
        self._parse = journal_files.parse

    def __call__(self, line: bytes) -> dict[str, Any] | None:
        self.calls += 1
        return self._parse(line)


def big_history(tmp_path: Path, days: int = 12) -> tuple[Journal, int]:
    """An event and a tick a minute for `days` days, the first half in a rotated .1.gz, the
    rest live (several MiB: many blocks); returns the journal and its number of events."""
    lines: list[dict[str, Any]] = []
    for k in range(days * 1440):
        lines.append({"event": "transition" if k % 3 else "router", "ts": T0 + 60 * k,
                      "node": NODES[k % 4], "from": "serving", "to": "retiring", "outcome": "ok",
                      "router": "h", "call": "add", "reason": "padding " * 8})
        lines.append({"event": "tick", "ts": T0 + 60 * k + 1, "duration_s": 1.0, "actions": 1,
                      "errors": 0})
    half = len(lines) // 2
    rotated = write_journal(tmp_path / "rotated.tmp", lines[:half]).path
    (tmp_path / "journal.jsonl.1.gz").write_bytes(gzip.compress(rotated.read_bytes()))
    rotated.unlink()
    return write_journal(tmp_path / "journal.jsonl", lines[half:]), days * 1440


def test_read_recent_does_not_read_the_whole_history(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On 12 days of an event and a tick a minute, `explain -n 5` parses about a day of
    events (the LAG_S it must look past the 5th newest) and one tick, and never opens the
    rotated sibling."""
    journal, total = big_history(tmp_path)
    assert journal.path.stat().st_size > 2 * journal_files.BLOCK
    counting = CountingParse()
    monkeypatch.setattr(journal_files, "parse", counting)
    opened: list[str] = []
    real_open = journal_files.open_history_file

    def open_history_file(path: Path) -> IO[bytes]:
        opened.append(path.name)
        return real_open(path)

    monkeypatch.setattr(journal_files, "open_history_file", open_history_file)
    got = read_recent(journal, WANTED["all"], 5)
    assert [e.ts for e in got.events] == [T0 + 60 * k for k in range(total - 5, total)]
    assert got.last_tick is not None and got.last_tick.ts == T0 + 60 * (total - 1) + 1
    assert 1440 < counting.calls < 1440 + 200 < total / 10
    assert opened == []
    # A filter that keeps only gpu1's and gpu4's events still stops a day past its 5th newest.
    counting.calls = 0
    got = read_recent(journal, WANTED["gpu1 or gpu4"], 5)
    assert len(got.events) == 5 and counting.calls < 1440 + 200


# --- stale nodes -------------------------------------------------------------------------------


def phases_now(rnd: random.Random) -> dict[str, str]:
    return {n: rnd.choice(CYCLE) for n in (*NODES, "gpu9")}


@pytest.mark.parametrize("seed", range(5))
def test_stale_in_history_names_the_nodes_stale_nodes_names(tmp_path: Path, seed: int) -> None:
    """For the events shown (the last N) and the nodes' phases now, stale_in_history names
    the same nodes, with the same journal phase, as stale_nodes over every event of the
    history: a node without a phase among the shown events is looked up further back."""
    journal = write_journal(tmp_path / "journal.jsonl", history(seed))
    rnd = random.Random(seed)
    for name in ("all", "gpu2"):  # as explain filters: every node, or the one asked about
        wanted = WANTED[name]
        every = whole_file(journal, wanted)
        for last in (1, 3, 10, len(every)):
            shown = read_recent(journal, wanted, last).events
            for _ in range(3):
                phases = phases_now(rnd)
                if name == "gpu2":
                    phases = {"gpu2": phases["gpu2"]}
                want = stale_nodes(every, phases)
                got = stale_in_history(journal, shown, phases)
                assert [(s.node, s.journal_phase, s.phase) for s in got] == [
                    (s.node, s.journal_phase, s.phase) for s in want], (name, last, phases)
                assert all(s.node != "gpu9" for s in got)  # no records: nothing to predate


def test_stale_in_history_names_a_nodes_last_record(tmp_path: Path) -> None:
    """A node not among the shown events: its `last record` is its last record in the
    history (a router call after its last step), as stale_nodes over the whole history says."""
    # Regression (this was a bug in explain.stale_in_history): for a node looked up further back, only its newest
    # phase-bearing record (transition/admin, PHASE_NEEDLES) is read, so last_record_ts is
    # that step's ts (4001.0), not the router call's after it (4002.0) that stale_nodes over
    # the whole history (the explain before read_recent) reports in `journal_predates`.
    lines = [{"event": "transition", "ts": 4001.0, "node": "gpu1", "from": "starting",
              "to": "serving", "outcome": "ok", "reason": "engine up"},
             {"event": "router", "ts": 4002.0, "node": "gpu1", "router": "h", "call": "add",
              "outcome": "ok", "reason": "engine healthy"},
             {"event": "transition", "ts": 5000.0, "node": "gpu2", "from": "serving",
              "to": "retiring", "outcome": "ok", "reason": "idle"}]
    journal = write_journal(tmp_path / "journal.jsonl", lines)
    phases = {"gpu1": "unknown", "gpu2": "retiring"}
    shown = read_recent(journal, WANTED["all"], 1).events
    assert [e.node for e in shown] == ["gpu2"]
    want = stale_nodes(whole_file(journal, WANTED["all"]), phases)
    assert [s.to_json() for s in want] == [{"node": "gpu1", "last_record_ts": 4002.0,
                                            "journal_phase": "serving", "phase": "unknown"}]
    assert stale_in_history(journal, shown, phases) == want


def test_stale_in_history_reads_nothing_when_the_shown_events_say_every_phase(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node of `phases` has a phase among the shown events: nothing more is read."""
    journal, _ = big_history(tmp_path, days=1)
    shown = read_recent(journal, WANTED["all"], 8).events
    counting = CountingParse()
    monkeypatch.setattr(journal_files, "parse", counting)
    stale = stale_in_history(journal, shown, {"gpu1": "retiring", "gpu2": "lent"})
    assert counting.calls == 0
    assert [(s.node, s.journal_phase) for s in stale] == [("gpu2", "retiring")]


# --- the CLI -------------------------------------------------------------------------------------


def idle_run_journal(tmp_path: Path) -> Path:
    """gpu1 started serving, then the agent ticked idle for 5 minutes: a pending run of 6
    ticks (written as the agent writes them, through idle_runs.record_tick)."""
    journal = write_journal(tmp_path / "j.jsonl", [
        {"event": "transition", "ts": T0 - 30, "node": "gpu1", "from": "starting",
         "to": "serving", "outcome": "ok", "reason": "engine up"}])
    for i in range(6):
        record_tick(journal, TickRecord(ts=T0 + 60 * i, duration_s=0.5, actions=0, errors=0,
                                        phases={"serving": 2}, needed={"m": 1},
                                        serving={"m": 2}), 60.0)
    assert journal.pending_path.exists()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(journal=journal.path))
    return cfg


def test_explain_json_reports_the_pending_idle_run_as_the_last_tick(tmp_path: Path) -> None:
    """`explain -n 3 --json` with an idle run pending: last_tick is the run, with its count,
    its first tick's ts and time, and its last tick's start as `until`."""
    cfg = idle_run_journal(tmp_path)
    doc = json.loads(run_with_phases(cfg, {"gpu1": Phase.SERVING}, "-n", "3", "--json"))
    assert [t["reason"] for t in doc["transitions"]] == ["engine up"]
    tick = doc["last_tick"]
    assert (tick["count"], tick["ts"], tick["until"]) == (6, T0, T0 + 300)
    assert tick["until_time"] == "2026-12-02T10:05:00Z"
    # Regression (this was a bug in idle_runs._write_pending / Journal.pending_run): the side file holds the agent's
    # TickRecord.to_json(), which has no "time" (only Journal.append adds it), so a pending
    # run's last_tick lacks the "time" every journaled tick has.
    assert tick.get("time") == "2026-12-02T10:00:00Z"


def test_explain_text_says_the_last_tick_is_one_of_a_run(tmp_path: Path) -> None:
    """The text ends with the last tick's start and the run it belongs to, since its first."""
    # Regression (this was a bug in cli/tick_cmd.py explain, with idle_runs._write_pending): t.time is None for the
    # pending run (see the JSON test), so the line reads "... alike since None)".
    cfg = idle_run_journal(tmp_path)
    out = run_with_phases(cfg, {"gpu1": Phase.SERVING}, "-n", "3").splitlines()
    assert out[-1].startswith("last tick 2026-12-02T10:05:00Z (the last of 6 idle ticks alike since ")
    assert out[-1].startswith("last tick 2026-12-02T10:05:00Z (the last of 6 idle ticks alike "
                              "since 2026-12-02T10:00:00Z): needed {'m': 1}, serving {'m': 2}, "
                              "0 action(s), 0 error(s)")


def test_explain_text_for_a_journaled_run(tmp_path: Path) -> None:
    """A run already appended to the journal (ended by an acting tick, which is then the
    last tick) and a single last tick say no run."""
    cfg = idle_run_journal(tmp_path)
    journal = Journal(tmp_path / "j.jsonl")
    record_tick(journal, TickRecord(ts=T0 + 360, duration_s=0.5, actions=1, errors=0), 60.0)
    assert not journal.pending_path.exists()
    out = run_with_phases(cfg, {"gpu1": Phase.SERVING}, "-n", "3").splitlines()
    assert out[-1] == "last tick 2026-12-02T10:06:00Z: needed {}, serving {}, 1 action(s), 0 error(s)"
    runs = [r for r in journal.records() if r.get("count")]
    assert [(r["count"], r["time"]) for r in runs] == [(6, "2026-12-02T10:00:00Z")]

