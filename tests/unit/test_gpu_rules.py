"""Each rule of the GPU gate, the hand-over, the residue at lend, failed wakes and live-engine
capacity is written once, and taking it out changes exactly the probes that depend on it, in
every placement it applies to.

A RULE is one way to take a rule out (a monkeypatch at the rule's one definition: a function
imported by name elsewhere is replaced wherever it is bound, `_everywhere`). A PROBE is a
small scenario on fakes in one placement (its name says which: `nodes.` is the node driver,
planner and fast check of `placement: nodes`; `jobs.` the replica job's script, the job driver,
plan_jobs and the fast check of `placement: jobs`). EXPECTED names, per rule, the probes whose
answer differs once the rule is gone; APPLIES names the placements the rule is for.

Rules for one placement only (why the other has none):
- failed wakes (backoff, bounded attempts, the wake-failed Reason, not counted as coming back):
  a replica job's engine is its job's; there is no wake or start to retry or give up on (its
  job fails or is cancelled, and the replica is submitted again);
- the residue at lend (recorded, refused above gpu.max_residue_mib, not lent again) and the
  allowance of a sleeping engine's residue: lending a replica job cancels it, so its engine
  leaves nothing on the GPUs, and its next engine starts on GPUs that must hold nothing;
- fresh evidence (gpu.sample_lag_s): the job's script reads its GPUs itself (nvidia-smi), live,
  where the node driver reads the exporter's lagging samples through Prometheus.

Rules written twice (one removal per place; each breaks its placement only): see TWICE.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from slurm_idle import handover, lifecycle, replicajobs
from slurm_idle.engine_notes import BACKOFF_BASE_S, EngineNotes, notes_path
from slurm_idle.jobdriver import JobDriver
from slurm_idle.lifecycle import Edge, Lifecycle, derive_phase
from slurm_idle.model import Action, ActionKind, GpuReading, Observation, Phase
from slurm_idle.policy import fast_plan, gpus, plan, planner, service
from slurm_idle.policy import jobs as policy_jobs
from slurm_idle.policy.gpus import GateVerdict
from slurm_idle.policy.jobs import plan_jobs
from slurm_idle.start_retry import StartRetries
from slurm_idle.testing.fakes import FakeEngine, FakeSlurm
from slurm_idle.transitions import NodeDriver

from . import test_policy_helpers as ph
from . import test_replica_jobs as rj
from .test_agent import Clock
from .test_gpu_gate import HELD_MIB, Readings, _continue, _driver, _lend, _starts
from .test_start_retry import _starting, _tick

TAG = "slurm-idle"
#: Over gpu.free_tolerance_mib (1024) but within a sleeping engine's allowance (4096 + 1024).
BETWEEN_MIB = 3000

Probe = Callable[[Path], Hashable]
Removal = Callable[[pytest.MonkeyPatch], None]


def _steps(steps: Sequence[Any]) -> tuple[tuple[Phase, Phase, str], ...]:
    return tuple((s.from_phase, s.to_phase, str(s.outcome)) for s in steps)


def _acts(actions: Sequence[Action]) -> tuple[tuple[str, str, str], ...]:
    """Actions as a set (a removal may change their order, not what they are)."""
    return tuple(sorted((a.kind.value, a.node, a.to_phase.value) for a in actions))


# --- placement: nodes --------------------------------------------------------------------------


def probe_nodes_reclaim_held(tmp_path: Path) -> Hashable:
    """A reclaimed node whose GPU 0 holds 20 GiB of a leftover: HELD, no engine started."""
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    readings.used["gpu1"] = HELD_MIB
    return _steps(_continue(driver, view, clock, Phase.STARTING)), len(_starts(engine))


def probe_nodes_held_waits(tmp_path: Path) -> Hashable:
    """HELD while the GPU is still held: waits, no engine started."""
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.HELD)
    readings.used["gpu1"] = HELD_MIB
    return _steps(_continue(driver, view, clock, Phase.STARTING)), len(_starts(engine))


def probe_nodes_lagging_reading(tmp_path: Path) -> Hashable:
    """A reading from before the node emptied shows the requeued job's memory; the exporter's
    next sample is free: waited on, the engine starts in the same tick, never HELD."""
    driver, _slurm, engine, readings, view, clock = _driver(tmp_path, Phase.RECLAIMING)
    readings.used["gpu1"], readings.at = HELD_MIB, clock() - 5
    calls = count(1)

    def lagging(nodes: Sequence[str]) -> Mapping[str, tuple[GpuReading, ...]]:
        if next(calls) >= 3:
            readings.used["gpu1"], readings.at = 0, None
        answer: Mapping[str, tuple[GpuReading, ...]] = readings(nodes)
        return answer

    driver._gpus._read = lagging
    return _steps(_continue(driver, view, clock, Phase.STARTING)), len(_starts(engine))


def probe_nodes_allowance(tmp_path: Path) -> Hashable:
    """4000 MiB: a sleeping engine's own residue (it starts), a leftover for a stopped one."""
    out = []
    for i, asleep in enumerate((True, False)):
        (tmp_path / str(i)).mkdir()
        driver, _slurm, engine, readings, view, clock = _driver(tmp_path / str(i), Phase.RECLAIMING)
        if asleep:
            engine.up["gpu1"] = True
            engine.asleep.add("gpu1")
        readings.used["gpu1"] = 4000
        _continue(driver, view, clock, Phase.STARTING)
        out.append(len(_starts(engine)))
    return tuple(out)


