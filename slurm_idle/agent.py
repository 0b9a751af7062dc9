"""One tick of the agent: lock -> observe -> plan -> act -> journal. Short glue, nothing else.

`observe` (observe.py) is the passive "sync from the world" (one `sinfo`/`scontrol show node`
and one `squeue` call, one batch of metrics queries, whatever the fleet size); `plan` is pure; acting is
the `NodeDriver`'s job, on a pool of up to MAX_ACTION_WORKERS threads so that several reclaims
progress at once without hundreds of nodes forking hundreds of `scontrol`s together. Failures of
an effector are journaled and become inputs of the next tick, never a crash of the loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from slurm_idle import filesd
from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.engine_notes import EngineNotes, notes_path
from slurm_idle.errors import SlurmIdleError
from slurm_idle.gpugate import GpuReader
from slurm_idle.jobdriver import JobDriver
from slurm_idle.journal import (
    DuplicateJobRecord,
    ForeignReplicaJobRecord,
    JobRecord,
    Journal,
    StepOutcome,
    TickRecord,
)
from slurm_idle.leadership import (
    ENGINE_WRITES,
    ROUTER_WRITES,
    SLURM_WRITES,
    Fenced,
    Leadership,
)
from slurm_idle.lock import Holder, inspect, try_lock
from slurm_idle.logs import get_logger
from slurm_idle.model import (
    Action,
    ModelPlan,
    Observation,
    Phase,
)
from slurm_idle.observe import log_observation, observe
from slurm_idle.replicajobs import replica_views
from slurm_idle.replicatrust import ReplicaTrust, not_yet_reported, trust_for
from slurm_idle.slurm.protocol import PoolSlurm
from slurm_idle.topology import group_views
from slurm_idle.transitions import NodeDriver, StepResult

if TYPE_CHECKING:  # imported where used: a tick that needs no engine loads none
    from slurm_idle.engine import Engine, EngineHealth
    from slurm_idle.metrics import MetricsSource
    from slurm_idle.metrics.gpus import GpuSource
    from slurm_idle.router import PoolRouters

log = get_logger(__name__)

#: Seconds one read of the pool's GPU memory may take inside a step (the gate polls it).
GPU_READ_BUDGET_S = 5.0

#: Nodes acted on at once in a tick. Their threads mostly sleep in shared polls; the cap bounds
#: the engine commands and `scontrol` writes in flight together on a large fleet. Nodes past it
#: start as threads free up, all within the same deadline.
MAX_ACTION_WORKERS = 32


#: Step outcomes that count as a tick's errors (the textfile's tick_error, `explain`).
FAILED_OUTCOMES = frozenset({StepOutcome.ERROR, StepOutcome.STUCK})

#: Share of the tick budget observe may spend on metrics and the serving replicas' probes (Slurm reads have
#: their own command timeout): the rest is for acting, which a surge needs most.
OBSERVE_SHARE = 0.5



@dataclass
class TickResult:
    """What one tick saw, decided and did."""

    observation: Observation | None
    actions: list[Action] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    plans: list[ModelPlan] = field(default_factory=list)
    locked_out: str | None = None  # set when another tick held the lock
    # Set when the lock's holder is not one of our ticks and has held it past the tick
    # budget: reported (exit 1, log, textfile, alert), not obeyed silently.
    lock_problem: str | None = None
    lock_holder: Holder | None = None
    duration_s: float = 0.0
    error: str | None = None
    started: float = 0.0  # unix seconds the tick began
    router_changes: list[dict[str, Any]] = field(default_factory=list)  # the tick's reconcile
    router_errors: int = 0  # failed router calls (reconcile and transitions)
    # Under a lease (ha.enabled): set when another agent leads, so this one only watched.
    standby: str | None = None
    leader: dict[str, Any] | None = None  # the lease as last read (status, textfile)
    leads: bool | None = None  # this agent held the lease for the pass (None: ha off)
    instance: str | None = None

    @property
    def errors(self) -> int:
        return (sum(1 for s in self.steps if s.outcome in FAILED_OUTCOMES) + bool(self.error)
                + bool(self.lock_problem))

    def as_json(self) -> dict[str, Any]:
        return {
            "standby": self.standby,
            "leads": self.leads,
            "locked_out": self.locked_out,
            "lock_problem": self.lock_problem,
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
            "router_changes": self.router_changes,  # the reconcile's calls (issue 14)
            "router_errors": self.router_errors,
        }


Planner = Callable[[Observation, Config, float], list[Action]]
Assessor = Callable[[Observation, Config, float], list[ModelPlan]]


@dataclass
class Agent:
    """Everything a tick needs, injected: adapters, planner, clock."""

    config: Config
    slurm: PoolSlurm
    metrics: MetricsSource
    engine_for: Callable[[str], Engine]
    planner: Planner
    assessor: Assessor
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    journal: Journal | None = None
    on_tick: Callable[[TickResult], None] | None = None  # e.g. the textfile writer
    max_workers: int = MAX_ACTION_WORKERS  # nodes acted on at once
    journal_empty: bool = True  # journal passes without action or error (the fast check: no)
    router: PoolRouters | None = None  # None: no router is told
    # Which replica jobs are ours (replicatrust.py); None: this user, the key beside the journal
    # (made when missing) if a model is `placement: jobs`.
    trust: ReplicaTrust | None = None
    # The nodes' GPU memory (metrics/gpus.py); None: not observed (NodeView.gpus stays None).
    gpus: GpuSource | None = None
    # Several agents, one actor (leadership.py): None acts alone under its lock, as before.
    leadership: Leadership | None = None

    def __post_init__(self) -> None:
        if self.journal is None:
            self.journal = Journal(Path(self.config.paths.journal))
        if self.leadership is not None and not isinstance(self.slurm, Fenced):
            self._lead_under(self.leadership)
        if self.trust is None:
            self.trust = trust_for(self.config, create=True, now=self.clock())

    def _lead_under(self, leadership: Leadership) -> None:
        """Journal records carry the epoch; Slurm and engine writes are fenced by the lease."""
        assert self.journal is not None
        self.journal = replace(self.journal, stamp=leadership.stamp)
        if leadership.on_event is None:
            leadership.on_event = self.journal.record
        self.slurm = cast(PoolSlurm, Fenced(self.slurm, SLURM_WRITES, leadership.fence))
        if self.router is not None and not isinstance(self.router, Fenced):
            self.router = cast("PoolRouters", Fenced(self.router, ROUTER_WRITES, leadership.fence))
        engine_for = self.engine_for
        engines: dict[str, Engine] = {}

        def fenced_engine(model: str) -> Engine:
            if model not in engines:
                engines[model] = cast("Engine", Fenced(engine_for(model), ENGINE_WRITES,
                                                        leadership.fence))
            return engines[model]

        self.engine_for = fenced_engine

    def observe(self, budget_s: float | None = None) -> Observation:
        obs = observe(self.config, self.slurm, self.metrics, self.clock(),
                      probe=self._probe, budget_s=budget_s, trust=self.trust, gpus=self.gpus)
        notes = EngineNotes(notes_path(self.config.paths.journal))
        return replace(obs, failed_starts=notes.failed_starts(), lend_refused=notes.refused())

    def _probe(self, model: str, replica: ReplicaConfig) -> EngineHealth:
        """The model's engine's probe of one serving replica (Engine.check)."""
        return self.engine_for(model).check(replica)

    def tick(self, dry_run: bool = False) -> TickResult:
        """One reconcile pass under the lock. A second concurrent tick returns at once.

        A dry run changes nothing, so it takes no lock (and needs no access to its directory).
        """
        if dry_run:
            return self._tick_locked(dry_run)
        if self.leadership is not None and not self.leadership.step():
            return self._standby(self.leadership)
        with try_lock(self.config.paths.lock, self.clock()) as locked:
            if not locked:
                return self._locked_out()
            return self._tick_locked(dry_run)

    def _note_leadership(self, result: TickResult) -> None:
        lease = self.leadership
        if lease is None:
            return
        result.instance = lease.instance
        result.leads = lease.valid()
        result.leader = lease.last.as_json(self.clock()) if lease.last is not None else None

    def _standby(self, leadership: Leadership) -> TickResult:
        """Another agent leads (or none yet, and this one is still watching): observe nothing,
        act on nothing; the textfile says who leads and how old the lease is."""
        now = self.clock()
        lease = leadership.last
        who = (f"{lease.instance} on {lease.host} leads (epoch {lease.epoch}, renewed "
               f"{lease.age_s(now):.0f} s ago)" if lease is not None and lease.instance
               else "no agent leads yet")
        result = TickResult(None, started=now, standby=f"standby: {who}", error=leadership.error)
        if leadership.error:  # Slurm unreachable is not "another agent leads": exit 1, alert
            log.error("%s", leadership.error)
        self._note_leadership(result)
        if self.on_tick is not None and self.journal_empty:
            self.on_tick(result)
        return result

    def _locked_out(self) -> TickResult:
        now = self.clock()
        holder = inspect(self.config.paths.lock, now)
        pid = holder.pid if holder and holder.pid else "?"
        result = TickResult(None, locked_out=f"another tick is running (pid {pid})", started=now)
        budget = self.config.timeouts.tick_budget_s
        if holder and not holder.is_tick and holder.held_s is not None and holder.held_s > budget:
            result.lock_holder = holder
            result.lock_problem = (
                f"{holder.describe()}, longer than the tick budget ({budget:g} s): no tick can "
                f"act (nor reclaim a node) until it is released; find it with `cat /proc/{pid}/"
                "cmdline` and end it"
            )
            result.locked_out = None
            log.error("%s", result.lock_problem)
            if self.on_tick is not None:
                self.on_tick(result)
        return result

    def _gpu_reader(self) -> GpuReader | None:
        """The GPU gate's read of the pool's GPU memory (one query, a few seconds at most: the
        driver polls it while a reclaimed group waits); None without a GPU source."""
        source = self.gpus
        if source is None:
            return None
        return lambda nodes: source.readings(nodes, budget_s=GPU_READ_BUDGET_S)

    def run_actions(
        self, actions: Sequence[Action], observation: Observation, deadline: float | None = None,
        on_step: Callable[[StepResult], None] | None = None, cancel_duplicates: bool = True,
    ) -> list[StepResult]:
        """Apply actions (admin commands use this too), a thread per node up to `max_workers`,
        by `deadline` (default: the tick budget from now). `on_step` sees each step once it is
        journaled (an admin's command prints it then, not after the last one)."""
        if deadline is None:
            deadline = self.clock() + self.config.timeouts.tick_budget_s

        def journal_step(step: StepResult) -> None:
            self._journal_step(step)
            if on_step is not None:
                on_step(step)

        driver = NodeDriver(
            self.config, self.slurm, self.engine_for, self.clock, self.sleep,
            on_step=journal_step, on_event=self._journal_event, router=self.router,
            trust=self.trust, gpu_readings=self._gpu_reader(),
        )
        groups = {g.name: g for g in group_views(observation, self.config)}
        todo: list[tuple[Callable[..., list[StepResult]], Any, Action]] = [
            (driver.drive, groups[a.node], a) for a in actions if a.node in groups]
        replica_jobs = {r.name: r for r in observation.replica_jobs}
        if any(r.duplicates for r in observation.replica_jobs) or any(
                a.node in replica_jobs for a in actions):
            jobs = JobDriver(self.config, self.slurm, self.engine_for, self.clock, self.sleep,
                             on_step=journal_step, router=self.router, trust=self.trust,
                             gpu_readings=self._gpu_reader())
            if cancel_duplicates:  # the watchdog never cancels a job
                for record in jobs.cancel_duplicates(observation.replica_jobs):
                    self._journal_event(record)
            todo += [(jobs.drive, replica_jobs[a.node], a) for a in actions if a.node in replica_jobs]
        if not todo:
            return []
        # A thread per node up to the cap: a surge must start reclaims now, not after the waits
        # of the first few (threads mostly sleep in polls; the shared polls keep Slurm calls few).
        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), self.max_workers))) as pool:
            futures = [pool.submit(drive, view, action, deadline) for drive, view, action in todo]
            return [step for future in futures for step in future.result()]

    def _tick_locked(self, dry_run: bool) -> TickResult:
        started = self.clock()
        result = TickResult(None, started=started)
        self._note_leadership(result)  # before on_tick: the textfile says who leads
        try:
            # One budget for the whole tick: observe may use part of it, acting has the rest.
            budget_s = self.config.timeouts.tick_budget_s
            obs = self.observe(budget_s=budget_s * OBSERVE_SHARE)
            result.observation = obs
            for problem in obs.errors:
                log.warning("%s", problem)
            if not dry_run:
                self._report_foreign(obs)
                self._remember_unhealthy(obs)
            if log.isEnabledFor(logging.DEBUG):
                log_observation(obs)
            if self.router is not None and not dry_run:
                # The router's state read back and made to match Slurm's phases (issue 14).
                result.router_changes = self.router.reconcile(obs)
            result.plans = self.assessor(obs, self.config, obs.now)
            result.actions = self.planner(obs, self.config, obs.now)
            for action in result.actions:
                log.info("plan: %s %s (%s -> %s): %s", action.kind.value, action.node,
                         action.from_phase.value, action.to_phase.value, action.reason)
            if not dry_run:
                result.steps = self.run_actions(result.actions, obs, deadline=started + budget_s)
                self._write_file_sd(obs, result.actions)
        except SlurmIdleError as exc:
            result.error = str(exc)
            log.error("tick failed: %s", exc)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            log.exception("tick failed unexpectedly")
        result.duration_s = self.clock() - started
        if self.router is not None:
            result.router_errors = self.router.take_errors()
        quiet = not (result.actions or result.error or result.router_errors)
        if not dry_run and (self.journal_empty or not quiet):
            self._journal_tick(result, started)
            if self.on_tick is not None:
                self.on_tick(result)
        return result

    def _write_file_sd(self, obs: Observation, actions: Sequence[Action]) -> None:
        """Prometheus' targets of the replica jobs as they are after this tick's steps (one more
        `squeue` when a step moved a replica job, none otherwise)."""
        path = self.config.paths.file_sd
        if path is None or not obs.replica_jobs:
            return
        replicas = obs.replica_jobs
        if any(a.node in {r.name for r in replicas} for a in actions):
            assert self.trust is not None
            replicas = replica_views(self.config, self.slurm.jobs(), self.trust)
        filesd.write(path, replicas)

    def _report_foreign(self, obs: Observation) -> None:
        """Log and journal each job that looks like a replica job but is not ours, once. It is
        a user's job: never cancelled; its slot counts as empty (the real replica starts)."""
        foreign = {f.job_id: f for f in obs.foreign_replica_jobs}
        if not foreign and not obs.replica_jobs:
            return
        assert self.journal is not None
        for job_id in sorted(not_yet_reported(self.config.paths.journal, set(foreign))):
            job = foreign[job_id]
            log.warning("%s", job.describe())
            self.journal.record(ForeignReplicaJobRecord(ts=obs.now, job_id=job.job_id,
                                                        user=job.user, nodes=job.nodes,
                                                        replica=job.replica, why=job.why))

    def _remember_unhealthy(self, obs: Observation) -> None:
        """Since when each replica meant to serve has been unhealthy, for `status`."""
        from slurm_idle.replica_health import unhealthy_names
        from slurm_idle.unhealthy_since import remember, since_path

        remember(since_path(self.config.paths.journal), unhealthy_names(obs, self.config), obs.now)

    def _journal_step(self, step: StepResult) -> None:
        assert self.journal is not None
        self.journal.record(step.to_record())

    def _journal_event(self, record: JobRecord | DuplicateJobRecord) -> None:
        """What a reclaim did to one job (eviction.py: signalled, requeued, cancelled, error),
        or the duplicate replica jobs cancelled (jobdriver.py)."""
        assert self.journal is not None
        self.journal.record(record)

    def _journal_tick(self, result: TickResult, started: float) -> None:
        from slurm_idle.idle_runs import record_tick
        from slurm_idle.journal_snapshots import snapshot_if_new_day

        assert self.journal is not None
        snapshot_if_new_day(self.journal, {n: p.value for n, p in final_phases(result).items()},
                            started)
        record_tick(self.journal, TickRecord(
            ts=started,
            duration_s=result.duration_s,
            actions=len(result.actions),
            errors=result.errors,
            phases=phase_counts(result),
            needed={p.model: p.needed_replicas for p in result.plans},
            serving={p.model: p.serving_replicas for p in result.plans},
            error=result.error,
        ), cadence_s=self.config.policy.tick_interval_s)


def final_phases(result: TickResult) -> dict[str, Phase]:
    """Each node's (and replica job's) phase after the tick's steps (empty: nothing observed)."""
    if result.observation is None:
        return {}
    final: dict[str, Phase] = {v.name: v.phase for v in result.observation.nodes}
    final.update((r.name, r.phase) for r in result.observation.replica_jobs)  # placement: jobs
    for step in result.steps:
        if step.outcome is StepOutcome.OK:
            for node in step.nodes or (step.node,):
                final[node] = step.to_phase
    return final


def phase_counts(result: TickResult) -> dict[str, int]:
    """Nodes (and replica jobs) per phase after the tick's steps (every phase present, 0 when
    none)."""
    counts: Counter[str] = Counter({p.value: 0 for p in Phase})
    counts.update(p.value for p in final_phases(result).values())
    return dict(counts)
