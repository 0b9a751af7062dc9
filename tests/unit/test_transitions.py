"""The effectors' edge cases: engine calls bounded by the tick's deadline, jobs that are not ours
holding a reclaim up, and an admin's node Comment surviving a lend and a reclaim."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine import EngineDeadline, HttpSleepEngine
from slurm_idle.httpdeadline import HttpResponse
from slurm_idle.journal import Journal
from slurm_idle.lifecycle import derive_phase, format_lent_comment, format_reason
from slurm_idle.model import Action, ActionKind, Phase, SlurmJob
from slurm_idle.testing.fakes import FakeEngine, FakeSlurm
from slurm_idle.transitions import (
    MIN_ENGINE_CALL_S,
    NodeDriver,
    StepResult,
    admin_comment,
    lent_comment,
)
from tests.unit.test_agent import T0, Clock, continue_all, make_agent, phases

TAG = "slurm-idle"
BUDGET = 10.0  # make_agent's timeouts.tick_budget_s


class SlowEngine(FakeEngine):
    """A FakeEngine whose start/stop take `needs_s` of (fake) time, or stop at the caller's
    `timeout_s` with EngineDeadline, as the real engines do."""

    def __init__(self, clock: Clock, up: dict[str, bool], needs_s: float) -> None:
        super().__init__(up=up)
        self.clock, self.needs_s = clock, needs_s
        self.timeouts: list[tuple[str, float | None]] = []

    def _take(self, op: str, replica: ReplicaConfig, timeout_s: float | None) -> None:
        self.timeouts.append((op, timeout_s))
        if timeout_s is not None and timeout_s < self.needs_s:
            self.clock.t += timeout_s
            raise EngineDeadline(f"{replica.node}: {op} still running after {timeout_s:g} s")
        self.clock.t += self.needs_s

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        self._take("start", replica, timeout_s)
        super().start(replica)

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        self._take("stop", replica, timeout_s)
        super().stop(replica)


def slow_agent(tmp_path: Path, needs_s: float, **timeouts: float):
    agent, slurm, _, _metrics, clock = make_agent(tmp_path, planner=continue_all, **timeouts)
    engine = SlowEngine(clock, {"gpu1": True, "gpu2": True, "gpu3": True}, needs_s)
    agent.engine_for = lambda model: engine
    for n in ("gpu1", "gpu2", "gpu3"):
        slurm.node_map[n] = replace(slurm.node_map[n], flags=frozenset({"DRAIN"}),
                                    reason=format_reason(TAG, Phase.SERVING, T0))
    return agent, slurm, engine, clock


def set_phase(slurm: FakeSlurm, node: str, phase: Phase, since: float = T0) -> None:
    slurm.node_map[node] = replace(slurm.node_map[node], flags=frozenset({"DRAIN"}),
                                   reason=format_reason(TAG, phase, since))


# --- engine calls within the tick's deadline ---------------------------------------------------


def test_slow_stop_is_cut_at_the_deadline_and_carried_over(tmp_path: Path) -> None:
    """A stop that would take 200 s gets the tick's time left; the node stays LENDING (drained,
    not resumed, no comment) with a journaled why, and the next tick re-issues the stop."""
    agent, slurm, engine, clock = slow_agent(tmp_path, needs_s=200.0)
    set_phase(slurm, "gpu1", Phase.LENDING)
    started = clock()
    result = agent.tick()
    assert clock() - started <= BUDGET + MIN_ENGINE_CALL_S
    [(op, given)] = engine.timeouts
    assert op == "stop" and given is not None and given <= BUDGET
    [step] = [s for s in result.steps if s.node == "gpu1"]
    assert (step.to_phase, step.outcome) == (Phase.LENT, "waiting")
    assert step.detail and "carried over to the next tick" in step.detail and "re-issues the stop" in step.detail
    assert phases(agent)["gpu1"] is Phase.LENDING
    assert ("resume", "gpu1") not in slurm.log and slurm.node_map["gpu1"].comment == ""
    journaled = [r for r in Journal(tmp_path / "journal.jsonl").records() if r.get("node") == "gpu1"]
    assert "carried over" in journaled[-1]["detail"]
    engine.needs_s = 1.0
    agent.tick()
    assert [op for op, _ in engine.timeouts] == ["stop", "stop"]
    assert phases(agent)["gpu1"] is Phase.LENT


def test_slow_start_is_cut_and_the_next_tick_reissues_it(tmp_path: Path) -> None:
    """A start that outlasts the tick leaves the node STARTING (not an error); the next tick
    sees it not serving and starts it again."""
    agent, slurm, engine, clock = slow_agent(tmp_path, needs_s=600.0)
    set_phase(slurm, "gpu1", Phase.RECLAIMING)
    engine.up["gpu1"] = False
    started = clock()
    result = agent.tick()
    assert clock() - started <= BUDGET + MIN_ENGINE_CALL_S
    steps = [(s.to_phase, s.outcome) for s in result.steps if s.node == "gpu1"]
    assert steps == [(Phase.STARTING, "ok"), (Phase.SERVING, "waiting")]
    assert "re-checks health" in (result.steps[-1].detail or "")
    assert phases(agent)["gpu1"] is Phase.STARTING
    engine.needs_s = 0.5
    agent.tick()
    assert [op for op, _ in engine.timeouts] == ["start", "start"]
    assert phases(agent)["gpu1"] is Phase.SERVING


def test_a_quick_start_past_the_deadline_still_completes(tmp_path: Path) -> None:
    """An engine call at (or past) the deadline still gets MIN_ENGINE_CALL_S: a sub-second
    emulator start completes and the node serves in the same drive."""
    agent, slurm, engine, clock = slow_agent(tmp_path, needs_s=0.5)
    set_phase(slurm, "gpu1", Phase.RECLAIMING)
    engine.up["gpu1"] = False
    driver = NodeDriver(agent.config, slurm, agent.engine_for, clock, clock.sleep)
    view = next(v for v in agent.observe().nodes if v.name == "gpu1")
    action = Action(ActionKind.CONTINUE, "gpu1", "m", Phase.RECLAIMING, Phase.STARTING, "continue")
    steps = driver.drive(view, action, deadline=clock() - 1.0)
    assert engine.timeouts == [("start", MIN_ENGINE_CALL_S)]
    assert [(s.to_phase, s.outcome) for s in steps] == [(Phase.STARTING, "ok"), (Phase.SERVING, "ok")]


def test_a_stop_cut_every_tick_is_reported_stuck_past_its_timeout(tmp_path: Path) -> None:
    """Carrying over does not hide a transition that never ends: past timeouts.lend_s it is stuck."""
    agent, slurm, _engine, clock = slow_agent(tmp_path, needs_s=200.0, lend_s=60)
    set_phase(slurm, "gpu1", Phase.LENDING, since=clock() - 120)
    result = agent.tick()
    [step] = [s for s in result.steps if s.node == "gpu1"]
    assert step.outcome == "stuck" and result.errors >= 1
    assert step.error and "longer than its timeout" in step.error and "carried over" in step.error


def test_engines_without_timeout_s_are_still_called(tmp_path: Path) -> None:
    """An engine written before `timeout_s` existed (the shipped FakeEngine) works unchanged."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    set_phase(slurm, "gpu1", Phase.LENDING)
    agent.tick()
    assert ("stop", "gpu1") in engine.log
    assert phases(agent)["gpu1"] is Phase.LENT


