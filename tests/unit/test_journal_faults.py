"""A bad journal line, or a journal that cannot be written, never stops the tool: readers
skip and count bad lines; a failed write (disk full) is logged and the service action goes on."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from slurm_idle import runlog, safefiles
from slurm_idle.journal import Journal
from slurm_idle.lifecycle import format_lent_comment
from slurm_idle.model import Action, ActionKind, Phase

from .test_agent import T0, make_agent, phases

BAD_LINES = (b'{"event": "\xff\xfe"}\n'  # not UTF-8
             + b"[" * 100_000 + b"]" * 100_000 + b"\n")  # RecursionError in json.loads


def test_bad_lines_are_skipped_and_counted_once(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Non-UTF-8 bytes and a line nested past the parser's depth are skipped; one warning."""
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b'{"event": "a"}\n' + BAD_LINES + b'{"event": "b"}\n{"event": "torn')
    with caplog.at_level(logging.WARNING, logger="slurm_idle"):
        events = [r["event"] for r in Journal(path).records()]
    assert events == ["a", "b"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"journal {path}: skipped 2 malformed line(s)"]


def test_the_job_ledger_skips_bad_lines(tmp_path: Path) -> None:
    """A non-UTF-8 or too deeply nested line in a job's ledger loses that line only."""
    runlog.append(tmp_path, 7, {"event": "start", "run": 1}, cluster="c")
    with runlog.ledger_path(tmp_path, 7, "c").open("ab") as fh:
        fh.write(BAD_LINES + json.dumps({"event": "end", "run": 1}).encode() + b"\n")
    assert [r["event"] for r in runlog.read(tmp_path, 7, "c")] == ["start", "end"]


def test_a_full_disk_does_not_stop_a_reclaim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Every journal write fails with ENOSPC: the reclaim still walks to serving, the tick
    does not fail, and the lost records are logged as errors."""
    agent, slurm, engine, _, _ = make_agent(tmp_path)
    slurm.node_map["gpu1"] = slurm.node_map["gpu1"].__class__(
        name="gpu1", state="mixed", comment=format_lent_comment("slurm-idle", T0))
    engine.up["gpu1"] = False
    reclaim = Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")
    agent.planner = lambda obs, cfg, now: [reclaim] if phases(agent)["gpu1"] is Phase.LENT else []

    def full(path: object, data: bytes, dir_mode: int = 0o755) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safefiles, "append_line", full)
    with caplog.at_level(logging.ERROR, logger="slurm_idle"):
        result = agent.tick()
    assert result.error is None
    assert [s.to_phase for s in result.steps] == [Phase.RECLAIMING, Phase.STARTING, Phase.SERVING]
    assert phases(agent)["gpu1"] is Phase.SERVING
    assert any("No space left on device" in r.getMessage() for r in caplog.records)


def test_threads_creating_the_journal_directory_at_once_all_append(tmp_path: Path) -> None:
    """A first tick lends nodes in parallel into a state directory nothing made yet (a cron
    install): each thread's walk may find it missing, one mkdir wins, none may fail."""
    import threading

    for attempt in range(200):
        target = tmp_path / f"try{attempt}" / "state" / "journal.jsonl"
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def append(i: int, target: Path = target, errors: list[BaseException] = errors,
                   start: threading.Barrier = start) -> None:
            start.wait()
            try:
                safefiles.append_line(target, f"{i}\n".encode())
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)

        threads = [threading.Thread(target=append, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert sorted(target.read_text().split()) == ["0", "1", "2", "3"]