def probe_nodes_hand_over(tmp_path: Path) -> Hashable:
    """HAND_OVER of a HELD node: drained for the admin, the Reason naming GPU, MiB, holder."""
    driver, slurm, _engine, readings, view, clock = _driver(tmp_path, Phase.HELD)
    readings.used["gpu1"] = HELD_MIB
    action = Action(ActionKind.HAND_OVER, "gpu1", "m", Phase.HELD, Phase.ADMIN, "held too long")
    steps = driver.drive(view, action, deadline=clock() + 5.0)
    node = slurm.node_map["gpu1"]
    return (_steps(steps), derive_phase(node, TAG).phase,
            tuple(handover.parse_reason(TAG, "gpu1", node.reason) or ()))


def probe_nodes_lend_residue(tmp_path: Path) -> Hashable:
    """A lend whose engine leaves 1500 MiB: lent, the residue recorded for the gate."""
    driver, slurm, _engine, readings, view, clock = _driver(tmp_path, Phase.LENDING)
    readings.used["gpu1"] = 1500
    steps = _lend(driver, view, clock)
    notes = EngineNotes(notes_path(driver.config.paths.journal))
    return _steps(steps[:1]), notes.residue("gpu1"), "lent" in slurm.node_map["gpu1"].comment


def probe_nodes_lend_refused(tmp_path: Path) -> Hashable:
    """A lend whose engine leaves 16 GiB (over gpu.max_residue_mib): refused, not lent."""
    driver, slurm, _engine, readings, view, clock = _driver(tmp_path, Phase.LENDING)
    readings.used["gpu1"] = 16384
    steps = _lend(driver, view, clock)
    notes = EngineNotes(notes_path(driver.config.paths.journal))
    return (_steps(steps[:2]), notes.lend_refused("gpu1") is not None,
            "lent" in slurm.node_map["gpu1"].comment)


def probe_nodes_refused_not_lent(tmp_path: Path) -> Hashable:
    """Low load on three serving nodes, two of them refused at their last lend: the planner
    lends the third only."""
    obs = ph.observation(*(ph.node(f"m0-n{i}") for i in range(3)), loads=(ph.load(0.0),))
    obs = replace(obs, lend_refused=frozenset({"m0-n0", "m0-n1"}))
    return _acts(plan(obs, ph.config(replicas=3, floor=1), ph.NOW))


def probe_nodes_wake_backoff(tmp_path: Path) -> Hashable:
    """A wake answering 500, then the next tick 5 s later: backing off, no second wake."""
    cfg, slurm, engine, clock = _starting(tmp_path)
    _tick(cfg, slurm, engine, clock)
    clock.t += 5
    [step] = _tick(cfg, slurm, engine, clock)[:1]
    return str(step.outcome), sum(1 for c in engine.log if c[0] == "start")


