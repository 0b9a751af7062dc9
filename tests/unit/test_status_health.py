"""`status` names each unhealthy replica that should be serving, and why, in its table, its
`attention:` lines and its JSON: the engine by its /health URL, not the stale series after it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from click.testing import CliRunner

from slurm_idle.agent import Agent
from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.config import Config, ReplicaConfig, parse_config
from slurm_idle.engine import EngineHealth, HttpProbe, UrllibClient
from slurm_idle.httpdeadline import HttpResponse
from slurm_idle.lifecycle import format_reason
from slurm_idle.model import ModelLoad, Phase, ReplicaLoad
from slurm_idle.replica_health import attention, engine_down, probe_serving, unhealthy
from slurm_idle.status import model_rows, node_rows, render_status, replica_rows
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm

from .test_agent import Clock, make_config
from .test_policy_helpers import load, node, observation


def make_agent(tmp_path: Path, config: Config | None = None) -> tuple[Agent, FakeEngine]:
    """gpu1-3 serving with fresh metrics, except gpu2: its engine stopped, its series stale."""
    cfg = config or make_config(tmp_path)
    engine = FakeEngine(up={"gpu1": True, "gpu2": False, "gpu3": True})
    loads = {n: ReplicaLoad("m", n, url=f"http://127.0.0.1:1/{n}") for n in ("gpu1", "gpu3")}
    clock = Clock()
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3"])
    for n in ("gpu1", "gpu2", "gpu3"):
        slurm.drain(n, format_reason("slurm-idle", Phase.SERVING, clock() - 3600))
    agent = Agent(config=cfg, slurm=slurm,
                  metrics=FakeMetrics(replicas=loads, models={"m": ModelLoad(model="m")}),
                  engine_for=lambda model: engine, planner=lambda obs, cfg, now: [],
                  assessor=lambda obs, cfg, now: [], clock=clock, sleep=clock.sleep)
    return agent, engine


def test_a_stopped_engine_is_named_with_its_health_url(tmp_path: Path) -> None:
    """The serving replica whose engine is down is unhealthy, with its /health URL as the
    reason; the healthy ones carry no reason."""
    agent, _ = make_agent(tmp_path)
    obs = agent.observe()
    rows = replica_rows(obs, agent.config, probe_serving(obs, agent.config, agent.engine_for))
    by_name = {r["name"]: r for r in rows}
    assert by_name["gpu2"]["healthy"] is False
    assert by_name["gpu2"]["health_reason"] == (
        "engine not answering GET http://127.0.0.1:1/gpu2/health (connection refused (fake))")
    assert by_name["gpu1"]["healthy"] is True and by_name["gpu1"]["health_reason"] is None
    assert attention(rows) == ["gpu2 engine not answering /health"]


def test_the_table_shows_the_unhealthy_replica_and_an_attention_line(tmp_path: Path) -> None:
    """The human table says `serving (unhealthy: ...)` under the node and closes with what needs
    attention; a pool where all serve has neither."""
    agent, engine = make_agent(tmp_path)
    obs = agent.observe()
    rows = replica_rows(obs, agent.config, probe_serving(obs, agent.config, agent.engine_for))
    table = render_status(node_rows(obs), [], [], rows)
    assert "  └ gpu2 serving (unhealthy: engine not answering GET http://127.0.0.1:1/gpu2/health" in table
    assert table.splitlines()[-1] == "attention: gpu2 engine not answering /health"
    engine.up["gpu2"] = True
    agent.metrics.replicas["gpu2"] = ReplicaLoad("m", "gpu2", url="http://127.0.0.1:1/gpu2")  # type: ignore[attr-defined]
    obs = agent.observe()
    rows = replica_rows(obs, agent.config, probe_serving(obs, agent.config, agent.engine_for))
    table = render_status(node_rows(obs), [], [], rows)
    assert "unhealthy" not in table and "attention" not in table


def test_status_command_text_and_json(tmp_path: Path) -> None:
    """`slurm-idle status` prints the unhealthy replica and the attention line; `--json` keeps
    `healthy` and adds `health_reason` per replica and a top-level `attention` list."""
    cfg = parse_config(make_config(tmp_path).model_dump_json().replace(
        '"bin_dir":""', f'"bin_dir":"{tmp_path}/no-slurm"').replace(
        '"bin_dir":null', f'"bin_dir":"{tmp_path}/no-slurm"'))
    agent, _ = make_agent(tmp_path, cfg)
    ctx = Context(_config=agent.config, agent_factory=lambda config, read_only=False: agent)
    text = CliRunner().invoke(main, ["status"], obj=ctx)
    assert text.exit_code == 0, text.output
    assert "gpu2 serving (unhealthy: engine not answering GET http://127.0.0.1:1/gpu2/health" in text.output
    assert "attention: gpu2 engine not answering /health" in text.output
    ctx = Context(_config=agent.config, agent_factory=lambda config, read_only=False: agent)
    doc = json.loads(CliRunner().invoke(main, ["status", "--json"], obj=ctx).output)
    gpu2 = next(r for r in doc["replicas"] if r["name"] == "gpu2")
    assert gpu2["healthy"] is False and "http://127.0.0.1:1/gpu2/health" in gpu2["health_reason"]
    assert doc["attention"] == ["gpu2 engine not answering /health"]


def test_connection_refused_reads_as_such() -> None:
    """A real refused connection on loopback reads `engine not answering GET URL/health
    (connection refused)`, not urllib's `[Errno 111] ...`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    url = f"http://127.0.0.1:{port}"
    health = HttpProbe(UrllibClient(), 2).health(ReplicaConfig(node="gpu1", url=url))
    down = engine_down(url, health)
    assert down is not None
    assert down.detail == f"engine not answering GET {url}/health (connection refused)"
    assert down.summary == "engine not answering /health"


