"""On a shared host the web view shows a user only their own job logs and pipeline parameters
(unless the site sets web.show_all_users), and its page cache is bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurm_idle import slurm as slurm_pkg
from slurm_idle.config import parse_config
from slurm_idle.web import create_app
from slurm_idle.web import data as web_data
from slurm_idle.web.data import LiveData

pytest.importorskip("flask")

CONFIG = """
engine: {kind: command, start_command: "true", stop_command: "true"}
models: [{name: m, nodes: gpu1}]
"""


class NoSlurm:
    def jobs(self) -> list[Any]:
        return []

    def cluster_name(self) -> str:
        return "c1"


def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, show_all: bool = False) -> LiveData:
    """LiveData over alice's job (a 0600 log with a secret) and bob's, no real Slurm."""
    log = tmp_path / "alice.out"
    log.write_text("step 1\nSECRET-TOKEN-1234\n")
    log.chmod(0o600)
    rows = [{"job_id": 1, "user": "alice", "log": str(log)},
            {"job_id": 2, "user": "bob", "log": None}]
    monkeypatch.setattr(web_data, "job_rows", lambda *a, **k: [dict(r) for r in rows])
    monkeypatch.setattr(slurm_pkg, "make_backend", lambda cfg: NoSlurm())
    monkeypatch.setattr(LiveData, "_usage", lambda self, cfg, now, errors: {})
    cfg = parse_config(CONFIG + f"web: {{show_all_users: {str(show_all).lower()}}}\n")
    return LiveData(cfg, state_root=tmp_path / "state", ttl_s=0)


def tails(doc: dict[str, Any]) -> dict[str, list[str]]:
    return {r["user"]: r["log_tail"] for r in doc["jobs"]}


def test_another_users_log_tail_is_not_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bob asking ?user=alice gets alice's job listed, not her log; alice sees her own."""
    data = live(tmp_path, monkeypatch)
    assert tails(data.jobs("alice", viewer="bob")) == {"alice": []}
    assert tails(data.jobs(None, viewer=None)) == {"alice": [], "bob": []}
    assert "SECRET-TOKEN-1234" in tails(data.jobs(None, viewer="alice"))["alice"]


def test_show_all_users_shows_everyones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site that sets web.show_all_users: true shows every log to every viewer."""
    data = live(tmp_path, monkeypatch, show_all=True)
    assert "SECRET-TOKEN-1234" in tails(data.jobs("alice", viewer=None))["alice"]


def test_the_viewer_is_the_proxys_header_else_the_local_user() -> None:
    """web.user_header names the viewer when set (?user= never does); else the local user."""
    seen: list[tuple[str | None, str | None]] = []

    class Fake:
        def pool(self) -> dict[str, Any]:
            return {}

        def jobs(self, user: str | None = None, viewer: str | None = None) -> dict[str, Any]:
            seen.append((user, viewer))
            return {"jobs": [], "pipelines": [], "users": [], "errors": []}

    app = create_app(Fake(), user_header="X-Remote-User", local_user="root-ignored")
    app.test_client().get("/api/jobs?user=alice", headers={"X-Remote-User": "bob"})
    app.test_client().get("/api/jobs?user=alice")
    create_app(Fake(), local_user="carol").test_client().get("/api/jobs?user=alice",
                                                              headers={"X-Remote-User": "bob"})
    assert seen == [("alice", "bob"), ("alice", None), ("alice", "carol")]


def test_the_page_cache_is_bounded() -> None:
    """200 unique ?user= values (60 KB each) keep 64 documents (MAX_CACHED), the newest."""

    class Live(LiveData):
        def _jobs(self, user: str | None, *viewer: str | None) -> dict[str, Any]:
            return {"user": user, "pad": "x" * 60_000}

    data = Live(None, state_root=Path("/nonexistent"))
    for i in range(200):
        data.jobs(f"u{i}")
    assert len(data._cache) == 64
    assert ("jobs", "u199", "") in data._cache and ("jobs", "u0", "") not in data._cache


def test_another_users_pipeline_parameters_are_not_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """alice's pipeline (its step is her job 1) shows its params to alice only."""
    from types import SimpleNamespace

    from slurm_idle import dag, pipeline

    step = SimpleNamespace(name="train", job_id=1, state="RUNNING", depends_on=(), restarts=0,
                           node="gpu1", reason="")
    monkeypatch.setattr(pipeline, "pipeline_records",
                        lambda root, cluster: [{"pipeline": "p", "params": {"token": "SECRET"}}])
    monkeypatch.setattr(pipeline, "live_status", lambda record, slurm: [step])
    monkeypatch.setattr(dag, "render_svg", lambda steps: "<svg></svg>")
    data = live(tmp_path, monkeypatch)
    assert data.jobs(None, viewer="bob")["pipelines"][0]["params"] == {}
    assert data.jobs(None, viewer="alice")["pipelines"][0]["params"] == {"token": "SECRET"}


def test_who_sees_what_is_stated_in_the_help() -> None:
    """`slurm-idle web --help` says whose logs a viewer sees and where the viewer comes from."""
    from slurm_idle.cli.web_cmd import web

    text = " ".join((web.help or "").split())
    assert "shown only to their owner" in text and "web.user_header" in text
    assert "web.show_all_users: true" in text and "?user= only filters" in text
