"""The tick's glue on in-memory fakes: lock, observe, act through the edge table, journal."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from slurm_idle.agent import Agent
from slurm_idle.config import Config, parse_config
from slurm_idle.journal import Journal
from slurm_idle.lifecycle import format_lent_comment, format_reason
from slurm_idle.lock import try_lock
from slurm_idle.model import (
    Action,
    ActionKind,
    ModelLoad,
    Observation,
    Phase,
    ReplicaLoad,
    SlurmJob,
)
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm
from slurm_idle.transitions import POLL_S

T0 = 1_796_205_600.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.01)


def make_config(tmp_path: Path, **timeouts: float) -> Config:
    extra = "".join(f"  {k}: {v}\n" for k, v in timeouts.items())
    return parse_config(f"""
engine: {{kind: command, start_command: "true {{node}}", stop_command: "true {{node}}", drain_timeout_s: 5}}
models:
  - name: m
    nodes: gpu[1-3]
    url: "http://127.0.0.1:1/{{node}}"
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
timeouts:
  tick_budget_s: 10
{extra}""")


def make_agent(tmp_path: Path, planner=None, **timeouts: float):
    cfg = make_config(tmp_path, **timeouts)
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3"])
    engine = FakeEngine(up={"gpu1": True, "gpu2": True, "gpu3": True})
    metrics = FakeMetrics(models={"m": ModelLoad(model="m")})
    clock = Clock()
    agent = Agent(
        config=cfg, slurm=slurm, metrics=metrics, engine_for=lambda model: engine,
        planner=planner or (lambda obs, cfg, now: []), assessor=lambda obs, cfg, now: [],
        clock=clock, sleep=clock.sleep,
    )
    return agent, slurm, engine, metrics, clock


def continue_all(obs: Observation, cfg: Config, now: float) -> list[Action]:
    """A stand-in planner: carry on every transitional node, adopt unknown ones."""
    from slurm_idle.lifecycle import next_phase

    actions = []
    for v in obs.nodes:
        if v.phase is Phase.UNKNOWN and not v.node.down:
            actions.append(Action(ActionKind.ADOPT, v.name, v.model, v.phase, Phase.RECLAIMING, "adopt"))
        elif (nxt := next_phase(v.phase)) is not None:
            actions.append(Action(ActionKind.CONTINUE, v.name, v.model, v.phase, nxt, "continue"))
    return actions


def phases(agent: Agent) -> dict[str, Phase]:
    return {v.name: v.phase for v in agent.observe().nodes}


def test_observe_uses_one_nodes_and_one_jobs_call(tmp_path: Path) -> None:
    """Observation costs one nodes() and one jobs() call whatever the pool size."""
    agent, slurm, *_ = make_agent(tmp_path)
    obs = agent.observe()
    assert [c[0] for c in slurm.log] == ["jobs", "nodes"]
    assert {v.name for v in obs.nodes} == {"gpu1", "gpu2", "gpu3"}


def test_metrics_down_marks_models_unknown(tmp_path: Path) -> None:
    """When metrics are unavailable every model's load is unknown and the error is reported."""
    agent, _, _, metrics, _ = make_agent(tmp_path)
    metrics.fail = True
    obs = agent.observe()
    assert all(not m.known for m in obs.models)
    assert any("metrics unavailable" in e for e in obs.errors)