def probe_nodes_wake_given_up(tmp_path: Path) -> Hashable:
    """Three failed wakes, each after its backoff (no cold restart): the node is the admin's,
    its Reason naming the replica."""
    cfg, slurm, engine, clock = _starting(tmp_path)
    for _ in range(3):
        _tick(cfg, slurm, engine, clock)
        clock.t += 10 * BACKOFF_BASE_S
    node = slurm.node_map["gpu1"]
    entry = handover.parse_wake_failed(TAG, "gpu1", node.reason)
    return derive_phase(node, TAG).phase, entry.replica if entry else None


def probe_nodes_failed_start_not_arriving(tmp_path: Path) -> Hashable:
    """A STARTING node whose wake failed is not counted as coming back: a lent node comes back."""
    starting = replace(ph.node("m0-n1", Phase.STARTING), phase_since=ph.NOW - 30)
    obs = ph.observation(ph.node("m0-n0"), starting, ph.node("m0-n2", Phase.LENT), loads=(ph.load(0.0),))
    obs = replace(obs, failed_starts=frozenset({"m0-n1"}))
    return _acts(plan(obs, ph.config(replicas=3, floor=2), ph.NOW))


def _held_nodes(held_for: float) -> Observation:
    held = replace(ph.node("m0-n1", Phase.HELD), phase_since=ph.NOW - held_for)
    return ph.observation(ph.node("m0-n0"), held, ph.node("m0-n2", Phase.LENT), loads=(ph.load(0.0),))


def probe_nodes_held_counts(tmp_path: Path) -> Hashable:
    """HELD for a minute counts as coming back: carried on, nothing else reclaimed."""
    return _acts(plan(_held_nodes(60), ph.config(replicas=3, floor=2), ph.NOW))


def probe_nodes_held_handed_over(tmp_path: Path) -> Hashable:
    """HELD past timeouts.gpu_free_s: handed over, a lent node reclaimed in the same tick."""
    return _acts(plan(_held_nodes(10_000), ph.config(replicas=3, floor=2), ph.NOW))


def _failing_node() -> Observation:
    """m0-n0 serves but fails its probe, m0-n1 is lent; the load needs one replica."""
    serving = ph.node("m0-n0")
    assert serving.replica is not None
    serving = replace(serving, replica=replace(serving.replica, healthy=False))
    return ph.observation(serving, ph.node("m0-n1", Phase.LENT), loads=(ph.load(10.0),))


def probe_nodes_live_engine(tmp_path: Path) -> Hashable:
    return _acts(plan(_failing_node(), ph.config(replicas=2, floor=1), ph.NOW))


def probe_nodes_fast_check(tmp_path: Path) -> Hashable:
    return _acts(fast_plan(_failing_node(), ph.config(replicas=2, floor=1), ph.NOW))


def probe_nodes_nothing_lent(tmp_path: Path) -> Hashable:
    """Low load on three serving nodes, m0-n0 failing its probe: nothing is lent meanwhile."""
    views = [ph.node(f"m0-n{i}") for i in range(3)]
    assert views[0].replica is not None
    views[0] = replace(views[0], replica=replace(views[0].replica, healthy=False))
    return _acts(plan(ph.observation(*views, loads=(ph.load(10.0),)), ph.config(replicas=3, floor=1), ph.NOW))


# --- placement: jobs ---------------------------------------------------------------------------


def probe_jobs_script_waits(tmp_path: Path) -> Hashable:
    """The replica job's script under bash, GPU 4 held (3000 MiB) until its first sleep: the
    commands it runs (nvidia-smi, the held Comment, the wait, vLLM last)."""
    calls, _stderr, _ = rj._run_script(tmp_path, BETWEEN_MIB)
    return tuple(c.split()[0] for c in calls.splitlines())


def _held_job_driver(used_mib: int) -> tuple[JobDriver, FakeSlurm, Any, Clock]:
    """jm#0's job runs on gpu8 (GPUs 0-3), its script saying held; GPU 0 holds `used_mib`."""
    cfg = rj.config()
    held = replace(rj.held_job(5, 0, 60.0), gpu_indexes=((0, 1, 2, 3),))
    slurm = FakeSlurm.with_nodes(["gpu8"], gpus=8)
    slurm.job_list = [held]
    clock = Clock()
    clock.t = rj.T0
    readings = Readings(clock)
    readings.used["gpu8"] = used_mib
    driver = JobDriver(cfg, slurm, lambda model: FakeEngine(), clock, clock.sleep, gpu_readings=readings)
    [replica] = [r for r in rj.obs(cfg, [held], demand=150.0).replica_jobs if r.phase is Phase.HELD]
    return driver, slurm, replica, clock


