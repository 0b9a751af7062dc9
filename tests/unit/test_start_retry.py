"""A failed wake recovers: retried with a backoff, then once cold where the engine can, then
given up (the node to the admin, SlurmIdleWakeFailed); the planner stops counting a replica
whose start failed at once and reclaims another."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle.engine_notes import BACKOFF_BASE_S, EngineNotes, StartFailures, notes_path
from slurm_idle.journal import StepOutcome
from slurm_idle.lifecycle import derive_phase, format_reason
from slurm_idle.model import Action, ActionKind, NodeView, Phase
from slurm_idle.testing.fakes import FakeEngine, FakeSlurm
from slurm_idle.transitions import NodeDriver

from .test_agent import T0, Clock
from .test_gpu_gate import _config

TAG = "slurm-idle"
OOM = "POST /wake_up answered 500 CUDA error: out of memory"


def _starting(tmp_path: Path, cold: bool = False):
    cfg = _config(tmp_path)
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2"])
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}),
                                     reason=format_reason(TAG, Phase.STARTING, T0))
    engine = FakeEngine(up={"gpu1": False}, fail_starts={"gpu1": OOM}, cold=cold)
    clock = Clock()
    return cfg, slurm, engine, clock


def _tick(cfg, slurm, engine, clock) -> list:
    """One tick's CONTINUE of gpu1 by a fresh driver (as each cron tick builds one)."""
    driver = NodeDriver(cfg, slurm, lambda model: engine, clock, clock.sleep)
    from slurm_idle.lifecycle import derive_phase as phase_of

    info = phase_of(slurm.node_map["gpu1"], TAG)
    view = NodeView(node=slurm.node_map["gpu1"], model="m", phase=info.phase, phase_since=info.since)
    action = Action(ActionKind.CONTINUE, "gpu1", "m", view.phase, Phase.SERVING, "carry on")
    return driver.drive(view, action, deadline=clock() + 5.0)


def _wakes(engine: FakeEngine) -> int:
    return sum(1 for c in engine.log if c[0] == "start")


def test_a_failing_wake_is_retried_with_backoff_then_given_up_to_the_admin(tmp_path: Path) -> None:
    cfg, slurm, engine, clock = _starting(tmp_path)
    first = _tick(cfg, slurm, engine, clock)
    assert first[0].outcome is StepOutcome.ERROR and "start or wake 1 of 3 failed" in (first[0].error or "")
    assert OOM in (first[0].error or "") and _wakes(engine) == 1
    # The next tick, seconds later: backing off, no wake asked.
    clock.t += 5
    [waiting] = _tick(cfg, slurm, engine, clock)
    assert waiting.outcome is StepOutcome.WAITING and "next try at" in (waiting.detail or "")
    assert _wakes(engine) == 1
    clock.t += BACKOFF_BASE_S
    assert "2 of 3" in (_tick(cfg, slurm, engine, clock)[0].error or "") and _wakes(engine) == 2
    clock.t += 2 * BACKOFF_BASE_S
    steps = _tick(cfg, slurm, engine, clock)  # the third failure: no cold restart here
    assert [(s.from_phase, s.to_phase, s.outcome) for s in steps] == [
        (Phase.STARTING, Phase.SERVING, StepOutcome.WAITING),
        (Phase.STARTING, Phase.ADMIN, StepOutcome.OK)]
    node = slurm.node_map["gpu1"]
    assert derive_phase(node, TAG).phase is Phase.ADMIN
    assert node.reason.startswith(f"{TAG}:wake-failed since=") and OOM in node.reason
    assert "replica gpu1: 3 starts or wakes failed" in node.reason, node.reason
    assert ("cold_restart", "gpu1") in engine.log
    # Handed over: forgotten, so the admin's fix starts afresh once the node is adopted again.
    assert EngineNotes(notes_path(cfg.paths.journal)).failures("gpu1") is None


def test_after_the_attempts_a_cold_restart_is_issued_once_and_a_serving_engine_clears_the_count(
        tmp_path: Path) -> None:
    cfg, slurm, engine, clock = _starting(tmp_path, cold=True)
    for _ in range(2):
        _tick(cfg, slurm, engine, clock)
        clock.t += 10 * BACKOFF_BASE_S
    [step] = _tick(cfg, slurm, engine, clock)[:1]
    assert step.outcome is StepOutcome.WAITING and "cold restart issued" in (step.detail or "")
    assert engine.log.count(("cold_restart", "gpu1")) == 1
    clock.t += cfg.engine_for("m").start_timeout_s
    steps = _tick(cfg, slurm, engine, clock)
    assert steps[-1].to_phase is Phase.SERVING and steps[-1].outcome is StepOutcome.OK
    assert EngineNotes(notes_path(cfg.paths.journal)).failures("gpu1") is None