def test_adopt_then_lend_full_cycle(tmp_path: Path) -> None:
    """Unknown nodes are adopted into serving; a LEND walks retiring -> lending -> lent."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    agent.tick()
    assert set(phases(agent).values()) == {Phase.SERVING}
    obs = agent.observe()
    gpu2 = next(v for v in obs.nodes if v.name == "gpu2")
    lend = Action(ActionKind.LEND, "gpu2", "m", Phase.SERVING, Phase.RETIRING, "low load")
    steps = agent.run_actions([lend], obs)
    assert [(s.from_phase, s.to_phase, s.outcome) for s in steps] == [
        (Phase.SERVING, Phase.RETIRING, "ok"),
        (Phase.RETIRING, Phase.LENDING, "ok"),
        (Phase.LENDING, Phase.LENT, "ok"),
    ]
    assert phases(agent)["gpu2"] is Phase.LENT
    assert engine.up["gpu2"] is False
    assert "DRAIN" not in slurm.node_map["gpu2"].flags
    assert gpu2.phase is Phase.SERVING


def test_reclaim_requeues_lent_jobs_and_restarts_engine(tmp_path: Path) -> None:
    """Reclaim drains, requeues only idle-partition jobs, waits for the node, starts the engine."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = slurm.node_map["gpu1"].__class__(
        name="gpu1", state="mixed", comment=format_lent_comment("slurm-idle", T0))
    engine.up["gpu1"] = False
    slurm.job_list = [SlurmJob(job_id=7, name="train", partition="idle", state="RUNNING", nodes=("gpu1",))]
    obs = agent.observe()
    view = next(v for v in obs.nodes if v.name == "gpu1")
    assert view.phase is Phase.LENT
    steps = agent.run_actions(
        [Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")], obs)
    assert [s.to_phase for s in steps] == [Phase.RECLAIMING, Phase.STARTING, Phase.SERVING]
    assert ("requeue", "7") in slurm.log
    assert slurm.job_list[0].state == "PENDING" and slurm.job_list[0].restart_count == 1
    assert engine.up["gpu1"] is True
    assert phases(agent)["gpu1"] is Phase.SERVING
    assert slurm.node_map["gpu1"].comment == ""


def test_slow_start_is_left_for_next_tick(tmp_path: Path) -> None:
    """An engine not healthy by the budget leaves the node STARTING; the next tick finishes."""
    agent, slurm, engine, _, _clock = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu3"] = slurm.node_map["gpu3"].__class__(
        name="gpu3", state="idle", flags=frozenset({"DRAIN"}),
        reason=format_reason("slurm-idle", Phase.RECLAIMING, T0))
    engine.up["gpu3"] = False
    engine.start_delay_polls = 50  # 50 s of polling > 10 s budget
    result = agent.tick()
    assert any(s.node == "gpu3" and s.outcome == "waiting" for s in result.steps)
    assert phases(agent)["gpu3"] is Phase.STARTING
    engine._pending["gpu3"] = 0
    agent.tick()
    assert phases(agent)["gpu3"] is Phase.SERVING


def test_admin_node_never_touched_even_if_asked(tmp_path: Path) -> None:
    """An action on an admin-drained node is refused by the edge table; Slurm sees no write."""
    agent, slurm, *_ = make_agent(tmp_path)
    slurm.node_map["gpu1"] = slurm.node_map["gpu1"].__class__(
        name="gpu1", state="idle", flags=frozenset({"DRAIN"}), reason="admin: disk check")
    obs = agent.observe()
    bogus = Action(ActionKind.RECLAIM, "gpu1", "m", Phase.ADMIN, Phase.RECLAIMING, "bug")
    steps = agent.run_actions([bogus], obs)
    assert steps[0].outcome == "error"
    assert not [c for c in slurm.log if c[0] in {"drain", "resume", "set_comment"}]
    assert slurm.node_map["gpu1"].reason == "admin: disk check"


def test_effector_failure_is_journaled_not_raised(tmp_path: Path) -> None:
    """A failing scontrol becomes an error outcome in the journal; the tick completes."""
    agent, slurm, *_ = make_agent(tmp_path, planner=continue_all)
    slurm.fail_on = {"drain"}
    result = agent.tick()
    assert result.errors == 3
    records = list(Journal(tmp_path / "journal.jsonl").records())
    assert [r["outcome"] for r in records if r["event"] == "transition"] == ["error"] * 3
    assert records[-1]["event"] == "tick" and records[-1]["errors"] == 3


def test_second_tick_is_locked_out(tmp_path: Path) -> None:
    """While one tick holds the lock another returns at once without acting."""
    agent, slurm, *_ = make_agent(tmp_path, planner=continue_all)
    with try_lock(tmp_path / "tick.lock") as got:
        assert got
        result = agent.tick()
    assert result.locked_out and "another tick" in result.locked_out
    assert slurm.log == []


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    """--dry-run plans but makes no Slurm write and writes no journal."""
    agent, slurm, *_ = make_agent(tmp_path, planner=continue_all)
    result = agent.tick(dry_run=True)
    assert len(result.actions) == 3
    assert [c[0] for c in slurm.log] == ["jobs", "nodes"]
    assert not (tmp_path / "journal.jsonl").exists()


def test_tick_is_idempotent(tmp_path: Path) -> None:
    """Once converged, another tick with the same world plans and writes nothing."""
    agent, slurm, *_ = make_agent(tmp_path, planner=continue_all)
    agent.tick()
    slurm.log.clear()
    result = agent.tick()
    assert result.actions == [] and result.steps == []
    assert [c[0] for c in slurm.log] == ["jobs", "nodes"]


@pytest.mark.parametrize("crash_after", range(1, 4))
def test_crash_mid_reclaim_converges(tmp_path: Path, crash_after: int) -> None:
    """Killing a reclaim after any number of Slurm writes, the next tick still converges."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    agent.tick()  # adopt all
    obs = agent.observe()
    lend = Action(ActionKind.LEND, "gpu1", "m", Phase.SERVING, Phase.RETIRING, "low")
    agent.run_actions([lend], obs)
    writes = 0
    real_drain = slurm.drain

    class Crash(BaseException):
        pass

    def crashing_drain(node: str, reason: str) -> None:
        nonlocal writes
        real_drain(node, reason)
        writes += 1
        if writes == crash_after:
            raise Crash

    slurm.drain = crashing_drain  # type: ignore[method-assign]
    obs = agent.observe()
    with pytest.raises(Crash):
        agent.run_actions(
            [Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "up")], obs)
    slurm.drain = real_drain  # type: ignore[method-assign]
    for _ in range(3):
        agent.tick()
    assert phases(agent)["gpu1"] is Phase.SERVING
    assert engine.up["gpu1"] is True


def low_load(metrics: FakeMetrics) -> None:
    from slurm_idle.model import ReplicaLoad

    metrics.models["m"] = ModelLoad(model="m", generation_tokens_per_s=10.0,
                                    demand_tokens_per_s_max_window=10.0,
                                    waiting_max_window=0.0, waiting_min_window=0.0)
    metrics.replicas = {n: ReplicaLoad(model="m", node=n) for n in ("gpu1", "gpu2", "gpu3")}


def test_real_planner_adopts_then_lends_to_the_floor(tmp_path: Path) -> None:
    """With the real plan(): unmanaged nodes are adopted, then low load lends all but the floor."""
    from slurm_idle import policy

    agent, _slurm, engine, metrics, _ = make_agent(tmp_path, planner=policy.plan)
    agent.assessor = policy.assess
    low_load(metrics)
    for _ in range(4):
        agent.tick()
    final = phases(agent)
    assert sorted(p.value for p in final.values()) == ["lent", "lent", "serving"]
    serving = [n for n, p in final.items() if p is Phase.SERVING]
    assert engine.up[serving[0]] is True
    assert [n for n, up in engine.up.items() if not up] == sorted(n for n, p in final.items() if p is Phase.LENT)


def test_real_planner_reclaims_when_queue_builds(tmp_path: Path) -> None:
    """With the real plan(): a sustained queue brings lent nodes back to serving in one tick."""
    from slurm_idle import policy

    agent, _slurm, _engine, metrics, _ = make_agent(tmp_path, planner=policy.plan)
    agent.assessor = policy.assess
    low_load(metrics)
    for _ in range(4):
        agent.tick()
    metrics.models["m"] = ModelLoad(model="m", generation_tokens_per_s=50_000.0, waiting=40,
                                    waiting_min_recent=30,
                                    demand_tokens_per_s_max_window=50_000.0,
                                    waiting_max_window=40, waiting_min_window=30)
    # the present demand is the serving replica's (metrics.serving): the load shows there
    serving = next(n for n, p in phases(agent).items() if p is Phase.SERVING)
    metrics.replicas[serving] = ReplicaLoad(model="m", node=serving, running=16, waiting=40,
                                            generation_tokens_per_s=50_000.0)
    agent.tick()
    assert set(phases(agent).values()) == {Phase.SERVING}


def test_admin_drain_during_a_wait_is_respected(tmp_path: Path) -> None:
    """An admin who drains a retiring node while it drains requests keeps it: no resume, no rewrite."""
    agent, slurm, engine, _, clock = make_agent(tmp_path, planner=continue_all)
    agent.tick()
    engine.running["gpu1"] = 3.0  # requests in flight: the retire step waits
    real_sleep = clock.sleep

    def admin_acts_while_we_wait(s: float) -> None:
        node = slurm.node_map["gpu1"]
        slurm.node_map["gpu1"] = node.__class__(name="gpu1", state="idle", flags=frozenset({"DRAIN"}),
                                                reason="admin: disk check")
        real_sleep(s)

    agent.sleep = admin_acts_while_we_wait
    obs = agent.observe()
    steps = agent.run_actions(
        [Action(ActionKind.LEND, "gpu1", "m", Phase.SERVING, Phase.RETIRING, "low")], obs)
    assert steps[-1].outcome == "skipped"
    assert slurm.node_map["gpu1"].reason == "admin: disk check"
    assert "DRAIN" in slurm.node_map["gpu1"].flags
    assert engine.up["gpu1"] is True


def test_unexpected_exception_becomes_an_error_outcome(tmp_path: Path) -> None:
    """A bug-class exception in an effector is journaled as an error; the tick still completes."""
    agent, _slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)

    def broken_start(replica: object, timeout_s: float | None = None) -> None:
        raise ConnectionError("engine socket vanished")

    engine.start = broken_start  # type: ignore[method-assign]
    for n in ("gpu1", "gpu2", "gpu3"):
        engine.up[n] = False
    result = agent.tick()
    assert result.error is None
    assert {s.outcome for s in result.steps if s.to_phase is Phase.STARTING} == {"error"}
    assert any("ConnectionError" in (s.error or "") for s in result.steps)


def test_jobs_left_running_by_a_killed_tick_are_requeued_next_tick(tmp_path: Path) -> None:
    """A node RECLAIMING with idle jobs still RUNNING (tick died before requeue) is requeued at once."""
    agent, slurm, _engine, _, _ = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = slurm.node_map["gpu1"].__class__(
        name="gpu1", state="mixed", flags=frozenset({"DRAIN"}),
        reason=format_reason("slurm-idle", Phase.RECLAIMING, T0))
    slurm.job_list = [SlurmJob(job_id=9, name="t", partition="idle", state="RUNNING", nodes=("gpu1",))]
    agent.tick()
    assert ("requeue", "9") in slurm.log
    assert phases(agent)["gpu1"] is Phase.SERVING


def test_pool_node_missing_from_slurm_is_left_out_and_not_admin(tmp_path: Path) -> None:
    """A configured node Slurm does not know is reported (one error line), left out of the
    snapshot (it is no capacity), never acted on."""
    agent, slurm, *_ = make_agent(tmp_path, planner=continue_all)
    del slurm.node_map["gpu3"]
    obs = agent.observe()
    assert "gpu3" not in {v.name for v in obs.nodes}
    assert any("not known to Slurm, left out: gpu3" in e for e in obs.errors)
    from slurm_idle import policy

    assert all(a.node != "gpu3" for a in policy.plan(obs, agent.config, obs.now))


def lent_with_jobs(slurm: FakeSlurm, engine: FakeEngine, jobs: dict[str, list[SlurmJob]]) -> None:
    for node, node_jobs in jobs.items():
        slurm.node_map[node] = slurm.node_map[node].__class__(
            name=node, state="mixed", comment=format_lent_comment("slurm-idle", T0))
        engine.up[node] = False
        slurm.job_list += node_jobs


def reclaim_all(agent: Agent, nodes: list[str]) -> list:
    obs = agent.observe()
    return agent.run_actions(
        [Action(ActionKind.RECLAIM, n, "m", Phase.LENT, Phase.RECLAIMING, "load rose") for n in nodes], obs)


def test_admin_drain_during_the_engine_stop_is_respected(tmp_path: Path) -> None:
    """An engine stop can take minutes; an admin who drains the node meanwhile keeps it:
    no RESUME, no comment, their reason intact (the review found RESUME undoing the drain)."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    agent.tick()
    real_stop = engine.stop

    def slow_stop_while_admin_drains(replica: object, timeout_s: float | None = None) -> None:
        node = slurm.node_map["gpu2"]
        slurm.node_map["gpu2"] = node.__class__(name="gpu2", state="idle", flags=frozenset({"DRAIN"}),
                                                reason="admin: disk check")
        real_stop(replica)

    engine.stop = slow_stop_while_admin_drains  # type: ignore[method-assign]
    obs = agent.observe()
    steps = agent.run_actions(
        [Action(ActionKind.LEND, "gpu2", "m", Phase.SERVING, Phase.RETIRING, "low")], obs)
    assert steps[-1].to_phase is Phase.LENT and steps[-1].outcome == "skipped"
    assert slurm.node_map["gpu2"].reason == "admin: disk check"
    assert "DRAIN" in slurm.node_map["gpu2"].flags and slurm.node_map["gpu2"].comment == ""
    assert ("resume", "gpu2") not in slurm.log


def test_plain_jobs_are_requeued_by_slurm_ours_get_the_step_grace(tmp_path: Path) -> None:
    """A plain `sbatch --requeue` script ends when its step is signalled (COMPLETED/FAILED, not
    requeued), so only our own jobs, whose scripts outlive the step, get the pre-signal grace."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    agent.tick()
    lent_with_jobs(slurm, engine, {"gpu1": [
        SlurmJob(job_id=7, name="plain", partition="idle", state="RUNNING", nodes=("gpu1",)),
        SlurmJob(job_id=8, name="ours", partition="idle", state="RUNNING", nodes=("gpu1",),
                 comment="slurm-idle:job,pipeline=p"),
        SlurmJob(job_id=9, name="inference", partition="inference", state="RUNNING", nodes=("gpu3",)),
    ]})
    slurm.no_steps = {8}  # our runner's step ends on the SIGTERM (it checkpointed)
    steps = reclaim_all(agent, ["gpu1"])
    assert steps[-1].to_phase is Phase.SERVING and steps[-1].outcome == "ok"
    assert agent.config.slurm.requeue_grace_s > 0
    # ours: SIGTERM to its steps, requeued once they ended; the plain one: requeued at once
    assert slurm.signals == [((8,), "TERM", False)]
    assert sorted(slurm.requeues) == [((7,), 0), ((8,), 0)]


def test_a_surge_reclaim_shares_its_job_queries_and_starts_each_engine_once(tmp_path: Path) -> None:
    """Reclaiming every node at once reads the job queue through the shared poll (not one
    full `squeue` per node and step) and starts each engine once, even while it warms up."""
    agent, slurm, engine, _, clock = make_agent(tmp_path, planner=continue_all)
    agent.tick()
    nodes = ["gpu1", "gpu2", "gpu3"]
    lent_with_jobs(slurm, engine, {n: [SlurmJob(job_id=i, name="t", partition="idle", state="RUNNING",
                                                nodes=(n,))] for i, n in enumerate(nodes, 1)})
    engine.start_delay_polls = 1  # not serving at the first health check after start
    engine.log.clear()
    obs = agent.observe()
    asked_at: list[float] = []
    real_jobs = slurm.jobs

    def timed_jobs() -> list[SlurmJob]:
        asked_at.append(clock())
        return real_jobs()

    slurm.jobs = timed_jobs  # type: ignore[method-assign]
    steps = agent.run_actions(
        [Action(ActionKind.RECLAIM, n, "m", Phase.LENT, Phase.RECLAIMING, "surge") for n in nodes], obs)
    assert {s.node for s in steps if s.to_phase is Phase.SERVING and s.outcome == "ok"} == set(nodes)
    # At most one queue read per poll interval, shared by the three node threads.
    assert asked_at and all(b - a >= POLL_S for a, b in itertools.pairwise(asked_at)), asked_at
    assert sorted(n for kind, n in engine.log if kind == "start") == nodes


def test_actions_run_on_a_bounded_pool(tmp_path: Path) -> None:
    """Acting on many nodes uses at most `max_workers` threads at once (default 32), not one
    per node: hundreds of nodes must not fork hundreds of scontrol/engine commands together."""
    import threading
    import time

    from slurm_idle.agent import MAX_ACTION_WORKERS

    assert MAX_ACTION_WORKERS == 32
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    agent.max_workers = 2
    for n in ("gpu1", "gpu2", "gpu3"):
        slurm.node_map[n] = slurm.node_map[n].__class__(
            name=n, state="idle", flags=frozenset({"DRAIN"}),
            reason=format_reason("slurm-idle", Phase.LENDING, T0))
    lock, busy, most = threading.Lock(), [0], [0]
    real_stop = engine.stop

    def counted_stop(replica: object, timeout_s: float | None = None) -> None:
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        time.sleep(0.1)  # real time: the three threads would overlap without the cap
        with lock:
            busy[0] -= 1
        real_stop(replica)

    engine.stop = counted_stop  # type: ignore[method-assign]
    agent.tick()
    assert set(phases(agent).values()) == {Phase.LENT}
    assert most[0] == 2
