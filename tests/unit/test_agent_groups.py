"""A tick on lend groups (fakes): two replicas on one node, a replica spanning two nodes.
The group's phase goes on every node, engines move per replica, status shows replicas."""

from __future__ import annotations

from pathlib import Path

import yaml

from slurm_idle.agent import Agent
from slurm_idle.config import Config
from slurm_idle.lifecycle import format_reason
from slurm_idle.model import ModelLoad, Phase, ReplicaLoad, SlurmJob
from slurm_idle.policy import assess, plan
from slurm_idle.status import group_rows, node_rows, render_status, replica_rows
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm

from .test_agent import Clock

REPLICAS = ["gpu5:8000", "gpu5:8001", "gpu6"]


def make_config(tmp_path: Path) -> Config:
    # Floors of 0 (only the simulator's configs may): both groups may go, to see them move.
    return Config.model_validate(yaml.safe_load(f"""
engine: {{kind: command, start_command: "true {{node}} {{port}}", stop_command: "true", drain_timeout_s: 5}}
models:
  - name: m
    nodes: gpu5
    gpus_per_node: 8
    replicas_per_node: 2
    ports: [8000, 8001]
    url: "http://127.0.0.1:{{port}}/{{node}}"
    min_serving_replicas: 0
  - name: big
    gpus_per_replica: 16
    min_serving_replicas: 0
    replicas: [{{nodes: "gpu[6-7]", url: "http://127.0.0.1:9000/gpu6"}}]
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
policy: {{scale_down_window_s: 0, queue_sustain_s: 0}}
timeouts:
  tick_budget_s: 10
"""))


def make_agent(tmp_path: Path, demand: float = 0.0) -> tuple[Agent, FakeSlurm, FakeEngine, Clock]:
    cfg = make_config(tmp_path)
    slurm = FakeSlurm.with_nodes(["gpu5", "gpu6", "gpu7"], gpus=8)
    clock = Clock()
    serving = format_reason("slurm-idle", Phase.SERVING, clock() - 3600)
    for n in ("gpu5", "gpu6", "gpu7"):
        slurm.drain(n, serving)
    engine = FakeEngine(up=dict.fromkeys(REPLICAS, True))
    metrics = FakeMetrics(
        replicas={
            "gpu5:8000": ReplicaLoad(model="m", node="gpu5", url="http://127.0.0.1:8000/gpu5"),
            "gpu5:8001": ReplicaLoad(model="m", node="gpu5", url="http://127.0.0.1:8001/gpu5"),
            "gpu6": ReplicaLoad(model="big", node="gpu6", url="http://127.0.0.1:9000/gpu6"),
        },
        models={"m": ModelLoad(model="m", generation_tokens_per_s=demand,
                               demand_tokens_per_s_max_window=demand, waiting_max_window=0.0,
                               waiting_min_window=0.0, waiting_min_recent=0.0),
                "big": ModelLoad(model="big", demand_tokens_per_s_max_window=0.0,
                                 waiting_max_window=0.0, waiting_min_window=0.0,
                                 waiting_min_recent=0.0)},
    )
    agent = Agent(config=cfg, slurm=slurm, metrics=metrics, engine_for=lambda model: engine,
                  planner=plan, assessor=assess, clock=clock, sleep=clock.sleep)
    return agent, slurm, engine, clock


def test_low_load_lends_both_groups_whole(tmp_path: Path) -> None:
    """Both replicas of gpu5 stop and gpu5 is lent as one node; gpu6 and gpu7 go together."""
    agent, slurm, engine, clock = make_agent(tmp_path)
    for _ in range(3):
        agent.tick()
        clock.t += 60
    nodes = {v.name: v.phase for v in agent.observe().nodes}
    assert nodes == {"gpu5": Phase.LENT, "gpu6": Phase.LENT, "gpu7": Phase.LENT}
    assert ("stop", "gpu5:8000") in engine.log and ("stop", "gpu5:8001") in engine.log
    assert not engine.up["gpu5:8000"] and not engine.up["gpu5:8001"] and not engine.up["gpu6"]
    resumed = [e[1] for e in slurm.log if e[0] == "resume"]
    assert sorted(resumed) == ["gpu5", "gpu6", "gpu7"]


