"""The GPU gate: a reclaimed node's engine starts only once its GPUs hold no more than the
engine's own residue plus the tolerance; a leftover sends the group to HELD, named."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle.config import Config, parse_config
from slurm_idle.journal import StepOutcome
from slurm_idle.lifecycle import format_reason
from slurm_idle.model import Action, ActionKind, GpuReading, NodeView, Phase
from slurm_idle.policy.gpus import allowance_mib, describe, gate
from slurm_idle.testing.fakes import FakeEngine, FakeSlurm
from slurm_idle.transitions import NodeDriver

from .test_agent import T0, Clock

TAG = "slurm-idle"
HELD_MIB = 20480


def _config(tmp_path: Path, kind: str = "command") -> Config:
    engine = ('{kind: command, start_command: "true {node}", stop_command: "true {node}"}'
              if kind == "command" else "{kind: http-sleep}")
    return parse_config(f"""
engine: {engine}
models:
  - name: m
    nodes: gpu[1-2]
    url: "http://127.0.0.1:1/{{node}}"
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
timeouts:
  tick_budget_s: 10
gpu:
  sample_lag_s: 2
""")


class Readings:
    """The GPU exporter as the driver reads it: per node, GPU 0 and 1; `used[node]` MiB on
    GPU 0, sampled at `at` (None: the clock's now, a fresh sample)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.used: dict[str, int] = {}
        self.at: float | None = None
        self.holder: str | None = "job 77"
        self.calls = 0

    def __call__(self, nodes: Sequence[str]) -> Mapping[str, tuple[GpuReading, ...]]:
        self.calls += 1
        ts = self.clock() if self.at is None else self.at
        return {n: (GpuReading(0, self.used.get(n, 0), 81559, self.holder if self.used.get(n) else None, ts),
                    GpuReading(1, 0, 81559, None, ts)) for n in nodes if n != "gpu2"}


def _driver(tmp_path: Path, phase: Phase, kind: str = "command"):
    cfg = _config(tmp_path, kind)
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2"])
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}),
                                     reason=format_reason(TAG, phase, T0))
    engine = FakeEngine(up={"gpu1": False})
    clock = Clock()
    readings = Readings(clock)
    driver = NodeDriver(cfg, slurm, lambda model: engine, clock, clock.sleep, gpu_readings=readings)
    view = NodeView(node=slurm.node_map["gpu1"], model="m", phase=phase, phase_since=T0)
    return driver, slurm, engine, readings, view, clock


def _continue(driver: NodeDriver, view: NodeView, clock: Clock, to: Phase):
    action = Action(ActionKind.CONTINUE, "gpu1", "m", view.phase, to, "carry on")
    return driver.drive(view, action, deadline=clock() + 5.0)


def _starts(engine: FakeEngine) -> list[tuple[str, ...]]:
    return [c for c in engine.log if c[0] == "start"]


def test_a_held_gpu_sends_the_reclaim_to_held_naming_gpu_mib_and_holder_and_nothing_starts(
        tmp_path: Path) -> None:
    driver, slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    readings.used["gpu1"] = HELD_MIB
    steps = _continue(driver, view, clock, Phase.STARTING)
    assert [(s.from_phase, s.to_phase, s.outcome) for s in steps] == [
        (Phase.RECLAIMING, Phase.STARTING, StepOutcome.WAITING),
        (Phase.RECLAIMING, Phase.HELD, StepOutcome.OK),
        (Phase.HELD, Phase.STARTING, StepOutcome.WAITING),
    ]
    assert steps[0].detail is not None and "gpu1 GPU 0: 20480 MiB held (allowed 1024), holder job 77" in steps[0].detail
    assert steps[2].detail is not None and "20480 MiB held" in steps[2].detail
    assert slurm.node_map["gpu1"].reason.startswith(f"{TAG}:held since=")
    assert _starts(engine) == []


def test_held_starts_the_engine_once_the_gpu_is_free(tmp_path: Path) -> None:
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.HELD)
    readings.used["gpu1"] = HELD_MIB
    [step] = _continue(driver, view, clock, Phase.STARTING)
    assert step.outcome is StepOutcome.WAITING and _starts(engine) == []
    readings.used["gpu1"] = 300  # the leftover is gone: the CUDA runtime's crumbs remain
    steps = _continue(driver, view, clock, Phase.STARTING)
    assert steps[0].outcome is StepOutcome.OK and len(_starts(engine)) == 1