def probe_jobs_held_named(tmp_path: Path) -> Hashable:
    """A HELD replica job's wait names the GPU over what a starting engine may find there."""
    driver, _slurm, r, clock = _held_job_driver(BETWEEN_MIB)
    action = Action(ActionKind.CONTINUE, r.name, r.model, Phase.HELD, Phase.STARTING, "carry on")
    [step] = driver.drive(r, action, deadline=clock() + 5.0)
    return str(step.outcome), "gpu8 GPU 0: 3000 MiB held" in (step.detail or "")


def probe_jobs_hand_over(tmp_path: Path) -> Hashable:
    """HAND_OVER of a HELD replica job: its node drained for the admin (the Reason naming GPU,
    MiB and holder), the job cancelled."""
    driver, slurm, r, clock = _held_job_driver(20000)
    action = Action(ActionKind.HAND_OVER, r.name, r.model, Phase.HELD, Phase.LENDING, "held too long",
                    {"index": r.index, "job_id": 5})
    steps = driver.drive(r, action, deadline=clock() + 5.0)
    node = slurm.node_map["gpu8"]
    return (_steps(steps[:1]), derive_phase(node, TAG).phase, ("cancel", "5") in slurm.log,
            tuple(handover.parse_reason(TAG, "gpu8", node.reason) or ()))


def _jobs_config() -> Any:
    return rj.config(rj.CONFIG.replace("replicas: 2", "replicas: 3"))


def probe_jobs_held_counts(tmp_path: Path) -> Hashable:
    """A replica job HELD for a minute counts as coming back: one more submitted, not two."""
    cfg = _jobs_config()
    return _acts(plan_jobs(rj.obs(cfg, [rj.held_job(5, 0, 60.0)], demand=150.0), cfg, rj.T0))


def probe_jobs_held_handed_over(tmp_path: Path) -> Hashable:
    """HELD past timeouts.gpu_free_s: handed over, the lent replica submitted in the same tick."""
    cfg = _jobs_config()
    late = cfg.timeouts.gpu_free_s + 1
    observed = rj.obs(cfg, [rj.held_job(5, 0, late), rj.BOTH[1]], demand=150.0)
    return _acts(plan_jobs(observed, cfg, rj.T0))


def _failing_job() -> tuple[Any, Observation]:
    """jm#0 serves but fails its probe, jm#1 is lent; the load needs one replica."""
    cfg = rj.config()
    seen = rj.obs(cfg, [rj.BOTH[0]], demand=10.0)
    first, rest = seen.replica_jobs[0], seen.replica_jobs[1:]
    assert first.load is not None
    return cfg, replace(seen, replica_jobs=(replace(first, load=replace(first.load, healthy=False)), *rest))


def probe_jobs_live_engine(tmp_path: Path) -> Hashable:
    cfg, observed = _failing_job()
    return _acts(plan_jobs(observed, cfg, rj.T0))


def probe_jobs_fast_check(tmp_path: Path) -> Hashable:
    cfg, observed = _failing_job()
    return _acts(fast_plan(observed, cfg, rj.T0))


def probe_jobs_nothing_lent(tmp_path: Path) -> Hashable:
    """Low load on three serving replica jobs, jm#0 failing its probe: nothing is lent."""
    cfg = _jobs_config()
    seen = rj.obs(cfg, [rj.job(5 + i, "RUNNING", rj.comment(Phase.SERVING, i)) for i in range(3)],
                  demand=10.0)
    first, *rest = seen.replica_jobs
    assert first.load is not None
    failing = replace(seen, replica_jobs=(replace(first, load=replace(first.load, healthy=False)), *rest))
    return _acts(plan_jobs(failing, cfg, rj.T0))


