"""Only a live engine is capacity, in both placements: a serving replica whose /health fails,
whose engine is gone, or (http-sleep) whose sleep state is unknown is not counted, another
replica comes back in its place, and the fast check does it without waiting for the tick."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

from slurm_idle.agent import Agent
from slurm_idle.config import Config, ReplicaConfig, parse_config
from slurm_idle.engine import EngineHealth
from slurm_idle.lifecycle import format_lent_comment, format_reason
from slurm_idle.loop import run_loop
from slurm_idle.model import ActionKind, ModelLoad, Phase, ReplicaLoad, SlurmNode
from slurm_idle.observe import observe
from slurm_idle.policy import assess, fast_plan, plan
from slurm_idle.replica_health import unhealthy_names
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm

from . import test_agent_jobs as jobs
from .test_agent import Clock
from .test_loop import FakeTime
from .test_replica_jobs import CONFIG, comment, job, obs

T0 = 1_796_205_600.0
NODES = ("gpu1", "gpu2", "gpu3")


def node_config(tmp_path: Path) -> Config:
    return parse_config(f"""
engine: {{kind: command, start_command: "true {{node}}", stop_command: "true {{node}}", drain_timeout_s: 5}}
models:
  - name: m
    nodes: gpu[1-3]
    url: "http://127.0.0.1:1/{{node}}"
    tokens_per_s_per_replica: 100
policy: {{scale_down_window_s: 60, forecast: false}}
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
timeouts: {{tick_budget_s: 10}}
""")


def node_agent(tmp_path: Path, demand: float, lent: tuple[str, ...] = ("gpu3",)
               ) -> tuple[Agent, FakeSlurm, FakeEngine]:
    """gpu[1-3] of model m (100 tok/s per replica), the `lent` ones lent, the others serving
    with fresh metrics splitting `demand`; every engine of a serving node up."""
    slurm = FakeSlurm.with_nodes(list(NODES))
    serving = [n for n in NODES if n not in lent]
    for name in NODES:
        slurm.node_map[name] = (
            SlurmNode(name=name, state="idle", comment=format_lent_comment("slurm-idle", T0 - 600))
            if name in lent else
            SlurmNode(name=name, state="idle", flags=frozenset({"DRAIN"}),
                      reason=format_reason("slurm-idle", Phase.SERVING, T0 - 600)))
    engine = FakeEngine(up={n: n in serving for n in NODES})
    share = demand / len(serving)
    metrics = FakeMetrics(
        replicas={n: ReplicaLoad("m", n, url=f"http://127.0.0.1:1/{n}", generation_tokens_per_s=share)
                  for n in serving},
        models={"m": ModelLoad("m", generation_tokens_per_s=demand,
                               demand_tokens_per_s_max_window=demand, waiting_max_window=0)})
    clock = Clock()
    agent = Agent(config=node_config(tmp_path), slurm=slurm, metrics=metrics,
                  engine_for=lambda model: engine, planner=plan, assessor=assess, clock=clock,
                  sleep=clock.sleep)
    return agent, slurm, engine


def phases(agent: Agent) -> dict[str, Phase]:
    return {v.name: v.phase for v in agent.observe().nodes}


# --- node placement ----------------------------------------------------------------------


def test_a_live_pool_needing_its_two_serving_nodes_leaves_the_lent_one_lent(tmp_path: Path) -> None:
    """The control: two live replicas cover a need of 2; the lent node stays lent."""
    agent, _, _ = node_agent(tmp_path, demand=150.0)
    result = agent.tick()
    assert result.actions == [] and phases(agent)["gpu3"] is Phase.LENT


def test_a_serving_node_whose_health_fails_is_not_counted_and_a_lent_one_comes_back(
        tmp_path: Path) -> None:
    """gpu1's /health fails (its process still listens): not counted (the model serves 1 of
    the 2 it needs), gpu3 is reclaimed in the same tick; gpu1 itself is left as it is (a busy
    engine may miss a /health: only a proof of its absence restarts it)."""
    agent, _, engine = node_agent(tmp_path, demand=150.0)
    engine.failing.add("gpu1")
    obs = agent.observe()
    [gpu1] = [v.replica for v in obs.nodes if v.name == "gpu1"]
    assert gpu1 is not None and gpu1.healthy is False
    assert any(e.startswith("gpu1: engine failing its health check") for e in obs.errors)
    assert unhealthy_names(obs, agent.config) == ["gpu1"]  # `status` says since when
    result = agent.tick()
    assert [(a.kind, a.node) for a in result.actions] == [(ActionKind.RECLAIM, "gpu3")]
    assert [p.serving_replicas for p in result.plans] == [1]
    assert phases(agent) == {"gpu1": Phase.SERVING, "gpu2": Phase.SERVING, "gpu3": Phase.SERVING}
    assert ("stop", "gpu1") not in engine.log


def test_the_only_serving_node_whose_engine_is_gone_is_repaired_and_replaced(tmp_path: Path) -> None:
    """Nothing listens on gpu1's port any more, the model's only serving node: it is repaired
    (restarted) as before, and gpu2 comes back in the same tick for the floor, since a repair
    brings nothing back this tick."""
    agent, _, engine = node_agent(tmp_path, demand=10.0, lent=("gpu2", "gpu3"))
    engine.up["gpu1"] = False
    result = agent.tick()
    assert sorted((a.kind, a.node) for a in result.actions) == [
        (ActionKind.RECLAIM, "gpu2"), (ActionKind.REPAIR, "gpu1")]
    assert ("start", "gpu1") in engine.log and ("start", "gpu2") in engine.log


def test_an_unknown_sleep_state_is_no_capacity_only_where_the_engine_sleeps(tmp_path: Path) -> None:
    """gpu1 answers /health but neither /is_sleeping nor the sleep gauge tells whether it is
    awake: for an engine that sleeps (http-sleep) it is not counted and gpu3 comes back; for
    one that never sleeps (command, docker) it serves and nothing moves."""
    agent, slurm, _ = node_agent(tmp_path, demand=150.0)

    def probe(may_sleep: bool):  # type: ignore[no-untyped-def]
        def check(model: str, replica: ReplicaConfig) -> EngineHealth:
            return EngineHealth(up=True, awake=True if replica.node != "gpu1" else None,
                                may_sleep=may_sleep)
        return check

    for may_sleep, reclaimed in ((True, ["gpu3"]), (False, [])):
        obs = observe(agent.config, slurm, agent.metrics, T0, probe=probe(may_sleep))
        assert [a.node for a in plan(obs, agent.config, T0) if a.kind is ActionKind.RECLAIM] == reclaimed


def test_nothing_is_lent_while_a_serving_node_fails_its_probe(tmp_path: Path) -> None:
    """Low load on three serving nodes lends (the control); with gpu1 failing its /health
    the model's evidence is not whole: nothing is lent, as with unknown metrics."""
    agent, _, engine = node_agent(tmp_path, demand=10.0, lent=())
    assert {a.kind for a in plan(agent.observe(), agent.config, T0)} == {ActionKind.LEND}
    engine.failing.add("gpu1")
    assert plan(agent.observe(), agent.config, T0) == []