def test_high_load_brings_both_replicas_back_and_requeues(tmp_path: Path) -> None:
    """A lent gpu5 under load: its job is requeued, both replicas start, gpu5 serves again;
    the group counts as serving only once both replicas are up."""
    agent, slurm, engine, clock = make_agent(tmp_path)
    for _ in range(3):
        agent.tick()
        clock.t += 60
    slurm.job_list.append(SlurmJob(job_id=7, name="j", partition="idle", state="RUNNING",
                                   nodes=("gpu5",), gpus=8, start_time=clock() - 30))
    agent.metrics.models["m"] = ModelLoad(model="m", generation_tokens_per_s=3000.0,
                                          demand_tokens_per_s_max_window=3000.0,
                                          waiting_max_window=0.0, waiting_min_window=0.0,
                                          waiting_min_recent=0.0)
    agent.tick()
    assert 7 in [i for ids, _ in slurm.requeues for i in ids]
    assert engine.up["gpu5:8000"] and engine.up["gpu5:8001"]
    assert {v.name: v.phase for v in agent.observe().nodes}["gpu5"] is Phase.SERVING
    assert {v.name: v.phase for v in agent.observe().nodes}["gpu6"] is Phase.LENT


def test_a_replica_that_does_not_start_keeps_the_group_starting(tmp_path: Path) -> None:
    """One of two replicas never healthy: the node stays STARTING, the journal names it."""
    agent, slurm, engine, clock = make_agent(tmp_path)
    starting = format_reason("slurm-idle", Phase.STARTING, clock())
    slurm.drain("gpu5", starting)
    engine.up["gpu5:8001"] = False

    original = engine.start

    def start(replica, timeout_s=None):  # the 8001 replica never comes up
        original(replica, timeout_s)
        if replica.name == "gpu5:8001":
            engine.up["gpu5:8001"] = False

    engine.start = start  # type: ignore[method-assign]
    result = agent.tick()
    step = next(s for s in result.steps if s.node == "gpu5")
    assert step.outcome == "waiting" and "gpu5:8001" in (step.detail or "")
    assert {v.name: v.phase for v in agent.observe().nodes}["gpu5"] is Phase.STARTING


def test_an_admin_drain_on_one_node_of_a_group_holds_the_whole_group(tmp_path: Path) -> None:
    """An admin's drain on gpu7 makes the gpu[6-7] group the admin's: never named in a plan."""
    agent, slurm, engine, _ = make_agent(tmp_path)
    slurm.drain("gpu7", "disk replacement")
    result = agent.tick()
    assert all(a.node != "gpu6" and a.node != "gpu7" for a in result.actions)
    assert engine.up["gpu6"]


def test_status_json_shows_replicas_and_groups(tmp_path: Path) -> None:
    """status rows: nodes keep their phase; replicas with model, nodes, gpus, url, phase,
    healthy; groups with their nodes and replicas; the table lists replicas under nodes."""
    agent, *_ = make_agent(tmp_path)
    obs = agent.observe()
    replicas = replica_rows(obs, agent.config)
    assert [(r["name"], r["model"], r["nodes"], r["gpus"], r["phase"], r["healthy"]) for r in replicas] == [
        ("gpu5:8000", "m", ["gpu5"], "0-3", "serving", True),
        ("gpu5:8001", "m", ["gpu5"], "4-7", "serving", True),
        ("gpu6", "big", ["gpu6", "gpu7"], "all", "serving", True),
    ]
    assert group_rows(obs, agent.config) == [
        {"nodes": ["gpu5"], "phase": "serving", "replicas": ["gpu5:8000", "gpu5:8001"], "gpus": 8},
        {"nodes": ["gpu6", "gpu7"], "phase": "serving", "replicas": ["gpu6"], "gpus": 16},
    ]
    assert [n["phase"] for n in node_rows(obs)] == ["serving"] * 3
    table = render_status(node_rows(obs), [], [], replicas)
    assert "gpu5:8001" in table and "on gpu6,gpu7" in table


def test_textfile_counts_replicas_and_groups(tmp_path: Path) -> None:
    """The textfile has replicas per model and phase, and groups per phase, after the tick."""
    from prometheus_client.parser import text_string_to_metric_families

    from slurm_idle.wiring import group_counts, serving_after

    agent, *_ = make_agent(tmp_path)
    result = agent.tick()
    counts = group_counts(result, agent.config)
    assert counts["replicas"][("m", "retiring")] + counts["replicas"][("m", "lent")] == 2
    assert counts["groups"]["serving"] + counts["groups"]["lent"] + counts["groups"]["retiring"] == 2
    assert sum(serving_after(result, agent.config).values()) <= 3
    from slurm_idle.agent_metrics import write_textfile

    path = tmp_path / "m.prom"
    write_textfile(path, phases={}, needed={}, serving={}, tick_duration_s=1, tick_ts=1,
                   transitions=[], tick_error=False, **counts)
    names = {s.name for f in text_string_to_metric_families(path.read_text()) for s in f.samples}
    assert {"slurm_idle_replicas", "slurm_idle_groups"} <= names