PROBES: dict[str, Probe] = {
    "nodes.reclaim_held": probe_nodes_reclaim_held,
    "nodes.held_waits": probe_nodes_held_waits,
    "nodes.lagging_reading": probe_nodes_lagging_reading,
    "nodes.allowance": probe_nodes_allowance,
    "nodes.hand_over": probe_nodes_hand_over,
    "nodes.lend_residue": probe_nodes_lend_residue,
    "nodes.lend_refused": probe_nodes_lend_refused,
    "nodes.refused_not_lent": probe_nodes_refused_not_lent,
    "nodes.wake_backoff": probe_nodes_wake_backoff,
    "nodes.wake_given_up": probe_nodes_wake_given_up,
    "nodes.failed_start_not_arriving": probe_nodes_failed_start_not_arriving,
    "nodes.held_counts": probe_nodes_held_counts,
    "nodes.held_handed_over": probe_nodes_held_handed_over,
    "nodes.live_engine": probe_nodes_live_engine,
    "nodes.fast_check": probe_nodes_fast_check,
    "nodes.nothing_lent": probe_nodes_nothing_lent,
    "jobs.script_waits": probe_jobs_script_waits,
    "jobs.held_named": probe_jobs_held_named,
    "jobs.hand_over": probe_jobs_hand_over,
    "jobs.held_counts": probe_jobs_held_counts,
    "jobs.held_handed_over": probe_jobs_held_handed_over,
    "jobs.live_engine": probe_jobs_live_engine,
    "jobs.fast_check": probe_jobs_fast_check,
    "jobs.nothing_lent": probe_jobs_nothing_lent,
}


# --- the rules, each taken out at its one definition ---------------------------------------------


def _everywhere(mp: pytest.MonkeyPatch, fn: Callable[..., Any], new: Callable[..., Any]) -> None:
    """Replace `fn` in its module and in every slurm_idle module that imported it by name."""
    bound = [(mod, name) for mod in list(sys.modules.values())
             if getattr(mod, "__name__", "").startswith("slurm_idle")
             for name, value in list(vars(mod).items()) if value is fn]
    assert bound, fn
    for mod, name in bound:
        mp.setattr(mod, name, new)


def no_gate(mp: pytest.MonkeyPatch) -> None:
    """policy/gpus.py gate(): no GPU is ever over its allowance."""
    _everywhere(mp, gpus.gate, lambda readings, indexes, allowed_mib, fresh_after: GateVerdict())


def stopped_engine_finds_residue(mp: pytest.MonkeyPatch) -> None:
    """allowance_mib(): a stopped engine is allowed a residue as if it were asleep."""
    orig = gpus.allowance_mib
    _everywhere(mp, orig, lambda *, engine_up, **kw: orig(engine_up=True, **kw))


def sleeping_engine_finds_nothing(mp: pytest.MonkeyPatch) -> None:
    """allowance_mib(): no residue allowed, only the tolerance."""
    _everywhere(mp, gpus.allowance_mib, lambda *, tolerance_mib, **kw: tolerance_mib)


def every_reading_fresh(mp: pytest.MonkeyPatch) -> None:
    """gate(): a held reading is a leftover whenever it was sampled."""
    orig = gpus.gate
    _everywhere(mp, orig, lambda readings, indexes, allowed_mib, fresh_after:
                orig(readings, indexes, allowed_mib, None))


def no_script_wait(mp: pytest.MonkeyPatch) -> None:
    """replicajobs.gpu_wait(): the replica job's script starts vLLM without checking its GPUs."""
    mp.setattr(replicajobs, "gpu_wait", lambda tolerance_mib, report: [])


def held_not_arriving(mp: pytest.MonkeyPatch) -> None:
    """Lifecycle: HELD is not on its way back (not counted as supply), in both tables."""
    orig = Lifecycle._reaches_traffic
    mp.setattr(Lifecycle, "_reaches_traffic",
               lambda self, phase: phase is not Phase.HELD and orig(self, phase))
    mp.setattr(lifecycle, "LIFECYCLE", Lifecycle(lifecycle.EDGES))
    mp.setattr(lifecycle, "JOB_LIFECYCLE", Lifecycle(lifecycle.JOB_EDGES))