def test_a_serving_engines_own_memory_is_not_a_leftover(tmp_path: Path) -> None:
    """A node adopted into serving whose engine runs already (its weights on the GPU): the
    gate judges only the engines still to start, so it goes on to serving, not to HELD."""
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    engine.up["gpu1"] = True
    readings.used["gpu1"], readings.holder = 70000, None
    steps = _continue(driver, view, clock, Phase.STARTING)
    assert [(s.to_phase, s.outcome) for s in steps][:2] == [
        (Phase.STARTING, StepOutcome.OK), (Phase.SERVING, StepOutcome.OK)]


def test_a_free_gpu_starts_at_once_without_held(tmp_path: Path) -> None:
    driver, _slurm, engine, _readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    steps = _continue(driver, view, clock, Phase.STARTING)
    assert (steps[0].to_phase, steps[0].outcome) == (Phase.STARTING, StepOutcome.OK)
    assert len(_starts(engine)) == 1


def test_a_reading_from_before_the_node_emptied_is_waited_on_not_called_held(tmp_path: Path) -> None:
    """The exporter lags: a sample taken while the requeued job still ran shows its memory.
    The gate waits for a newer sample, and a newer free one starts the engine in the same tick."""
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    readings.used["gpu1"], readings.at = HELD_MIB, T0 - 5
    calls = 0

    def lagging(nodes: Sequence[str]) -> Mapping[str, tuple[GpuReading, ...]]:
        nonlocal calls
        calls += 1
        if calls >= 3:  # the exporter's next sample: the job's memory is gone
            readings.used["gpu1"], readings.at = 0, None
        return readings(nodes)

    driver._gpus._read = lagging
    steps = _continue(driver, view, clock, Phase.STARTING)
    assert next((s.to_phase, s.outcome) for s in steps) == (Phase.STARTING, StepOutcome.OK)
    assert len(_starts(engine)) == 1 and calls >= 3