def test_gres_unlike_gpus_per_node_is_warned(tmp_path: Path) -> None:
    """A node whose gres says 4 GPUs where the config says gpus_per_node 8 is an observation
    warning naming both numbers."""
    agent, slurm, *_ = make_agent(tmp_path)
    from dataclasses import replace

    slurm.node_map["gpu5"] = replace(slurm.node_map["gpu5"], gpus_total=4)
    errors = agent.observe().errors
    assert any("gpu5: Slurm reports 4 GPU(s)" in e and "gpus_per_node 8" in e for e in errors)


def test_engine_commands_and_containers_are_per_replica() -> None:
    """`{port}`/`{index}` fill per replica in commands and container names, so the two replicas
    of a node are started and stopped on their own."""
    from slurm_idle.config import EngineConfig, ReplicaConfig
    from slurm_idle.engine import CommandEngine, container_name

    calls: list[list[str]] = []

    class Runner:
        def run(self, argv: list[str], timeout: float | None = None) -> object:
            calls.append(argv)
            return None

    engine = CommandEngine(EngineConfig(kind="command", start_command="up {node} {port} {index} {model}",
                                        stop_command="down {url}"), model="m", runner=Runner())
    replica = ReplicaConfig.model_validate({"node": "gpu5", "gpus": "4-7", "index": 1,
                                            "url": "http://gpu5:8001"})
    engine.stop(replica)
    assert calls[-1] == ["sh", "-c", "down http://gpu5:8001"]
    assert container_name("vllm-{node}-{index}", "gpu5", "m", 1, 8001) == "vllm-gpu5-1"
    assert container_name("vllm-{node}-{port}", "gpu5", "m", 1, 8001) == "vllm-gpu5-8001"
    from slurm_idle.engine import format_command

    assert format_command("up {node} {port} {index} {model}", "gpu5", "u", "m", 8001, 1) == "up gpu5 8001 1 m"


def test_a_job_on_both_nodes_of_a_group_is_requeued_once(tmp_path: Path) -> None:
    """Reclaiming gpu[6-7] requeues a 2-node job once, not once per node (a second requeue of a
    job already pending fails in Slurm)."""
    from slurm_idle.model import Action, ActionKind

    agent, slurm, engine, clock = make_agent(tmp_path)
    for _ in range(3):
        agent.tick()
        clock.t += 60
    slurm.job_list.append(SlurmJob(job_id=9, name="j", partition="idle", state="RUNNING",
                                   nodes=("gpu6", "gpu7"), gpus=8, start_time=clock() - 30))
    obs = agent.observe()
    action = Action(ActionKind.RECLAIM, "gpu6", "big", Phase.LENT, Phase.RECLAIMING, "test")
    steps = agent.run_actions([action], obs)
    assert [ids for ids, _ in slurm.requeues] == [(9,)]
    assert steps[-1].to_phase is Phase.SERVING and steps[-1].outcome == "ok"
    assert engine.up["gpu6"]


def test_the_router_is_told_of_each_replica_on_a_node(tmp_path: Path) -> None:
    """Two replicas on gpu5 are two router targets: a lend takes both out before the drain,
    a reclaim puts both back, and the reconcile reads and fixes each on its own."""
    from slurm_idle.config import RouterConfig
    from slurm_idle.router import IN, OUT, all_targets, fill
    from slurm_idle.router.sync import RouterSet
    from slurm_idle.testing.fake_router import FakeRouter

    agent, slurm, _, clock = make_agent(tmp_path)
    agent.config = agent.config.model_copy(
        update={"router": RouterConfig(kind="haproxy", admin_socket="/nonexistent.sock")})
    router = FakeRouter(log=slurm.log)
    agent.router = RouterSet(agent.config, make=lambda c: router, clock=clock)
    names = [t.name for t in all_targets(agent.config)]
    assert names == REPLICAS
    assert [fill("{node}-{index}", t) for t in all_targets(agent.config)] == [
        "gpu5-0", "gpu5-1", "gpu6-0"]
    router.members.update(dict.fromkeys(REPLICAS, IN))
    for _ in range(3):
        agent.tick()
        clock.t += 60
    assert router.members == dict.fromkeys(REPLICAS, OUT)
    removed = [e[1] for e in slurm.log if e[0] == "router_remove"]
    assert sorted(removed) == sorted(REPLICAS)
    router.members["gpu5:8001"] = IN  # someone put it back: gpu5 is lent
    result = agent.tick()
    assert router.members["gpu5:8001"] == OUT
    assert {(c["node"], c.get("replica"), c["call"]) for c in result.router_changes} == {
        ("gpu5", "gpu5:8001", "remove")}
