"""The day's phases record: written once a UTC day, and where readers looking for a node that
never stepped stop instead of reading the whole history."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from slurm_idle import journal_files
from slurm_idle.explain import stale_in_history
from slurm_idle.journal import Journal, PhasesRecord, TransitionRecord, typed_records
from slurm_idle.journal_snapshots import day_path, snapshot_if_new_day
from slurm_idle.model import ModelLoad
from slurm_idle.report_io import window_records

from .test_agent import make_agent

T0 = 1_796_205_600.0  # 2026-12-02T10:00:00Z
DAY = 86400.0


def phases_records(journal: Journal) -> list[PhasesRecord]:
    return [r for r in typed_records(journal.records()) if isinstance(r, PhasesRecord)]


def test_one_phases_record_a_utc_day(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    assert snapshot_if_new_day(journal, {"gpu1": "serving"}, T0)
    assert not snapshot_if_new_day(journal, {"gpu1": "lent"}, T0 + 3600)
    assert not snapshot_if_new_day(journal, {"gpu1": "lent"}, T0 + 13 * 3600)  # 23:00 UTC
    assert snapshot_if_new_day(journal, {"gpu1": "lent"}, T0 + 14 * 3600)  # the next day
    assert [(r.ts, r.nodes) for r in phases_records(journal)] == [
        (T0, {"gpu1": "serving"}), (T0 + 14 * 3600, {"gpu1": "lent"})]


def test_a_day_file_that_cannot_be_read_means_a_new_record(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    day_path(journal).write_text("not a day\n")
    assert snapshot_if_new_day(journal, {"gpu1": "serving"}, T0)
    assert day_path(journal).read_text().strip() == str(int(T0 // DAY))


def test_the_agents_first_tick_of_a_day_journals_every_nodes_phase(tmp_path: Path) -> None:
    agent, *_ = make_agent(tmp_path)
    agent.metrics.models = {"m": ModelLoad(model="m")}
    agent.tick()
    agent.tick()
    records = phases_records(Journal(Path(agent.config.paths.journal)))
    assert len(records) == 1
    assert set(records[0].nodes) == {v.name for v in agent.observe().nodes}


def _old_history(tmp_path: Path) -> Journal:
    """A damaged old rotated file (reading it would warn), a step of gpu1 in it, then a day's
    phases record naming gpu1 and gpu5, then a year of nothing about them."""
    (tmp_path / "journal.jsonl.1.gz").write_bytes(gzip.compress(b'{"event": "tick"')[:10])
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append(PhasesRecord(ts=T0, nodes={"gpu1": "lent", "gpu5": "serving"}))
    for d in range(1, 30):
        journal.append({"event": "tick", "ts": T0 + d * DAY, "duration_s": 1.0, "actions": 0,
                        "errors": 0})
    return journal


def test_report_finds_a_never_stepped_nodes_phase_in_the_days_record(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = _old_history(tmp_path)
    with caplog.at_level("WARNING", logger="slurm_idle.journal"):
        _records, before = window_records(journal, T0 + 20 * DAY, ["gpu1", "gpu5"])
    assert before == {"gpu1": "lent", "gpu5": "serving"}
    assert "journal.jsonl.1.gz" not in caplog.text  # stopped at the record: the old file unread


def test_explain_names_a_node_whose_days_record_disagrees_with_slurm(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = _old_history(tmp_path)
    shown = [TransitionRecord(ts=T0 + 29 * DAY, node="gpu2", model="m", action="lend",
                              from_phase="serving", to_phase="retiring", reason="r",
                              outcome="ok", duration_s=1.0)]
    with caplog.at_level("WARNING", logger="slurm_idle.journal"):
        stale = stale_in_history(journal, shown, {"gpu1": "serving", "gpu2": "retiring",
                                                  "gpu5": "serving"})
    assert [(n.node, n.journal_phase, n.phase, n.last_record_ts) for n in stale] == [
        ("gpu1", "lent", "serving", T0)]
    assert "journal.jsonl.1.gz" not in caplog.text


def test_without_a_days_record_the_search_reads_on(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The record is what stops it: without one, the damaged old file is reached (and skipped)."""
    journal = _old_history(tmp_path)
    lines = [ln for ln in journal.path.read_text().splitlines() if '"phases"' not in ln]
    journal.path.write_text("\n".join(lines) + "\n")
    with caplog.at_level("WARNING", logger="slurm_idle.journal"):
        _records, before = window_records(journal, T0 + 20 * DAY, ["gpu1", "gpu5"])
    assert before == {}
    assert "journal.jsonl.1.gz" in caplog.text
    assert journal_files.history(journal.path)[0].name == "journal.jsonl.1.gz"