# --- the driver waits for the engine, the engine never waits ---------------------------------------


class StillAwake(FakeEngine):
    """A FakeEngine whose stop is taken (one call) but whose GPUs are not released until told;
    `old` names a vLLM too old to keep in-flight requests through a stop."""

    def __init__(self, up: dict[str, bool], old: str | None = None) -> None:
        super().__init__(up=up)
        self.asleep: set[str] = set()
        self.old = old

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        self.log.append(("stop", replica.name))

    def released(self, replica: ReplicaConfig) -> bool:
        return replica.name in self.asleep

    def stop_drops_requests(self, replica: ReplicaConfig) -> str | None:
        return self.old


def still_awake_agent(tmp_path: Path, old: str | None = None, **timeouts: float):
    agent, slurm, _, _metrics, clock = make_agent(tmp_path, planner=continue_all, **timeouts)
    engine = StillAwake({"gpu1": True, "gpu2": True, "gpu3": True}, old)
    agent.engine_for = lambda model: engine
    set_phase(slurm, "gpu1", Phase.LENDING, since=clock())
    for n in ("gpu2", "gpu3"):
        set_phase(slurm, n, Phase.SERVING)
    return agent, slurm, engine, clock


def test_a_stop_not_yet_taken_effect_keeps_the_node_lending(tmp_path: Path) -> None:
    """The driver polls `released` until the tick's deadline: an engine not asleep yet keeps
    its node LENDING (not resumed), carried over; once released, the next tick lends it."""
    agent, slurm, engine, clock = still_awake_agent(tmp_path)
    started = clock()
    result = agent.tick()
    assert clock() - started <= BUDGET + MIN_ENGINE_CALL_S
    [step] = [s for s in result.steps if s.node == "gpu1"]
    assert (step.to_phase, step.outcome) == (Phase.LENT, "waiting")
    assert step.detail and "not stopped (or asleep) yet" in step.detail
    assert ("resume", "gpu1") not in slurm.log and phases(agent)["gpu1"] is Phase.LENDING
    engine.asleep.add("gpu1")
    agent.tick()
    assert phases(agent)["gpu1"] is Phase.LENT
    assert engine.log.count(("stop", "gpu1")) == 2  # re-issued (idempotent), then released


