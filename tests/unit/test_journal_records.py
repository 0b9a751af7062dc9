"""The journal's records are dataclasses shared by the writers and the readers (explain, report):
what the agent writes reads back as the same record, and the module's documented shape names
exactly the outcomes the enum has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurm_idle import journal as journal_module
from slurm_idle.journal import (
    AdminRecord,
    DuplicateJobRecord,
    JobAction,
    JobRecord,
    Journal,
    JournalRecord,
    RouterOutcome,
    RouterRecord,
    StepOutcome,
    TickRecord,
    TransitionRecord,
    parse_record,
)
from slurm_idle.model import Phase
from slurm_idle.report import journal_facts
from slurm_idle.transitions import StepResult

T0 = 1_796_205_600.0

RECORDS: list[JournalRecord] = [
    TransitionRecord(ts=T0, node="gpu1", model="m", action="reclaim", from_phase="lent",
                     to_phase="reclaiming", reason="load", outcome=StepOutcome.OK, duration_s=0.5),
    TransitionRecord(ts=T0 + 1, node="gpu6", model="m", action="lend", from_phase="retiring",
                     to_phase="lending", reason="idle", outcome=StepOutcome.WAITING,
                     duration_s=9.0, detail="requests in flight", nodes=("gpu6", "gpu7")),
    TransitionRecord(ts=T0 + 2, node="gpu2", model="m", action="reclaim", from_phase="lent",
                     to_phase="reclaiming", reason="load", outcome=StepOutcome.ERROR,
                     duration_s=0.1, error="scontrol failed"),
    TickRecord(ts=T0, duration_s=1.25, actions=2, errors=1, phases={"serving": 2, "lent": 1},
               needed={"m": 2}, serving={"m": 2}, error="metrics unavailable"),
    JobRecord(ts=T0, node="gpu1", job_id=42, kind="container", action=JobAction.REQUEUED,
              detail="grace over"),
    RouterRecord(ts=T0, node="gpu1", model="m", router="haproxy", call="remove", reason="idle",
                 outcome=RouterOutcome.OK, duration_s=0.01),
    RouterRecord(ts=T0, node="gpu1", model="m", router="haproxy", call="add", reason="back",
                 outcome=RouterOutcome.ERROR, error="socket gone"),
    RouterRecord(ts=T0, node="gpu5", model="m", router="haproxy", call="remove", reason="idle",
                 outcome=RouterOutcome.OK, duration_s=0.02, replica="gpu5:8001"),
    AdminRecord(ts=T0, node="gpu1", command="pin", phase="serving", outcome=StepOutcome.OK,
                detail="pinned"),
    DuplicateJobRecord(ts=T0, replica="m-0", model="m", kept=41, cancelled=(42, 43)),
    DuplicateJobRecord(ts=T0, replica="m-1", model="m", kept=44, cancelled=(45,),
                       error="scancel: Invalid job id"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_reads_back_as_written(tmp_path: Path, record: JournalRecord) -> None:
    """A record appended to the journal parses back equal to itself (with its derived `time`)."""
    journal = Journal(tmp_path / "j.jsonl")
    journal.append(record)
    (back,) = list(journal.typed())
    assert back == type(record)(**{**record.__dict__, "time": back.time})
    assert back.time == "2026-12-02T10:00:00Z" or back.ts != T0


def test_step_result_journals_the_documented_transition_shape() -> None:
    """StepResult.record() is the TransitionRecord's JSON: same keys, same order as before."""
    step = StepResult("gpu1", "m", "reclaim", Phase.LENT, Phase.RECLAIMING, "load", "waiting",
                      T0, 1.23456, detail="jobs still on the node")
    assert step.outcome is StepOutcome.WAITING
    assert list(step.record()) == ["event", "ts", "node", "model", "action", "from", "to",
                                   "reason", "outcome", "duration_s", "detail"]
    assert step.record()["outcome"] == "waiting" and step.record()["duration_s"] == 1.235
    assert parse_record(step.record()) == step.to_record().__class__(
        **{**step.to_record().__dict__, "duration_s": 1.235})


def test_documented_outcomes_are_exactly_the_enum() -> None:
    """The module's description of a transition lists every StepOutcome and nothing else."""
    doc = journal_module.__doc__ or ""
    line = next(ln for ln in doc.splitlines() if '"outcome": "ok"' in ln and "waiting" in ln)
    documented = set(re.findall(r'"([a-z-]+)"', line.split('"outcome":', 1)[1]))
    assert documented == {o.value for o in StepOutcome}


def test_foreign_or_malformed_lines_are_skipped_by_every_reader() -> None:
    """Records without a numeric ts, of another event, or without their keys parse to None."""
    assert parse_record({"event": "transition", "node": "gpu1", "from": "a", "to": "b"}) is None
    assert parse_record({"event": "tick", "ts": True}) is None
    assert parse_record({"event": "something-else", "ts": T0}) is None
    assert parse_record({"event": "transition", "ts": T0, "node": 3, "from": "a", "to": "b"}) is None
    unknown = parse_record({"event": "transition", "ts": T0, "node": "gpu1", "from": "a",
                            "to": "b", "outcome": "timeout"})
    assert isinstance(unknown, TransitionRecord) and unknown.outcome == "timeout"


def test_report_reads_the_same_records() -> None:
    """report.journal_facts counts ticks and lends from the typed records the agent writes."""
    records = [
        TickRecord(ts=T0, duration_s=1, actions=1, errors=0).to_json(),
        TickRecord(ts=T0 + 60, duration_s=1, actions=0, errors=0, error="boom").to_json(),
        TransitionRecord(ts=T0 + 1, node="gpu1", model="m", action="lend", from_phase="lending",
                         to_phase="lent", reason="idle", outcome=StepOutcome.OK,
                         duration_s=1).to_json(),
        TransitionRecord(ts=T0 + 2, node="gpu2", model="m", action="lend", from_phase="lending",
                         to_phase="lent", reason="idle", outcome=StepOutcome.SKIPPED,
                         duration_s=1).to_json(),
    ]
    facts = journal_facts(records, since=T0, until=T0 + 3600, now=T0 + 3600)
    assert (facts.ticks, facts.tick_errors, facts.lends) == (2, 1, 1)
