"""What the web view shows a person: local readable times, log stamps rewritten for display,
the outlook's "unknown" and the best time's "-" explained, the viewer's jobs first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import parse_config
from slurm_idle.web.display import age, human_time, log_pieces, shown_log, zone_name
from slurm_idle.web.outlook import NO_HISTORY, best_time_note, unknown_note

NOW = 1796661000.0  # 2026-12-07T16:30:00Z: 17:30 in Berlin (CET)


def test_times_are_the_sites_local_time_with_the_day_unless_today() -> None:
    """Berlin is UTC+1 in December; the page's own day shows a clock time only."""
    assert human_time("2026-12-07T16:30:00Z", "Europe/Berlin", NOW) == "17:30"
    assert human_time(NOW - 20 * 3600, "Europe/Berlin", NOW) == "Sun 6 Dec 21:30"
    assert human_time(NOW + 7 * 3600, "Europe/Berlin", "2026-12-07T16:30:00Z") == "Tue 8 Dec 00:30"
    assert human_time(NOW, "UTC", seconds=True) == "Mon 7 Dec 16:30:00"
    assert human_time(None, "UTC") == "-" and human_time("", "UTC", NOW) == "-"
    assert zone_name("Europe/Berlin", NOW) == "Europe/Berlin (CET)"
    assert zone_name("UTC", NOW) == "UTC" and zone_name("Europe/Berlin", None) == "Europe/Berlin"


def test_log_stamps_become_local_times_and_keep_the_raw_stamp() -> None:
    """The runner's `t=<epoch>.1` and the demo's `t=<epoch>` read as local times; the text
    around them is kept; the raw stamp and an ISO time ride along for the page."""
    line = f"slurm-idle-run: SIGTERM (preemption) t={NOW - 240:.1f}"
    pieces = log_pieces(line, "Europe/Berlin", NOW)
    assert [p.text for p in pieces] == ["slurm-idle-run: SIGTERM (preemption) ", "t=17:26:00"]
    assert pieces[1].raw == "t=1796660760.0" and pieces[1].iso == "2026-12-07T17:26:00+01:00"
    assert shown_log(f"start t={NOW:.0f}: go t={NOW - 86400:.0f}.", "UTC", NOW) == \
        "start t=16:30:00: go t=Sun 6 Dec 16:30:00."


@pytest.mark.parametrize("line", ["step=1796661000", "at=1796661000", "t=179666100",
                                  "t=17966610001", "t=x1796661000", "plain text", "",
                                  "t=1796661000x", "a.t=1796661000"])
def test_anything_but_a_stamp_is_left_as_it_is(line: str) -> None:
    """Another key, a counter of other length, a stamp inside a word: not rewritten."""
    assert shown_log(line, "UTC", NOW) == line


def test_age_reads_as_a_person_says_it() -> None:
    assert [age(None), age(40), age(720), age(12600)] == ["-", "40 s", "12 min", "3.5 h"]


def rows(*lendable: int | None) -> list[dict[str, Any]]:
    return [{"t": NOW + h * 3600, "lendable_gpus": v} for h, v in enumerate(lendable)]


def test_unknown_hours_are_explained_with_the_history_needed() -> None:
    """No note when every hour is known; else how many and why: the cause when no history
    could be read, else too little of it (24 hours needed)."""
    assert unknown_note(rows(4, 8)) is None
    assert unknown_note(rows(None, None)) == f"unknown (every hour): {NO_HISTORY}"
    assert "24 hours of demand history" in NO_HISTORY
    assert unknown_note(rows(None, 4, 8), "metrics.source is scrape: x") == \
        "unknown (1 of 3 hours): metrics.source is scrape: x"


def test_the_best_time_says_what_it_offers_or_why_there_is_none() -> None:
    """The GPUs it offers; "-" with no forecast, and why; none lendable said as such."""
    assert best_time_note(rows(None, 4, 8)) == "8 GPUs expected lendable then"
    assert best_time_note(rows(1)) == "1 GPU expected lendable then"
    assert best_time_note(rows(None, None, None)) == \
        "no forecast for the next 2 hours: less than 24 hours of demand history"
    assert best_time_note(rows(None), "Prometheus did not answer (x)").endswith("(x)")
    assert best_time_note(rows(0, 0)) == ("no GPU expected lendable in the next hour: the demand "
                                          "then a day or a week ago, or the serving floors, keep "
                                          "every GPU serving")


CONFIG = """
engine: {kind: command, start_command: "true", stop_command: "true"}
models: [{name: m, nodes: gpu1}]
"""


def test_the_history_says_why_it_is_missing() -> None:
    """A scrape source has no history to read; a failing Prometheus is named; an answer with
    nothing in it is no cause (too little history, said by the note)."""
    from slurm_idle.web.data import LiveData

    class Live(LiveData):
        answer: Any = None

        def _prom(self, cfg: Any) -> Any:
            if cfg.metrics.source == "scrape":
                return None
            prom = type("P", (), {"custom_query": lambda s, q, params: self.answer()})()
            return prom, type("Q", (), {"demand": lambda s: "d"})()

    live = Live(None, state_root=Path("/nonexistent"))
    scrape = parse_config(CONFIG + "metrics: {source: scrape}\n")
    assert live._demand_history(scrape, NOW) == (
        {}, "metrics.source is scrape: only Prometheus keeps the demand history the outlook reads")
    prom = parse_config(CONFIG)

    def refused() -> Any:
        raise OSError("connection refused")

    live.answer = refused
    history, cause = live._demand_history(prom, NOW)
    assert history == {} and cause is not None and "connection refused" in cause
    live.answer = list
    assert live._demand_history(prom, NOW) == ({}, None)


def test_the_viewers_jobs_come_first_in_job_id_order(tmp_path: Path) -> None:
    """Rows in job id (submission) order, the viewer's moved ahead; no viewer: id order."""
    from slurm_idle.testing.webview import SampleData

    data = SampleData(tmp_path)
    order = [(r["user"], r["job_id"]) for r in data.jobs(None, "alice")["jobs"]]
    assert order[:2] == [("alice", 4107), ("alice", 4122)] and order[-2:] == [("bob", 4102),
                                                                             ("carol", 4111)]
    assert [r["user"] for r in data.jobs(None, None)["jobs"]][:3] == ["bob", "alice", "carol"]
    doc = data.jobs("bob", "alice")
    assert (doc["viewer"], doc["logs_shown_to"]) == ("alice", "owner")
    assert [r["log_tail"] for r in doc["jobs"]] == [[]]