def held_unbounded(mp: pytest.MonkeyPatch) -> None:
    """Edge.timeout_s(): timeouts.gpu_free_s bounds nothing (HELD never overdue)."""
    orig = Edge.timeout_s
    mp.setattr(Edge, "timeout_s", lambda self, config: None if self.timeout == "gpu_free_s"
               else orig(self, config))


def _carried_on(plan_model: Callable[..., Any],
                actions_of: Callable[[Any], list[Action]]) -> Callable[..., Any]:
    """`plan_model` with each HAND_OVER it decides turned into the carry-on of the HELD phase
    (what the loop that decides it leaves behind when it is skipped)."""
    def wrapped(*args: Any) -> Any:
        out = plan_model(*args)
        actions = actions_of(out)
        actions[:] = [replace(a, kind=ActionKind.CONTINUE, to_phase=Phase.STARTING, reason="carry on")
                      if a.kind is ActionKind.HAND_OVER else a for a in actions]
        return out
    return wrapped


def no_planner_hand_over(mp: pytest.MonkeyPatch) -> None:
    """policy/planner.py _plan_model: a HELD group past gpu_free_s is carried on, not handed over."""
    mp.setattr(planner, "_plan_model", _carried_on(planner._plan_model, lambda out: out))


def no_jobs_hand_over(mp: pytest.MonkeyPatch) -> None:
    """policy/jobs.py _plan_model: a HELD replica job past gpu_free_s is carried on."""
    mp.setattr(policy_jobs, "_plan_model", _carried_on(policy_jobs._plan_model, lambda out: out[0]))


def plain_held_reason(mp: pytest.MonkeyPatch) -> None:
    """handover.format_reason(): the Reason of a held GPU's hand-over names nothing."""
    mp.setattr(handover, "format_reason", lambda tag, node, since, held: "GPU held")


def plain_wake_failed_reason(mp: pytest.MonkeyPatch) -> None:
    """handover.format_wake_failed(): the Reason of a wake given up names nothing."""
    mp.setattr(handover, "format_wake_failed", lambda tag, node, since, replica, error: "wake failed")


def no_backoff(mp: pytest.MonkeyPatch) -> None:
    """StartRetries.backing_off(): a failed wake is tried again at once."""
    mp.setattr(StartRetries, "backing_off", lambda self, model, replica: None)


def unbounded_attempts(mp: pytest.MonkeyPatch) -> None:
    """StartRetries: engine.wake_attempts is never reached (no cold restart, never given up)."""
    mp.setattr(StartRetries, "_attempts", lambda self, model: 10**9)


def failed_start_arriving(mp: pytest.MonkeyPatch) -> None:
    """planner._Unit.of(): a replica whose start failed counts as coming back."""
    orig = planner._Unit.of
    mp.setattr(planner._Unit, "of", classmethod(
        lambda cls, group, replicas, failed_starts=frozenset(): orig(group, replicas)))


def residue_not_recorded(mp: pytest.MonkeyPatch) -> None:
    """EngineNotes.record_residue(): the residue measured at lend is forgotten."""
    mp.setattr(EngineNotes, "record_residue", lambda self, replica, per_gpu: None)


def residue_unlimited(mp: pytest.MonkeyPatch) -> None:
    """NodeDriver._measure_residue(): no gpu.max_residue_mib (every lend accepted)."""
    orig = NodeDriver._measure_residue

    def measure(self: NodeDriver, view: Any, replicas: Any, deadline: float) -> None:
        config = self.config
        self.config = config.model_copy(update={"gpu": config.gpu.model_copy(update={"max_residue_mib": 10**9})})
        try:
            orig(self, view, replicas, deadline)
        finally:
            self.config = config

    mp.setattr(NodeDriver, "_measure_residue", measure)


def refused_lent_again(mp: pytest.MonkeyPatch) -> None:
    """planner._Tick: the lends refused for their residue are not remembered."""
    orig = planner._Tick
    mp.setattr(planner, "_Tick", lambda *a, **kw: orig(*a, **{**kw, "refused": frozenset()}))


def dead_engines_count(mp: pytest.MonkeyPatch) -> None:
    """policy/service.py out_of_service(): every serving replica is capacity."""
    _everywhere(mp, service.out_of_service, lambda load: False)