def test_the_backoff_doubles_up_to_the_engines_start_timeout() -> None:
    waits = [StartFailures(n, 0.0, "").next_try(100.0) for n in (1, 2, 3, 4)]
    assert waits == [15.0, 30.0, 60.0, 100.0]
    assert StartFailures(3, 0.0, "", cold_restarted=True).next_try(100.0) == 100.0


@pytest.mark.parametrize("failing", [False, True])
def test_a_replica_whose_start_failed_is_not_counted_as_coming_back(failing: bool) -> None:
    """STARTING counts as coming back, but not once its start failed: a lent node is
    reclaimed in its place in the same tick."""
    from slurm_idle.policy import plan

    from .test_policy_helpers import NOW, config, load, node, observation

    starting = replace(node("m0-n1", Phase.STARTING), phase_since=NOW - 30)
    obs = observation(node("m0-n0"), starting, node("m0-n2", Phase.LENT), loads=(load(0.0),))
    obs = replace(obs, failed_starts=frozenset({"m0-n1"}) if failing else frozenset())
    got = [(a.kind, a.node) for a in plan(obs, config(replicas=3, floor=2), NOW)]
    assert ((ActionKind.RECLAIM, "m0-n2") in got) is failing


def test_the_textfile_names_a_replica_given_up(tmp_path: Path) -> None:
    from slurm_idle.agent import TickResult
    from slurm_idle.agent_metrics import write_textfile
    from slurm_idle.handover import format_wake_failed
    from slurm_idle.model import Observation
    from slurm_idle.wiring import wakes_handed_over

    cfg, slurm, _engine, clock = _starting(tmp_path)
    node = replace(slurm.node_map["gpu1"], reason=format_wake_failed(TAG, "gpu1", T0, "gpu1", OOM))
    obs = Observation(now=clock(), nodes=(NodeView(node=node, model="m", phase=Phase.ADMIN),))
    prom = tmp_path / "m.prom"
    write_textfile(prom, phases=None, needed={}, serving={}, tick_duration_s=0.1, tick_ts=1.0,
                   transitions=[], tick_error=False,
                   wake_failed=wakes_handed_over(TickResult(observation=obs), cfg))
    assert f'slurm_idle_wake_failed{{node="gpu1",replica="gpu1",error="{OOM}"}} 1' in prom.read_text()


def test_a_last_attempt_failing_in_the_reclaim_step_hands_over_in_that_step(tmp_path: Path) -> None:
    """With wake_attempts 1 the first wake is the last: the reclaim's own step (which wrote
    STARTING before the wake) hands the node over at once, not a tick later."""
    cfg = _config(tmp_path).model_copy(deep=True)
    engine_cfg = cfg.engine_for("m").model_copy(update={"wake_attempts": 1})
    cfg = cfg.model_copy(update={"engine": engine_cfg})
    slurm = FakeSlurm.with_nodes(["gpu1"])
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}),
                                     reason=format_reason(TAG, Phase.RECLAIMING, T0))
    engine = FakeEngine(up={"gpu1": False}, fail_starts={"gpu1": OOM})
    clock = Clock()
    driver = NodeDriver(cfg, slurm, lambda model: engine, clock, clock.sleep)
    view = NodeView(node=slurm.node_map["gpu1"], model="m", phase=Phase.RECLAIMING, phase_since=T0)
    action = Action(ActionKind.CONTINUE, "gpu1", "m", Phase.RECLAIMING, Phase.STARTING, "carry on")
    steps = driver.drive(view, action, deadline=clock() + 5.0)
    assert [(s.from_phase, s.to_phase, s.outcome) for s in steps] == [
        (Phase.RECLAIMING, Phase.STARTING, StepOutcome.WAITING),
        (Phase.STARTING, Phase.ADMIN, StepOutcome.OK)]
    assert derive_phase(slurm.node_map["gpu1"], TAG).phase is Phase.ADMIN
