"""One tick of the agent: lock -> observe -> plan -> act -> journal. Short glue, nothing else.

`observe` is the passive "sync from the world" (one `sinfo`/`scontrol show node` and one
`squeue` call, one batch of metrics queries, whatever the fleet size); `plan` is pure; acting is
the `NodeDriver`'s job, on a pool of up to MAX_ACTION_WORKERS threads so that several reclaims
progress at once without hundreds of nodes forking hundreds of `scontrol`s together. Failures of
an effector are journaled and become inputs of the next tick, never a crash of the loop.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_idle.config import Config
from slurm_idle.errors import MetricsUnavailable, SlurmIdleError
from slurm_idle.journal import Journal
from slurm_idle.lifecycle import PhaseInfo, derive_phase
from slurm_idle.lock import lock_holder, try_lock
from slurm_idle.logs import get_logger
from slurm_idle.model import (
    Action,
    ModelLoad,
    ModelPlan,
    NodeView,
    Observation,
    Phase,
    ReplicaLoad,
    SlurmJob,
    SlurmNode,
)
from slurm_idle.transitions import ACTIVE_JOB_STATES, NodeDriver, StepResult

log = get_logger(__name__)

#: Nodes acted on at once in a tick. Their threads mostly sleep in shared polls; the cap bounds
#: the engine commands and `scontrol` writes in flight together on a large fleet. Nodes past it
#: start as threads free up, all within the same deadline.
MAX_ACTION_WORKERS = 32


def observe(config: Config, slurm: Any, metrics: Any, now: float) -> Observation:
    """Build one frozen snapshot of the pool from Slurm and the engines' metrics.

    Python's cyclic GC is paused meanwhile: decoding and parsing 10,000 nodes' JSON allocates
    some 10^5 containers and no cycles, and the collector's passes over them cost as much CPU as
    the parsing itself. The previous GC state is restored on the way out, also on errors.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        # Jobs first: the CLI backend learns the Slurm release from that answer, so on 23.02+
        # the node query goes straight to `scontrol show node --json` (2 reads per tick, not 3).
        jobs: list[SlurmJob] = list(slurm.jobs())
        nodes = {node.name: node for node in slurm.nodes()}
        errors: list[str] = []
        replicas = [(m.name, r) for m in config.models for r in m.replicas]
        replica_loads: dict[str, ReplicaLoad] = {}
        model_loads: tuple[ModelLoad, ...]
        try:
            for load in metrics.replica_loads(replicas):
                replica_loads[load.node] = load
            model_loads = tuple(metrics.model_loads(config.models, now))
        except MetricsUnavailable as exc:
            errors.append(f"metrics unavailable: {exc}")
            model_loads = tuple(ModelLoad(model=m.name, known=False) for m in config.models)
        jobs_by_node: dict[str, list[SlurmJob]] = {}
        for job in jobs:
            if job.state in ACTIVE_JOB_STATES:
                for name in job.nodes:
                    jobs_by_node.setdefault(name, []).append(job)
        tag = config.slurm.tag
        views = []
        for model_name, replica in replicas:
            name = replica.node
            node = nodes.get(name)
            if node is None:
                errors.append(f"pool node {name} is not known to Slurm (check the config)")
                node = SlurmNode(name=name, state="unknown")
                info = PhaseInfo(Phase.UNKNOWN)  # nothing to act on, and not an admin's either
            else:
                info = derive_phase(node, tag)
            node_jobs = jobs_by_node.get(name)
            views.append(
                NodeView(
                    node=node,
                    model=model_name,
                    phase=info.phase,
                    phase_since=info.since,
                    pinned=info.pinned,
                    jobs=tuple(node_jobs) if node_jobs else (),
                    replica=replica_loads.get(name),
                )
            )
        return Observation(now=now, nodes=tuple(views), models=model_loads, errors=tuple(errors))
    finally:
        if collecting:
            gc.enable()


def _log_observation(obs: Observation) -> None:
    """-v: what the planner is about to decide from, one line per model and per node phase."""
    for m in obs.models:
        log.debug(
            "observed %s: known=%s demand=%.1f tok/s (window max %s) running=%.1f waiting=%.1f "
            "kv_max=%.2f ttft_p95=%s", m.model, m.known,
            m.prompt_tokens_per_s + m.generation_tokens_per_s, m.demand_tokens_per_s_max_window,
            m.running, m.waiting, m.kv_cache_usage_max, m.ttft_p95_s,
        )
    for v in obs.nodes:
        log.debug("observed %s: model=%s phase=%s%s slurm=%s jobs=%d replica=%s", v.name, v.model,
                  v.phase.value, " pinned" if v.pinned else "", v.node.state, len(v.jobs),
                  "up" if v.replica is not None else "-")