def test_an_old_server_is_drained_by_the_driver_before_its_stop(tmp_path: Path) -> None:
    """A vLLM that would drop in-flight requests on a stop is not stopped while requests run:
    the tick's deadline carries it over; past engine.drain_timeout_s (60 s, from LENDING's
    start) the stop goes ahead anyway."""
    agent, slurm, engine, clock = still_awake_agent(tmp_path, old="vLLM 0.16.0 lacks mode=wait")
    engine.running["gpu1"] = 2
    config = agent.config.model_copy(
        update={"engine": agent.config.engine.model_copy(update={"drain_timeout_s": 60})})
    driver = NodeDriver(config, slurm, agent.engine_for, clock, clock.sleep)
    view = next(v for v in agent.observe().nodes if v.name == "gpu1")
    action = Action(ActionKind.CONTINUE, "gpu1", "m", Phase.LENDING, Phase.LENT, "continue")
    [step] = driver.drive(view, action, deadline=clock() - 10.0)  # no time left: MIN_ENGINE_CALL_S
    assert step.outcome == "waiting" and "the next tick drains on" in (step.detail or "")
    assert ("stop", "gpu1") not in engine.log
    engine.asleep.add("gpu1")
    [step] = driver.drive(view, action, deadline=clock() + 120)  # the drain window ends first
    assert step.outcome == "ok" and ("stop", "gpu1") in engine.log
    assert clock() >= (view.phase_since or 0) + 60


class ClockedHttp:
    """An HTTP client for every replica: each request takes `cost_s` of the fake clock; the
    server answers /health and /version, never says it is asleep until `asleep` is set."""

    def __init__(self, clock: Clock, cost_s: float = 1.0) -> None:
        self.clock, self.cost_s, self.asleep, self.calls = clock, cost_s, False, 0

    def request(self, method: str, url: str, timeout: float) -> HttpResponse:
        self.calls += 1
        self.clock.t += min(self.cost_s, timeout)
        if url.endswith("/is_sleeping"):
            return HttpResponse(200, json.dumps({"is_sleeping": self.asleep}).encode())
        if url.endswith("/version"):
            return HttpResponse(200, b'{"version": "0.18.0"}')
        if method == "POST" or url.endswith("/health"):
            return HttpResponse(200, b"")
        return HttpResponse(404, b"")


def test_the_sleep_engine_never_blocks_the_tick_past_its_deadline(tmp_path: Path) -> None:
    """A real http-sleep engine on a server that never reports asleep (each request costing a
    second): the tick ends at its deadline (plus MIN_ENGINE_CALL_S) with the node LENDING, not
    after the engine's own stop_timeout_s of 600 s; asleep, the next tick lends it."""
    agent, _slurm, _engine, clock = still_awake_agent(tmp_path)
    http = ClockedHttp(clock)
    engine = HttpSleepEngine(EngineConfig(kind="http-sleep", stop_timeout_s=600, drain_timeout_s=600),
                             http=http)
    agent.engine_for = lambda model: engine
    started = clock()
    result = agent.tick()
    assert clock() - started <= BUDGET + MIN_ENGINE_CALL_S + 2 * http.cost_s
    [step] = [s for s in result.steps if s.node == "gpu1"]
    assert step.outcome == "waiting" and phases(agent)["gpu1"] is Phase.LENDING
    http.asleep = True
    agent.tick()
    assert phases(agent)["gpu1"] is Phase.LENT