# --- placement: jobs ---------------------------------------------------------------------


def test_nothing_is_lent_while_a_serving_replica_job_fails_its_probe() -> None:
    """Three serving replica jobs on low load lend (the control); with jm#0 failing its
    probe nothing is lent, though the two live ones would still cover the need."""
    cfg = parse_config(CONFIG.replace("replicas: 2", "replicas: 3"))
    three = [job(5 + i, "RUNNING", comment(Phase.SERVING, i)) for i in range(3)]
    healthy = obs(cfg, three, demand=10.0)
    assert {a.kind for a in plan(healthy, cfg, T0)} == {ActionKind.LEND}
    first, *rest = healthy.replica_jobs
    assert first.load is not None
    failing = replace(healthy, replica_jobs=(replace(first, load=replace(first.load, healthy=False)),
                                             *rest))
    assert plan(failing, cfg, T0) == []
    assert assess(failing, cfg, T0)[0].serving_replicas == 2


def test_a_failing_replica_jobs_stale_series_do_not_hold_the_model() -> None:
    """jm#0 fails its probe and its series are stale, jm#1 serves, jm#2 is lent, low load: the
    failing one is no capacity, not a blind serving replica, so the need (1) decides and jm#2
    stays lent; counted as blind it would hold 2 and reclaim jm#2 for nothing."""
    cfg = parse_config(CONFIG.replace("replicas: 2", "replicas: 3"))
    jobs_ = [job(5, "RUNNING", comment(Phase.SERVING, 0)), job(6, "RUNNING", comment(Phase.SERVING, 1))]
    seen = obs(cfg, jobs_, demand=10.0)
    first, *rest = seen.replica_jobs
    dead = ReplicaLoad(model="jm", node="gpu8", url=first.url, known=False, healthy=False)
    seen = replace(seen, replica_jobs=(replace(first, load=dead), *rest))
    assert [r.phase for r in seen.replica_jobs] == [Phase.SERVING, Phase.SERVING, Phase.LENT]
    assert plan(seen, cfg, T0) == [] and assess(seen, cfg, T0)[0].needed_replicas == 1