@dataclass
class TickResult:
    """What one tick saw, decided and did."""

    observation: Observation | None
    actions: list[Action] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    plans: list[ModelPlan] = field(default_factory=list)
    locked_out: str | None = None  # set when another tick held the lock
    duration_s: float = 0.0
    error: str | None = None
    started: float = 0.0  # unix seconds the tick began

    @property
    def errors(self) -> int:
        return sum(1 for s in self.steps if s.outcome in {"error", "stuck"}) + bool(self.error)

    def as_json(self) -> dict[str, Any]:
        return {
            "locked_out": self.locked_out,
            "duration_s": round(self.duration_s, 3),
            "error": self.error,
            "actions": [
                {
                    "kind": a.kind.value,
                    "node": a.node,
                    "model": a.model,
                    "from": a.from_phase.value,
                    "to": a.to_phase.value,
                    "reason": a.reason,
                }
                for a in self.actions
            ],
            "steps": [s.record() for s in self.steps],
            "models": [
                {"model": p.model, "needed": p.needed_replicas, "serving": p.serving_replicas,
                 "reason": p.reason}
                for p in self.plans
            ],
            "observation_errors": list(self.observation.errors) if self.observation else [],
        }


Planner = Callable[[Observation, Config, float], list[Action]]
Assessor = Callable[[Observation, Config, float], list[ModelPlan]]


@dataclass
class Agent:
    """Everything a tick needs, injected: adapters, planner, clock."""

    config: Config
    slurm: Any
    metrics: Any
    engine_for: Callable[[str], Any]
    planner: Planner
    assessor: Assessor
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    journal: Journal | None = None
    on_tick: Callable[[TickResult], None] | None = None  # e.g. the textfile writer
    max_workers: int = MAX_ACTION_WORKERS  # nodes acted on at once
    journal_empty: bool = True  # journal passes without action or error (the fast check: no)

    def __post_init__(self) -> None:
        if self.journal is None:
            self.journal = Journal(Path(self.config.paths.journal))

    def observe(self) -> Observation:
        return observe(self.config, self.slurm, self.metrics, self.clock())

    def tick(self, dry_run: bool = False) -> TickResult:
        """One reconcile pass under the lock. A second concurrent tick returns at once."""
        with try_lock(self.config.paths.lock) as locked:
            if not locked:
                holder = lock_holder(self.config.paths.lock)
                return TickResult(None, locked_out=f"another tick is running (pid {holder or '?'})")
            return self._tick_locked(dry_run)

    def run_actions(self, actions: Sequence[Action], observation: Observation) -> list[StepResult]:
        """Apply actions (admin commands use this too), a thread per node up to `max_workers`,
        within the budget."""
        deadline = self.clock() + self.config.timeouts.tick_budget_s
        driver = NodeDriver(
            self.config, self.slurm, self.engine_for, self.clock, self.sleep, on_step=self._journal_step
        )
        views = {v.name: v for v in observation.nodes}
        todo = [(views[a.node], a) for a in actions if a.node in views]
        if not todo:
            return []
        # A thread per node up to the cap: a surge must start reclaims now, not after the waits
        # of the first few (threads mostly sleep in polls; the shared polls keep Slurm calls few).
        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), self.max_workers))) as pool:
            futures = [pool.submit(driver.drive, view, action, deadline) for view, action in todo]
            return [step for future in futures for step in future.result()]

    def _tick_locked(self, dry_run: bool) -> TickResult:
        started = self.clock()
        result = TickResult(None, started=started)
        try:
            obs = self.observe()
            result.observation = obs
            for problem in obs.errors:
                log.warning("%s", problem)
            if log.isEnabledFor(logging.DEBUG):
                _log_observation(obs)
            result.plans = self.assessor(obs, self.config, obs.now)
            result.actions = self.planner(obs, self.config, obs.now)
            for action in result.actions:
                log.info("plan: %s %s (%s -> %s): %s", action.kind.value, action.node,
                         action.from_phase.value, action.to_phase.value, action.reason)
            if not dry_run:
                result.steps = self.run_actions(result.actions, obs)
        except SlurmIdleError as exc:
            result.error = str(exc)
            log.error("tick failed: %s", exc)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            log.exception("tick failed unexpectedly")
        result.duration_s = self.clock() - started
        if not dry_run and (self.journal_empty or result.actions or result.error):
            self._journal_tick(result, started)
            if self.on_tick is not None:
                self.on_tick(result)
        return result

    def _journal_step(self, step: StepResult) -> None:
        assert self.journal is not None
        self.journal.append(step.record())

    def _journal_tick(self, result: TickResult, started: float) -> None:
        assert self.journal is not None
        record: dict[str, Any] = {
            "event": "tick",
            "ts": round(started, 3),
            "duration_s": round(result.duration_s, 3),
            "actions": len(result.actions),
            "errors": result.errors,
            "dry_run": False,
            "phases": phase_counts(result),
            "needed": {p.model: p.needed_replicas for p in result.plans},
            "serving": {p.model: p.serving_replicas for p in result.plans},
        }
        if result.error:
            record["error"] = result.error
        self.journal.append(record)


def phase_counts(result: TickResult) -> dict[str, int]:
    """Nodes per phase after the tick's steps (every phase present, 0 when none)."""
    counts: Counter[str] = Counter({p.value: 0 for p in Phase})
    if result.observation is None:
        return dict(counts)
    final: dict[str, Phase] = {v.name: v.phase for v in result.observation.nodes}
    for step in result.steps:
        if step.outcome == "ok":
            final[step.node] = step.to_phase
    counts.update(p.value for p in final.values())
    return dict(counts)