def test_a_node_without_gpu_series_passes_and_says_so(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """No series (gpu2 here): the gate cannot see, so it does not block a reclaim (a
    monitoring outage must not keep the service short); the log names the node."""
    driver, slurm, engine, _readings, _view, clock = _driver(tmp_path, Phase.RECLAIMING)
    slurm.node_map["gpu2"] = replace(slurm.node_map["gpu2"], flags=frozenset({"DRAIN"}),
                                     reason=format_reason(TAG, Phase.RECLAIMING, T0))
    engine.up["gpu2"] = False
    view2 = NodeView(node=slurm.node_map["gpu2"], model="m", phase=Phase.RECLAIMING, phase_since=T0)
    action = Action(ActionKind.CONTINUE, "gpu2", "m", Phase.RECLAIMING, Phase.STARTING, "carry on")
    steps = driver.drive(view2, action, deadline=clock() + 5.0)
    assert steps[0].outcome is StepOutcome.OK
    assert "no GPU readings for gpu2" in caplog.text


def test_a_sleeping_engine_may_find_its_residue_a_stopped_one_nothing(tmp_path: Path) -> None:
    """4000 MiB is within a sleeping engine's allowance (max_residue 4096 + 1024) but a
    leftover for an engine that was stopped (nothing of it stays on the GPU)."""
    for asleep, starts in ((True, True), (False, False)):
        driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
        if asleep:
            engine.up["gpu1"] = True
            engine.asleep.add("gpu1")
        readings.used["gpu1"] = 4000
        steps = _continue(driver, view, clock, Phase.STARTING)
        assert (steps[0].outcome is StepOutcome.OK) is starts, asleep


def test_an_engine_whose_sleep_state_is_unknown_is_gated_like_a_sleeping_one(tmp_path: Path) -> None:
    """/health 200 but neither /is_sleeping nor the gauge tells: it may be asleep, so 70000 MiB
    on its GPU is not taken for its own weights."""
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    engine.up["gpu1"] = True
    engine.sleep_unknown.add("gpu1")
    readings.used["gpu1"] = 70000
    steps = _continue(driver, view, clock, Phase.STARTING)
    assert (Phase.RECLAIMING, Phase.HELD, StepOutcome.OK) in [
        (s.from_phase, s.to_phase, s.outcome) for s in steps]
    assert "70000 MiB held (allowed 5120)" in (steps[0].detail or "") and _starts(engine) == []


def test_a_retry_after_a_failed_wake_is_not_tried_on_a_held_gpu(tmp_path: Path) -> None:
    """The first wake passed the gate (the leftover allocated after the last sample) and
    failed out of memory; the retry sees the GPU held: no wake into it, the held GPU counts
    as the failed attempt and names the holder, and the retries still end at the admin."""
    from slurm_idle.engine_notes import BACKOFF_BASE_S

    driver, slurm, engine, readings, view, clock = _driver(tmp_path, Phase.STARTING)
    engine.fail_starts["gpu1"] = "POST /wake_up answered 500 CUDA error: out of memory"
    first = _continue(driver, view, clock, Phase.SERVING)
    assert first[0].outcome is StepOutcome.ERROR and len(_starts(engine)) == 1
    readings.used["gpu1"] = HELD_MIB
    for n in (1, 2):
        clock.t += BACKOFF_BASE_S * 2 ** n
        fresh = NodeDriver(driver.config, slurm, lambda model: engine, clock, clock.sleep,
                           gpu_readings=readings)  # each tick builds its own driver
        steps = _continue(fresh, view, clock, Phase.SERVING)
        assert len(_starts(engine)) == 1, steps  # never woken into the held GPU
    assert steps[-1].to_phase is Phase.ADMIN and steps[-1].outcome is StepOutcome.OK
    reason = slurm.node_map["gpu1"].reason
    assert "GPU memory held" in reason and f"{HELD_MIB} MiB" in reason and "job 77" in reason


def test_an_engine_serving_already_is_not_held_by_its_own_memory(tmp_path: Path) -> None:
    """Adopting a node whose engine runs (or a start an earlier tick issued): its weights on
    the GPU are its own, not a leftover."""
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    engine.up["gpu1"] = True
    readings.used["gpu1"] = 70000
    steps = _continue(driver, view, clock, Phase.STARTING)
    assert steps[0].outcome is StepOutcome.OK


def test_gate_counts_only_the_replicas_gpus_and_only_fresh_evidence() -> None:
    readings = {"a": (GpuReading(0, 9000, 81559, "job 5", 100.0), GpuReading(3, 9000, None, None, 200.0)),
                "b": None}
    verdict = gate(readings, indexes=(3,), allowed_mib=1024, fresh_after=150.0)
    assert [(g.node, g.index, g.fresh) for g in verdict.held] == [("a", 3, True)]
    assert verdict.unobserved == ("b",)
    older = gate(readings, indexes=(0,), allowed_mib=1024, fresh_after=150.0)
    assert older.held and not older.leftover and not older.clear
    assert describe(verdict.held) == "a GPU 3: 9000 MiB held (allowed 1024), holder unknown (not a Slurm job)"


def test_allowance_is_the_recorded_residue_or_the_engines_kind() -> None:
    assert allowance_mib(engine_up=True, residue_mib=None, tolerance_mib=1024, max_residue_mib=4096) == 5120
    assert allowance_mib(engine_up=False, residue_mib=812, tolerance_mib=1024, max_residue_mib=4096) == 1024
    assert allowance_mib(engine_up=True, residue_mib=812, tolerance_mib=1024, max_residue_mib=4096) == 1836


@pytest.mark.parametrize(("held_for", "handed_over"), [(60, False), (10_000, True)])
def test_a_held_group_counts_as_coming_back_until_gpu_free_s_then_another_is_reclaimed(
        held_for: float, handed_over: bool) -> None:
    """HELD is on its way back (the planner carries it on to STARTING) until it is older than
    timeouts.gpu_free_s (300 s); then it is handed to the admin and a lent group comes back
    instead, in the same tick."""
    from slurm_idle.policy import plan

    from .test_policy_helpers import NOW, config, load, node, observation

    held = replace(node("m0-n1", Phase.HELD), phase_since=NOW - held_for)
    obs = observation(node("m0-n0"), held, node("m0-n2", Phase.LENT), loads=(load(0.0),))
    got = [(a.kind, a.node, a.to_phase) for a in plan(obs, config(replicas=3, floor=2), NOW)]
    assert ((ActionKind.HAND_OVER, "m0-n1", Phase.ADMIN) in got) is handed_over
    assert ((ActionKind.CONTINUE, "m0-n1", Phase.STARTING) in got) is not handed_over
    assert ((ActionKind.RECLAIM, "m0-n2", Phase.RECLAIMING) in got) is handed_over


def test_hand_over_drains_for_the_admin_naming_the_holder_and_the_textfile_says_so(
        tmp_path: Path) -> None:
    """HELD past gpu_free_s: the node's Reason names GPU, MiB and holder and reads back as the
    admin's (never touched again); the textfile exports it for SlurmIdleGpuHeld."""
    from slurm_idle.agent import TickResult
    from slurm_idle.agent_metrics import write_textfile
    from slurm_idle.handover import parse_reason
    from slurm_idle.lifecycle import derive_phase
    from slurm_idle.model import Observation
    from slurm_idle.wiring import gpus_handed_over

    driver, slurm, _engine, readings, view, clock = _driver(tmp_path, Phase.HELD)
    readings.used["gpu1"] = HELD_MIB
    action = Action(ActionKind.HAND_OVER, "gpu1", "m", Phase.HELD, Phase.ADMIN, "held too long")
    [step] = driver.drive(view, action, deadline=clock() + 5.0)
    assert step.outcome is StepOutcome.OK
    node = slurm.node_map["gpu1"]
    assert derive_phase(node, TAG).phase is Phase.ADMIN
    assert "GPU 0: 20480 MiB, holder job 77" in node.reason
    assert "scontrol update nodename=gpu1 state=resume" in node.reason
    [entry] = parse_reason(TAG, "gpu1", node.reason) or []
    assert (entry.gpu, entry.used_mib, entry.holder) == (0, HELD_MIB, "job 77")

    obs = Observation(now=clock(), nodes=(replace(view, node=node, phase=Phase.ADMIN),))
    prom = tmp_path / "m.prom"
    write_textfile(prom, phases=None, needed={}, serving={}, tick_duration_s=0.1, tick_ts=1.0,
                   transitions=[], tick_error=False,
                   gpu_held=gpus_handed_over(TickResult(observation=obs), driver.config))
    assert 'slurm_idle_gpu_held{node="gpu1",gpu="0",holder="job 77",mib="20480"} 1' in prom.read_text()


def test_a_gpu_freed_at_the_hand_over_is_not_handed_over_but_started(tmp_path: Path) -> None:
    """Freed just as gpu_free_s ran out (or no reading at all: an outage must not strand it):
    the hand-over turns into the start, in the same step."""
    driver, slurm, engine, _readings, view, clock = _driver(tmp_path, Phase.HELD)
    view = replace(view, phase_since=clock() - 10_000)
    action = Action(ActionKind.HAND_OVER, "gpu1", "m", Phase.HELD, Phase.ADMIN, "held too long")
    steps = driver.drive(view, action, deadline=clock() + 5.0)
    assert [(s.to_phase, s.outcome) for s in steps][:2] == [
        (Phase.ADMIN, StepOutcome.WAITING), (Phase.STARTING, StepOutcome.OK)]
    assert slurm.node_map["gpu1"].reason.startswith(f"{TAG}:serving since=")
    assert _starts(engine)


# --- the residue a lend leaves --------------------------------------------------------------


def _lend(driver: NodeDriver, view: NodeView, clock: Clock):
    action = Action(ActionKind.CONTINUE, "gpu1", "m", Phase.LENDING, Phase.LENT, "carry on")
    return driver.drive(view, action, deadline=clock() + 10.0)


def test_a_lend_records_the_residue_the_gate_then_allows(tmp_path: Path) -> None:
    """The engine asleep leaves 1500 MiB: recorded, the node lent; at the reclaim the same
    1500 MiB (+ the tolerance) is its own, not a leftover."""
    from slurm_idle.engine_notes import EngineNotes, notes_path

    driver, slurm, engine, readings, view, clock = _driver(tmp_path, Phase.LENDING)
    engine.up["gpu1"] = False  # stopped (or asleep: released) at once
    readings.used["gpu1"] = 1500
    steps = _lend(driver, view, clock)
    assert steps[0].outcome is StepOutcome.OK and "lent" in slurm.node_map["gpu1"].comment
    notes = EngineNotes(notes_path(driver.config.paths.journal))
    assert notes.residue("gpu1") == {0: 1500, 1: 0}
    assert notes.lend_refused("gpu1") is None


def test_a_lend_leaving_more_than_max_residue_is_refused_and_not_tried_again_until_unpin(
        tmp_path: Path) -> None:
    from slurm_idle.engine_notes import EngineNotes, notes_path
    from slurm_idle.policy import plan

    from .test_policy_helpers import NOW, config, load, node, observation

    driver, slurm, engine, readings, view, clock = _driver(tmp_path, Phase.LENDING)
    engine.up["gpu1"] = False
    readings.used["gpu1"] = 16384  # e.g. sleep freed nothing (expandable segments on)
    steps = _lend(driver, view, clock)
    assert [(s.from_phase, s.to_phase, s.outcome) for s in steps][:2] == [
        (Phase.LENDING, Phase.LENT, StepOutcome.WAITING), (Phase.LENDING, Phase.STARTING, StepOutcome.OK)]
    assert "lend refused: the engine left gpu1 GPU 0: 16384 MiB" in (steps[0].detail or "")
    assert "lent" not in slurm.node_map["gpu1"].comment  # never RESUMEd into the idle partition
    assert EngineNotes(notes_path(driver.config.paths.journal)).lend_refused("gpu1")
    # The planner does not lend it again (it would lend the others).
    obs = observation(*(node(f"m0-n{i}") for i in range(3)), loads=(load(0.0),))
    refused = replace(obs, lend_refused=frozenset({"m0-n0", "m0-n1"}))
    lends = {a.node for a in plan(refused, config(replicas=3, floor=1), NOW) if a.kind is ActionKind.LEND}
    assert lends and not lends & {"m0-n0", "m0-n1"}


def test_an_abandoned_lends_release_time_is_not_the_next_lends(tmp_path: Path) -> None:
    """A release time left by a lend that was given up (load rose) must not let a sample from
    before the next lend's sleep count as its residue."""
    from slurm_idle.engine_notes import EngineNotes, notes_path

    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.LENDING)
    notes = EngineNotes(notes_path(driver.config.paths.journal))
    notes.released_at("gpu1", T0 - 3600, None)  # an old lend's, never forgotten
    view = replace(view, phase_since=clock())
    engine.up["gpu1"] = False
    readings.used["gpu1"], readings.at = 70000, clock() - 1  # awake, before this lend's stop
    calls = 0

    def sleeping(nodes):
        nonlocal calls
        calls += 1
        if calls >= 3:
            readings.used["gpu1"], readings.at = 1000, None  # the sample after the stop
        return readings(nodes)

    driver._gpus._read = sleeping
    steps = _lend(driver, view, clock)
    assert steps[0].outcome is StepOutcome.OK, steps[0]
    assert EngineNotes(notes_path(driver.config.paths.journal)).residue("gpu1") == {0: 1000, 1: 0}


def test_a_node_handed_over_without_a_reading_of_its_gpus_still_raises_the_alert(tmp_path: Path) -> None:
    from slurm_idle.agent_metrics import read_counters, render
    from slurm_idle.handover import HeldEntry, format_reason, parse_reason

    reason = format_reason(TAG, "gpu2", T0, [])
    assert "GPU not named" in reason and "  " not in reason
    entries = parse_reason(TAG, "gpu2", reason)
    assert entries == [HeldEntry("gpu2", -1, 0, "unknown")]
    text = render(phases=None, needed={}, serving={}, tick_duration_s=0.1, tick_ts=1.0,
                  transitions=[], tick_error=False, floors={},
                  previous=read_counters(tmp_path / "none.prom"), gpu_held=entries)
    assert 'slurm_idle_gpu_held{node="gpu2",gpu="unknown",holder="unknown",mib="0"} 1' in text