def failing_counts(mp: pytest.MonkeyPatch) -> None:
    """policy/service.py failing(): a replica failing the tick's probe is as good as a live one."""
    _everywhere(mp, service.failing, lambda load: False)


RULES: dict[str, Removal] = {
    "gate": no_gate,
    "stopped_engine_finds_nothing": stopped_engine_finds_residue,
    "sleeping_engine_finds_its_residue": sleeping_engine_finds_nothing,
    "fresh_evidence_only": every_reading_fresh,
    "job_script_waits": no_script_wait,
    "held_counts_as_arriving": held_not_arriving,
    "held_bounded_by_gpu_free_s": held_unbounded,
    "planner_hands_over": no_planner_hand_over,
    "jobs_hand_over": no_jobs_hand_over,
    "held_reason_names_gpus": plain_held_reason,
    "wake_failed_reason_names_replica": plain_wake_failed_reason,
    "wake_backoff": no_backoff,
    "wake_attempts_bounded": unbounded_attempts,
    "failed_start_not_arriving": failed_start_arriving,
    "residue_recorded": residue_not_recorded,
    "residue_limit": residue_unlimited,
    "refused_not_lent_again": refused_lent_again,
    "only_live_engine_is_capacity": dead_engines_count,
    "failing_probe_is_out_of_service": failing_counts,
}

EXPECTED: dict[str, set[str]] = {
    "gate": {"nodes.reclaim_held", "nodes.held_waits", "nodes.allowance", "nodes.hand_over",
             "jobs.held_named", "jobs.hand_over"},
    "stopped_engine_finds_nothing": {"nodes.allowance", "jobs.held_named"},
    "sleeping_engine_finds_its_residue": {"nodes.allowance"},
    "fresh_evidence_only": {"nodes.lagging_reading"},
    "job_script_waits": {"jobs.script_waits"},
    "held_counts_as_arriving": {"nodes.held_counts", "jobs.held_counts"},
    "held_bounded_by_gpu_free_s": {"nodes.held_handed_over", "jobs.held_handed_over"},
    "planner_hands_over": {"nodes.held_handed_over"},
    "jobs_hand_over": {"jobs.held_handed_over"},
    "held_reason_names_gpus": {"nodes.hand_over", "jobs.hand_over"},
    "wake_failed_reason_names_replica": {"nodes.wake_given_up"},
    "wake_backoff": {"nodes.wake_backoff"},
    "wake_attempts_bounded": {"nodes.wake_given_up"},
    "failed_start_not_arriving": {"nodes.failed_start_not_arriving"},
    "residue_recorded": {"nodes.lend_residue"},
    "residue_limit": {"nodes.lend_refused"},
    "refused_not_lent_again": {"nodes.refused_not_lent"},
    # Whether a lend may go on with a replica out of service is rules.lend_evidence's (below).
    "only_live_engine_is_capacity": {"nodes.live_engine", "nodes.fast_check", "jobs.live_engine",
                                     "jobs.fast_check"},
    "failing_probe_is_out_of_service": {"nodes.live_engine", "nodes.fast_check", "nodes.nothing_lent",
                                        "jobs.live_engine", "jobs.fast_check", "jobs.nothing_lent"},
}

BOTH = frozenset({"nodes", "jobs"})
NODES = frozenset({"nodes"})
JOBS = frozenset({"jobs"})
#: The placements each rule is for (the module docstring says why a rule is for one only).
APPLIES: dict[str, frozenset[str]] = {
    "gate": BOTH,  # nodes: the driver's gate; jobs: the GPUs a held job's wait is named by
    "stopped_engine_finds_nothing": BOTH,
    "sleeping_engine_finds_its_residue": NODES,
    "fresh_evidence_only": NODES,
    "job_script_waits": JOBS,
    "held_counts_as_arriving": BOTH,
    "held_bounded_by_gpu_free_s": BOTH,
    "planner_hands_over": NODES,
    "jobs_hand_over": JOBS,
    "held_reason_names_gpus": BOTH,
    "wake_failed_reason_names_replica": NODES,
    "wake_backoff": NODES,
    "wake_attempts_bounded": NODES,
    "failed_start_not_arriving": NODES,
    "residue_recorded": NODES,
    "residue_limit": NODES,
    "refused_not_lent_again": NODES,
    "only_live_engine_is_capacity": BOTH,
    "failing_probe_is_out_of_service": BOTH,
}