def jobs_one_lent(tmp_path: Path) -> tuple[Agent, FakeSlurm, FakeMetrics, jobs.Cluster]:
    """jm#0 serving, jm#1 lent, demand 10 tok/s (one replica is enough)."""
    agent, slurm, metrics, cluster = jobs.make_agent(tmp_path, demand=150.0)
    for _ in range(3):
        agent.tick()
    jobs.set_demand(metrics, 10.0)
    agent.tick()
    assert jobs.phases(agent) == [Phase.SERVING, Phase.LENT]
    return agent, slurm, metrics, cluster


def test_a_serving_replica_job_whose_health_fails_is_not_counted(tmp_path: Path) -> None:
    """jm#0's /health fails while its job runs (and its series went stale): not counted, nor
    taken for a blind replica that holds the model, jm#1 is submitted again and serves; jm#0's
    job is left running (no proof its engine is gone)."""
    agent, slurm, metrics, cluster = jobs_one_lent(tmp_path)
    cluster.engine.failing.add("jm#0")
    del metrics.replicas["jm#0"]
    [jm0, _] = agent.observe().replica_jobs
    assert jm0.load is not None and jm0.load.healthy is False
    result = agent.tick()
    assert [(a.kind, a.node) for a in result.actions] == [(ActionKind.RECLAIM, "jm#1")]
    agent.tick()
    assert jobs.phases(agent) == [Phase.SERVING, Phase.SERVING]
    assert ("cancel", str(jm0.job_id)) not in slurm.log
    assert [p.serving_replicas for p in agent.tick().plans] == [1]


def test_a_serving_replica_job_whose_engine_is_gone_is_cancelled_and_replaced(tmp_path: Path) -> None:
    """jm#0's vLLM is gone while its job runs on: repaired by cancelling the job (its GPUs
    freed, through the lend's steps), and jm#1 is submitted in the same tick."""
    agent, slurm, _, cluster = jobs_one_lent(tmp_path)
    cluster.dead.add("jm#0")
    cluster.engine.up["jm#0"] = False
    [jm0, _] = agent.observe().replica_jobs
    result = agent.tick()
    assert sorted((a.kind, a.node) for a in result.actions) == [
        (ActionKind.RECLAIM, "jm#1"), (ActionKind.REPAIR, "jm#0")]
    assert ("cancel", str(jm0.job_id)) in slurm.log
    cluster.dead.clear()
    agent.tick()
    assert jobs.phases(agent) == [Phase.LENT, Phase.SERVING]


# --- the fast check ----------------------------------------------------------------------


def test_the_fast_check_reclaims_when_the_only_serving_replica_dies(tmp_path: Path) -> None:
    """Low load, no queue: nothing presses, yet gpu1, the only serving node, stops answering
    /health after the full tick; the next pass, a fast check, reclaims a lent node."""
    agent, _, engine = node_agent(tmp_path, demand=10.0, lent=("gpu2", "gpu3"))
    t = FakeTime()
    kinds: list[tuple[str, list[tuple[ActionKind, str]]]] = []

    def on_pass(kind: str, result: object) -> None:
        kinds.append((kind, [(a.kind, a.node) for a in result.actions]))  # type: ignore[attr-defined]
        engine.failing.add("gpu1")

    run_loop(agent, threading.Event(), clock=t, max_passes=2, wait=t.wait, on_pass=on_pass)
    assert kinds == [("tick", []), ("fast", [(ActionKind.RECLAIM, "gpu2")])]
    assert phases(agent)["gpu2"] is Phase.SERVING


def test_the_fast_check_replaces_a_replica_job_out_of_service(tmp_path: Path) -> None:
    """The same in placement: jobs: jm#0 fails its probe, a fast check submits jm#1."""
    agent, _, _, cluster = jobs_one_lent(tmp_path)
    cluster.engine.failing.add("jm#0")
    fast = replace(agent, planner=fast_plan)
    assert [(a.kind, a.node) for a in fast.tick().actions] == [(ActionKind.RECLAIM, "jm#1")]


# --- the probe's budget --------------------------------------------------------------------


def test_probes_that_hang_tell_nothing_and_leave_the_metrics_their_share(tmp_path: Path) -> None:
    """Every engine hangs on its probe: observe waits PROBE_SHARE of its budget for them, then
    plans on the metrics as before the probe (nothing marked failing, nothing reclaimed)."""
    agent, slurm, _ = node_agent(tmp_path, demand=150.0)
    release = threading.Event()

    def hung(model: str, replica: ReplicaConfig) -> EngineHealth:
        release.wait(5)
        return EngineHealth(up=False, awake=None, error="late")

    started = time.monotonic()
    try:
        obs = observe(agent.config, slurm, agent.metrics, T0, probe=hung, budget_s=2.0)
    finally:
        release.set()
    assert time.monotonic() - started < 1.8  # half the budget for probes, the metrics after
    assert all(v.replica is None or v.replica.healthy is None for v in obs.nodes)
    assert all(m.known for m in obs.models) and plan(obs, agent.config, T0) == []