def test_a_router_that_cannot_be_told_keeps_the_group_serving(tmp_path: Path) -> None:
    """Retiring tells the router first (PoolRouters): a failed remove leaves the node SERVING,
    unmarked, for the next tick; a router told keeps the node's requests off it first."""
    from slurm_idle.testing.fake_router import FakeRouterSet

    agent, slurm, _engine, _, _ = make_agent(tmp_path)
    set_phase(slurm, "gpu1", Phase.SERVING)
    routers = FakeRouterSet(fail_on={"remove"})
    driver = NodeDriver(agent.config, slurm, agent.engine_for, agent.clock, agent.sleep, router=routers)
    view = next(v for v in agent.observe().nodes if v.name == "gpu1")
    action = Action(ActionKind.LEND, "gpu1", "m", Phase.SERVING, Phase.RETIRING, "idle")
    [step] = driver.drive(view, action, deadline=agent.clock() + 5)
    assert step.outcome == "error" and "router remove failed" in (step.error or "")
    assert phases(agent)["gpu1"] is Phase.SERVING
    routers.fail_on.clear()
    steps = driver.drive(view, action, deadline=agent.clock() + 5)
    assert steps[0].outcome == "ok" and routers.log[-1] == ("remove", "gpu1", "idle")


# --- jobs that are not ours --------------------------------------------------------------------


def test_a_foreign_job_is_named_then_cancelled_and_the_reclaim_never_sticks(tmp_path: Path) -> None:
    """A job of another partition on a reclaimed node is named while it holds the reclaim up
    (the waiting step and the journal), then cancelled once slurm.requeue_grace_s is over: the
    next tick finds the node empty instead of stuck behind it (never requeued by default)."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], state="mixed",
                                     comment=format_lent_comment(TAG, T0))
    engine.up["gpu1"] = False
    slurm.job_list = [SlurmJob(job_id=123, name="x", partition="inference", state="RUNNING", nodes=("gpu1",))]
    obs = agent.observe()
    steps = agent.run_actions(
        [Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")], obs)
    assert not slurm.requeues and slurm.signals == [((123,), "TERM", False)]
    assert steps[-1].outcome == "waiting"
    assert steps[-1].detail == ("waiting for job 123 (partition inference), not ours: signalled, "
                                "cancelled after slurm.requeue_grace_s")
    # The grace (30 s, counted from the drain) is over by the next tick: cancelled, not stuck.
    set_phase(slurm, "gpu1", Phase.RECLAIMING, since=agent.clock() - 10_000)
    result = agent.tick()
    assert next(s.outcome for s in result.steps if s.node == "gpu1") != "stuck"
    assert ("cancel", "123") in slurm.log and not slurm.requeues and not slurm.job_list
    assert phases(agent)["gpu1"] in {Phase.STARTING, Phase.SERVING}
    records = Journal(tmp_path / "journal.jsonl").records()
    actions = [r["action"] for r in records if r.get("event") == "foreign_job"]
    assert actions[:2] == ["signalled", "cancelled"] and "error" not in actions


# --- the admin's node Comment ------------------------------------------------------------------


def test_comment_helpers_keep_the_admin_text() -> None:
    """Our marker goes first (what derive_phase reads), the admin's text after it, and comes back out."""
    assert lent_comment(TAG, T0, "") == format_lent_comment(TAG, T0)
    both = lent_comment(TAG, T0, "rack 4: PSU replaced")
    assert both == f"{format_lent_comment(TAG, T0)} | rack 4: PSU replaced"
    assert admin_comment(both, TAG) == "rack 4: PSU replaced"
    assert admin_comment(format_lent_comment(TAG, T0), TAG) == ""
    assert admin_comment("rack 4", TAG) == "rack 4"
    # A second lend does not nest our marker.
    assert lent_comment(TAG, T0 + 60, both) == f"{format_lent_comment(TAG, T0 + 60)} | rack 4: PSU replaced"


def test_the_combined_comment_still_reads_as_lent() -> None:
    """Phase recovery from Slurm is unchanged: a lent node with an admin's text is LENT since ours."""
    from slurm_idle.model import SlurmNode

    node = SlurmNode(name="gpu1", state="idle", comment=lent_comment(TAG, T0, "rack 4 | spare"))
    info = derive_phase(node, TAG)
    assert info.phase is Phase.LENT and info.since == T0 and not info.pinned


def test_lend_and_reclaim_keep_an_admin_comment(tmp_path: Path) -> None:
    """An admin's node Comment survives a lend (after our marker) and a reclaim (as it was)."""
    agent, slurm, _engine, _, _ = make_agent(tmp_path, planner=continue_all)
    agent.tick()  # adopt all into serving
    slurm.node_map["gpu2"] = replace(slurm.node_map["gpu2"], comment="rack 4: PSU replaced")
    obs = agent.observe()
    agent.run_actions([Action(ActionKind.LEND, "gpu2", "m", Phase.SERVING, Phase.RETIRING, "low")], obs)
    assert phases(agent)["gpu2"] is Phase.LENT
    assert slurm.node_map["gpu2"].comment.endswith(" | rack 4: PSU replaced")
    obs = agent.observe()
    agent.run_actions([Action(ActionKind.RECLAIM, "gpu2", "m", Phase.LENT, Phase.RECLAIMING, "up")], obs)
    assert phases(agent)["gpu2"] is Phase.SERVING
    assert slurm.node_map["gpu2"].comment == "rack 4: PSU replaced"