def test_a_failing_health_answer_and_other_reasons() -> None:
    """/health 503 names the status; a sleeping or foreign engine and missing metrics each have
    their own words; an engine up with fresh metrics has none."""

    class Http:
        def request(self, method: str, url: str, timeout: float) -> HttpResponse:
            return HttpResponse(503, b"")

    url = "http://127.0.0.1:8001"
    health = HttpProbe(Http(), 1).health(ReplicaConfig(node="gpu1", url=url))
    down = unhealthy(url, health, ReplicaLoad("m", "gpu1"))
    assert down is not None and down.detail == f"GET {url}/health answered 503"
    assert down.summary == "/health answered 503"
    up = EngineHealth(up=True, awake=True)
    assert unhealthy(url, up, ReplicaLoad("m", "gpu1")) is None
    assert unhealthy(url, EngineHealth(up=True, awake=False), ReplicaLoad("m", "gpu1")).summary == "engine asleep"  # type: ignore[union-attr]
    proven = EngineHealth(up=True, awake=True, foreign="x", foreign_proven=True)
    assert "not the expected engine" in unhealthy(url, proven, None).detail  # type: ignore[union-attr]
    untold = EngineHealth(up=True, awake=True, foreign="no answer in time")
    assert unhealthy(url, untold, ReplicaLoad("m", "gpu1")) is None  # nothing proven
    assert unhealthy(url, up, ReplicaLoad("m", "gpu1", known=False)).summary == "no fresh metrics"  # type: ignore[union-attr]


def test_replicas_listed_under_a_node_show_why_they_are_unhealthy() -> None:
    """With two replicas on a node, the one whose engine is down reads `unhealthy: why` in its
    own line instead of `not healthy`; its neighbour stays `healthy`."""
    node = {"name": "gpu5", "phase": "serving", "slurm_state": "IDLE+DRAIN", "gpus_total": 8,
            "gpus_used": 0, "jobs": [], "reason": "", "pinned": False}
    why = "engine not answering GET http://127.0.0.1:8001/health (connection refused)"
    rows = [{"name": f"gpu5:{port}", "model": "m", "nodes": ["gpu5"], "gpus": gpus, "phase": "serving",
             "url": f"http://127.0.0.1:{port}", "healthy": reason is None, "placement": "nodes",
             "health_reason": reason, "health_summary": reason and "engine not answering /health"}
            for port, gpus, reason in ((8000, "0-3", None), (8001, "4-7", why))]
    table = render_status([node], [], [], rows).splitlines()
    assert any(line.startswith("  └ gpu5:8001") and line.endswith(f"unhealthy: {why}") for line in table)
    assert any(line.startswith("  └ gpu5:8000") and line.endswith(" healthy") for line in table)
    assert table[-1] == "attention: gpu5:8001 engine not answering /health"


def test_status_without_a_plan_counts_as_serving_what_takes_traffic() -> None:
    """With no plan for a model, `status` counts the replicas that take traffic (SERVING and
    RETIRING, lifecycle.takes_traffic, as the planner does), not SERVING alone."""
    obs = observation(node("n1"), node("n2", Phase.RETIRING), node("n3", Phase.LENT),
                      node("n4", Phase.STARTING), loads=(load(0.0),))
    [row] = model_rows(obs, [])
    assert row["serving"] == 2