@dataclass(frozen=True)
class Twice:
    """A rule written once per placement: `rule` takes out one writing, breaking its own
    placement only; `untouched`, a probe of the other placement, answers as before."""

    rule: str
    untouched: str
    where: str  # the other writing


TWICE: dict[str, Twice] = {
    "a GPU over its allowance holds the start": Twice(
        "gate", "jobs.script_waits",
        "the replica job's script tests `used > max` itself (replicajobs._GPU_CHECK's awk, run "
        "on the node before vLLM), besides policy/gpus.py gate()"),
    "a new engine may find only the tolerance": Twice(
        "stopped_engine_finds_nothing", "jobs.script_waits",
        "replicajobs.render_script gives the script gpu.free_tolerance_mib itself, not "
        "policy/gpus.py allowance_mib(engine_up=False), by which the job driver names GPUs"),
    "HELD past gpu_free_s is handed over": Twice(
        "planner_hands_over", "jobs.held_handed_over",
        "a HAND_OVER loop in policy/planner.py _plan_model and another in policy/jobs.py "
        "_plan_model (taken out by rule jobs_hand_over)"),
}


def _answers(tmp_path: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, probe in PROBES.items():
        (tmp_path / name).mkdir()
        try:
            out[name] = probe(tmp_path / name)
        except Exception as exc:  # noqa: BLE001 - a probe that breaks has changed
            out[name] = ("raised", type(exc).__name__)
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every probe's answer with every rule in place (computed once)."""
    return _answers(tmp_path_factory.mktemp("full"))


def test_every_rule_has_its_probes_and_placements() -> None:
    """Every rule is expected to break some probe, and every probe is some rule's."""
    assert set(EXPECTED) == set(RULES) == set(APPLIES)
    assert all(probes <= set(PROBES) for probes in EXPECTED.values())
    assert set(PROBES) == {p for probes in EXPECTED.values() for p in probes}  # none idle


@pytest.mark.parametrize("what", list(TWICE))
def test_a_rule_written_twice_breaks_one_placement(what: str) -> None:
    """Where a rule is written once per placement, its removal in one place leaves the other
    placement's probe as it was (once written once, this fails: update TWICE and EXPECTED)."""
    twice = TWICE[what]
    other = ({"nodes", "jobs"} - {twice.untouched.split(".")[0]}).pop()
    assert twice.untouched in PROBES and twice.untouched not in EXPECTED[twice.rule]
    assert any(p.startswith(f"{other}.") for p in EXPECTED[twice.rule])


def test_with_every_rule_the_probes_answer_as_the_rules_say(full: dict[str, object]) -> None:
    """The baseline is itself the rules at work, not a probe that raised."""
    assert not [name for name, answer in full.items() if isinstance(answer, tuple) and answer[:1] == ("raised",)]
    assert full["nodes.reclaim_held"] == (((Phase.RECLAIMING, Phase.STARTING, "waiting"),
                                           (Phase.RECLAIMING, Phase.HELD, "ok"),
                                           (Phase.HELD, Phase.STARTING, "waiting")), 0)
    assert full["nodes.allowance"] == (1, 0)  # the sleeping engine woken, the stopped one held
    assert full["jobs.script_waits"] == ("nvidia-smi", "scontrol", "sleep", "nvidia-smi", "scontrol", "srun")
    assert full["jobs.held_named"] == ("waiting", True)


@pytest.mark.parametrize("rule", list(RULES))
def test_removing_a_rule_changes_exactly_its_probes(rule: str, full: dict[str, object], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `rule`, exactly the probes that depend on it answer differently (or raise)."""
    RULES[rule](monkeypatch)
    reduced = _answers(tmp_path)
    changed = {name for name in PROBES if reduced[name] != full[name]}
    assert changed == EXPECTED[rule]


@pytest.mark.parametrize("rule", list(RULES))
def test_a_rule_breaks_every_placement_it_applies_to(rule: str) -> None:
    """A rule written once for every placement breaks a probe of each (the placements of its
    probes are those it applies to)."""
    assert {p.split(".")[0] for p in EXPECTED[rule]} == APPLIES[rule]
