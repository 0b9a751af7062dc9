"""The web view: routes render the documents they are given, read-only, nothing from elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

from slurm_idle.config import parse_config
from slurm_idle.report import PhaseInterval
from slurm_idle.web import create_app
from slurm_idle.web.data import LiveData, PoolData
from slurm_idle.web.outlook import best_time, outlook, timeline

pytest.importorskip("flask")

CONFIG = """
engine:
  kind: command
  start_command: "true"
  stop_command: "true"
models:
  - name: m
    gpus_per_replica: 4
    tokens_per_s_per_replica: 1000
    min_serving_replicas: 1
    nodes: gpu[1-4]
"""

POOL = {
    "generated_at": "2026-12-03T08:00:00Z",
    "nodes": [{"name": "gpu1", "phase": "serving", "phase_since_iso": "2026-12-03T07:00:00Z",
               "gpus_total": 4, "gpus_used": 0, "slurm_state": "IDLE+DRAIN", "jobs": [],
               "model": "m", "pinned": False},
              {"name": "gpu2", "phase": "lent", "phase_since_iso": None, "gpus_total": 4,
               "gpus_used": 1, "slurm_state": "MIXED", "jobs": [7], "model": "m",
               "pinned": False}],
    "models": [], "errors": [],
    "lent_gpu_hours": {"today": 3.5, "week": 40.0}, "gpu_hours_used": {"today": 1, "week": 9},
    "timeline": {"t": [0.0, 600.0], "serving_gpus": [4, 4], "lent_gpus": [4, 4],
                 "demand_tokens_per_s": [10.0, None]},
    "outlook": [{"t": 0.0, "time": "2026-12-03T08:00:00Z", "lendable_gpus": 12,
                 "demand_tokens_per_s": {"m": 5.0}}],
    "best_time_to_submit": "2026-12-03T08:00:00Z",
}
JOBS = {
    "generated_at": "2026-12-03T08:00:00Z", "user": None, "users": ["alice"], "errors": [],
    "jobs": [{"job_id": 7, "name": "<b>train</b>", "user": "alice", "state": "RUNNING",
              "restarts": 1, "preemptions": 1, "failures": 0, "node": "gpu2", "gpus": 1,
              "checkpoint_age_s": 12.0, "pipeline": None, "step": None, "reason": "",
              "log": None, "gpu_hours": 0.5, "lost_gpu_hours": 0.1,
              "log_tail": ["step=3", "<script>alert(1)</script>"]}],
    "pipelines": [{"pipeline": "p", "attempt": 1, "params": {}, "submitted_at":
                   "2026-12-03T07:00:00Z", "steps": [], "svg": "<svg class=\"dag\"></svg>"}],
}


class FakeData:
    def __init__(self) -> None:
        self.users: list[str | None] = []

    def pool(self) -> dict[str, Any]:
        return POOL

    def jobs(self, user: str | None = None, viewer: str | None = None) -> dict[str, Any]:
        self.users.append(user)
        return JOBS


def client() -> tuple[Any, FakeData]:
    data = FakeData()
    typed: PoolData = data  # the fake conforms to the protocol the app needs
    return create_app(typed).test_client(), data


def test_pool_page_lists_nodes_phases_and_lent_hours() -> None:
    """Every node with its phase; lent GPU-hours today and this week; the plot is ours."""
    c, _ = client()
    html = c.get("/").get_data(as_text=True)
    assert 'data-node="gpu1" data-phase="serving"' in html and 'data-phase="lent"' in html
    assert ">3.5<" in html and ">40.0<" in html and 'src="/plot/pool-24h.png"' in html
    assert "http://" not in html and "https://" not in html  # nothing loaded from elsewhere


def test_an_unknown_outlook_and_a_missing_best_time_are_explained_on_the_page() -> None:
    """The pool page prints the document's notes under the outlook and on the best-time card."""
    unknown = {**POOL, "outlook": [{**POOL["outlook"][0], "lendable_gpus": None,
                                    "demand_tokens_per_s": None}],
               "outlook_note": "unknown (every hour): WHY-1", "best_time_to_submit": None,
               "best_time_note": "no forecast for the next 0 hours: WHY-2"}

    class Unknown(FakeData):
        def pool(self) -> dict[str, Any]:
            return unknown

    html = create_app(Unknown()).test_client().get("/").get_data(as_text=True)
    assert 'id="best-time">-<' in html and ">unknown<" in html
    assert 'id="outlook-note">unknown (every hour): WHY-1<' in html
    assert 'id="best-time-note">no forecast for the next 0 hours: WHY-2<' in html


