"""What admins see of the router (issue 14): `status` rows carry `router_state` and a loud
line when a model has no router; `explain` says when and why a replica left and rejoined it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slurm_idle.cli.tick_cmd import _add_router_states
from slurm_idle.config import parse_config
from slurm_idle.journal import Journal
from slurm_idle.router import IN, OUT

from .test_config import run_cli

CONFIG = """
engine: {{kind: command, start_command: "true", stop_command: "true"}}
{router}
models:
  - {{name: a, nodes: "gpu[1-2]"}}
  - {{name: b, nodes: "gpu3", router: {{kind: none}}}}
paths: {{journal: {journal}}}
"""


class States:
    def states(self, nodes: list[str]) -> dict[str, str]:
        return {"gpu1": IN, "gpu2": OUT, "gpu3": "unknown"}


def rows() -> list[dict[str, Any]]:
    return [{"name": n, "model": m} for n, m in (("gpu1", "a"), ("gpu2", "a"), ("gpu3", "b"))]


def test_status_rows_carry_router_state_and_warn_for_models_without_one(tmp_path: Path) -> None:
    """Each row gets what its router says; a model on `router: none` reads `none` and is named
    in the WARNING line."""
    cfg = parse_config(CONFIG.format(router="router: {kind: haproxy, admin_socket: /x}",
                                     journal=tmp_path / "j"))
    nodes = rows()
    line = _add_router_states(SimpleNamespace(config=cfg, router=States()), nodes)
    assert [n["router_state"] for n in nodes] == ["in", "out", "none"]
    assert line is not None and line.startswith("WARNING") and "models: b" in line


def test_no_warning_when_every_model_has_a_router(tmp_path: Path) -> None:
    """With a router for every model nothing is printed."""
    cfg = parse_config(CONFIG.format(router="router: {kind: haproxy, admin_socket: /x}",
                                     journal=tmp_path / "j").replace(", router: {kind: none}", ""))
    assert _add_router_states(SimpleNamespace(config=cfg, router=States()), rows()) is None


def test_explain_says_when_and_why_a_replica_left_and_rejoined(tmp_path: Path) -> None:
    """Router records read as `left the router` / `joined the router` with their reason, a
    failed call as FAILED; --json keeps them apart from the transitions."""
    journal = Journal(tmp_path / "j.jsonl")
    for ts, call, outcome, why in ((1000.0, "remove", "ok", "load stayed low"),
                                   (1001.0, "add", "error", "engine healthy"),
                                   (1002.0, "add", "ok", "engine healthy")):
        journal.append({"event": "router", "ts": ts, "node": "gpu1", "router": "haproxy",
                        "call": call, "outcome": outcome, "reason": why})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(router="", journal=journal.path))
    out = run_cli("--config", str(cfg), "explain", "gpu1").stdout.splitlines()
    assert "gpu1: left the router (haproxy) because load stayed low" in out[0]
    assert "FAILED to be added to the router" in out[1]
    assert "gpu1: joined the router (haproxy) because engine healthy" in out[2]
    data = json.loads(run_cli("--config", str(cfg), "explain", "--json").stdout)
    assert len(data["router"]) == 3 and data["transitions"] == []
