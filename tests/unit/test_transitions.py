"""The effectors' edge cases: engine calls bounded by the tick's deadline, jobs that are not ours
holding a reclaim up, and an admin's node Comment surviving a lend and a reclaim."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from slurm_idle.config import ReplicaConfig
from slurm_idle.engine import EngineDeadline
from slurm_idle.journal import Journal
from slurm_idle.lifecycle import derive_phase, format_lent_comment, format_reason
from slurm_idle.model import Action, ActionKind, Phase, SlurmJob
from slurm_idle.testing.fakes import FakeEngine, FakeSlurm
from slurm_idle.transitions import (
    MIN_ENGINE_CALL_S,
    NodeDriver,
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


# --- jobs that are not ours --------------------------------------------------------------------


def test_a_foreign_job_is_not_requeued_and_is_named(tmp_path: Path) -> None:
    """A job of another partition on a reclaimed node is left alone; the waiting step, the stuck
    report and the journal name it, so the admin sees what holds the reclaim up."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], state="mixed",
                                     comment=format_lent_comment(TAG, T0))
    engine.up["gpu1"] = False
    slurm.job_list = [SlurmJob(job_id=123, name="x", partition="inference", state="RUNNING", nodes=("gpu1",))]
    obs = agent.observe()
    steps = agent.run_actions(
        [Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")], obs)
    assert not slurm.requeues
    assert steps[-1].outcome == "waiting"
    assert steps[-1].detail == "waiting for job 123 (partition inference), not ours to requeue"
    # Still there past timeouts.reclaim_s: stuck, and the report says why.
    set_phase(slurm, "gpu1", Phase.RECLAIMING, since=agent.clock() - 10_000)
    result = agent.tick()
    [step] = [s for s in result.steps if s.node == "gpu1"]
    assert step.outcome == "stuck"
    assert step.error and "job 123 (partition inference), not ours to requeue" in step.error
    record = [r for r in Journal(tmp_path / "journal.jsonl").records() if r.get("node") == "gpu1"][-1]
    assert "job 123 (partition inference)" in record["error"]
    assert not slurm.requeues


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