def test_a_foreign_comment_is_never_written(tmp_path: Path) -> None:
    """Adopting a node, or bringing a half-lent node back, leaves a Comment that is not ours alone."""
    agent, slurm, _engine, _, _ = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], comment="owner: team-a")
    set_phase(slurm, "gpu3", Phase.LENDING)
    slurm.node_map["gpu3"] = replace(slurm.node_map["gpu3"], comment="owner: team-b")
    obs = agent.observe()
    agent.run_actions([Action(ActionKind.RECLAIM, "gpu3", "m", Phase.LENDING, Phase.STARTING, "up")], obs)
    agent.tick()
    assert phases(agent)["gpu1"] is Phase.SERVING and phases(agent)["gpu3"] is Phase.SERVING
    assert not [c for c in slurm.log if c[0] == "set_comment"]
    assert slurm.node_map["gpu1"].comment == "owner: team-a"
    assert slurm.node_map["gpu3"].comment == "owner: team-b"


def test_a_failed_lend_takes_only_our_marker_off(tmp_path: Path) -> None:
    """LENDING -> STARTING after a lend that wrote its comment restores the admin's text."""
    agent, slurm, _engine, _, _ = make_agent(tmp_path, planner=continue_all)
    set_phase(slurm, "gpu1", Phase.LENDING)
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], comment=lent_comment(TAG, T0, "rack 4"))
    obs = agent.observe()
    agent.run_actions([Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENDING, Phase.STARTING, "up")], obs)
    assert slurm.node_map["gpu1"].comment == "rack 4"


class LateRequest(FakeEngine):
    """gpu1's in-flight count at each reading: idle right after the router took it out, then
    a request the router forwarded just before arrives, then idle again."""

    def __init__(self, readings: list[float]) -> None:
        super().__init__(up={"gpu1": True, "gpu2": True, "gpu3": True})
        self.readings, self.seen = list(readings), []

    def in_flight(self, replica: ReplicaConfig) -> float | None:
        if replica.name != "gpu1":
            return 0.0
        value = self.readings.pop(0) if self.readings else 0.0
        self.seen.append(value)
        return value


def drive_retiring_gpu1(tmp_path: Path, readings: list[float],
                        time_left_s: float) -> tuple[LateRequest, list[StepResult]]:
    """gpu1 RETIRING (gpu2, gpu3 serving) driven on with `time_left_s` to the tick's deadline,
    its engine's in-flight counts read from `readings`."""
    agent, slurm, _, _metrics, clock = make_agent(tmp_path, planner=continue_all)
    engine = LateRequest(readings)
    agent.engine_for = lambda model: engine
    set_phase(slurm, "gpu1", Phase.RETIRING, since=clock())
    for n in ("gpu2", "gpu3"):
        set_phase(slurm, n, Phase.SERVING)
    driver = NodeDriver(agent.config, slurm, agent.engine_for, clock, clock.sleep)
    view = next(v for v in agent.observe().nodes if v.name == "gpu1")
    action = Action(ActionKind.CONTINUE, "gpu1", "m", Phase.RETIRING, Phase.LENDING, "continue")
    return engine, driver.drive(view, action, deadline=clock() + time_left_s)


def test_a_retiring_replica_is_drained_only_when_idle_at_two_readings(tmp_path: Path) -> None:
    """A request on its way when the router took the replica out is not yet counted by the
    engine: the first idle reading is not enough to stop it; RETIRING ends after two idle
    readings a poll apart, not at the first one (which stopped the engine under a request)."""
    engine, steps = drive_retiring_gpu1(tmp_path, [0.0, 1.0, 0.0, 0.0], time_left_s=60)
    assert steps[0].outcome == "ok", steps
    assert engine.seen[:4] == [0.0, 1.0, 0.0, 0.0]  # not done at the first idle reading


def test_two_idle_readings_close_together_are_one(tmp_path: Path) -> None:
    """With the tick's deadline 0.05 s away the driver's wait is cut short: two idle readings
    0.05 s apart do not end the drain (a request may still be on its way); it carries over."""
    engine, steps = drive_retiring_gpu1(tmp_path, [0.0, 0.0], time_left_s=0.05)
    assert len(engine.seen) >= 2 and steps[0].outcome == "waiting", (engine.seen, steps)