def test_jobs_page_escapes_user_strings_and_shows_preemptions_apart() -> None:
    """Job names and log lines are escaped; preemptions and failures are separate columns."""
    c, data = client()
    html = c.get("/jobs?user=alice").get_data(as_text=True)
    assert "<script>alert" not in html and "&lt;script&gt;" in html
    assert 'data-preemptions="1" data-failures="0"' in html
    assert '<svg class="dag">' in html and data.users == ["alice"]


def test_api_documents_are_the_data_as_json() -> None:
    """/api/pool and /api/jobs return the documents unchanged."""
    c, _ = client()
    assert c.get("/api/pool").get_json() == POOL
    job = c.get("/api/jobs").get_json()["jobs"][0]
    assert (job["preemptions"], job["failures"]) == (1, 0)


def test_the_view_is_read_only() -> None:
    """No route accepts a write."""
    c, _ = client()
    for path in ("/", "/jobs", "/api/pool", "/api/jobs"):
        assert c.post(path).status_code == 405
        assert c.delete(path).status_code == 405


def test_plot_is_a_png_drawn_here() -> None:
    """The 24-hour plot is rendered on the server (matplotlib), served as image/png."""
    pytest.importorskip("matplotlib")
    c, _ = client()
    r = c.get("/plot/pool-24h.png")
    assert r.mimetype == "image/png" and r.data[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_counts_serving_and_lent_gpus_from_phase_intervals() -> None:
    """GPUs per phase at each sample come from the journal's intervals."""
    ivs = [PhaseInterval("gpu1", "serving", 0, 1000), PhaseInterval("gpu2", "lent", 500, 1200),
           PhaseInterval("gpu2", "serving", 0, 500)]
    line = timeline(ivs, {"gpu1": 4, "gpu2": 4}, 0, 1200, step_s=600)
    assert line["serving_gpus"] == [8, 4, 0] and line["lent_gpus"] == [0, 4, 4]


def test_outlook_keeps_what_history_needs_and_lends_the_rest() -> None:
    """Demand 2500 tokens/s a day ago at 1000/replica and 0.8 utilisation needs 4 replicas;
    demand 0 keeps the floor (1 replica); no history is unknown, not a guess."""
    cfg = parse_config(CONFIG)
    demand = {0: {"m": 2500.0}, 1: {"m": 0.0}}

    def at(t: float) -> dict[str, float] | None:
        return demand.get(round((t + 86400) / 3600))

    rows = outlook(cfg, 0.0, at, hours=2)
    assert [r["lendable_gpus"] for r in rows] == [0, 12, None]
    assert best_time(rows) == 3600.0 and best_time([rows[2]]) is None


def test_live_data_without_config_says_so() -> None:
    """The pool view without the agent's config is an error line, not a crash."""
    doc = LiveData(None, state_root=__import__("pathlib").Path("/nonexistent")).pool()
    assert doc["nodes"] == [] and "no config" in doc["errors"][0]
    assert doc["best_time_to_submit"] is None and "config" in doc["best_time_note"]


def test_load_history_lands_on_the_timeline_samples() -> None:
    """Prometheus subquery points (on multiples of the step) go to the nearest 10-min sample;
    a failing query is an error line, not a crash."""
    now = 1_000_000.0 + 123

    class Prom:
        def custom_query(self, promql: str, params: dict[str, str]) -> list[dict[str, Any]]:
            assert "[86400s:600s]" in promql and float(params["time"]) == now
            return [{"metric": {}, "values": [[1_000_200.0, "5"], [1_000_000.0 - 86400, "2"]]}]

    class Live(LiveData):
        def _prom(self, cfg: Any) -> Any:
            if cfg == "broken":
                raise OSError("connection refused")
            return Prom(), type("Q", (), {"demand": lambda self: "d"})()

    live = Live(None, state_root=__import__("pathlib").Path("/nonexistent"))
    errors: list[str] = []
    series = live._demand_series(None, now, errors)  # type: ignore[arg-type]
    assert series[-1] == 5.0 and series[0] == 2.0 and series[1] is None and not errors
    live._demand_series("broken", now, errors)  # type: ignore[arg-type]
    assert errors and "connection refused" in errors[0]


def test_web_binds_loopback_unless_told_otherwise() -> None:
    """The view has no login: by default it listens on 127.0.0.1 only."""
    from slurm_idle.cli.web_cmd import web

    host = next(p for p in web.params if p.name == "host")
    assert host.default == "127.0.0.1"
