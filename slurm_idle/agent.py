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
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_idle import filesd
from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.errors import MetricsUnavailable, SlurmIdleError
from slurm_idle.jobdriver import JobDriver, probe_config
from slurm_idle.journal import JobRecord, Journal, StepOutcome, TickRecord
from slurm_idle.lifecycle import PhaseInfo, derive_phase, takes_traffic
from slurm_idle.lock import Holder, inspect, try_lock
from slurm_idle.logs import get_logger
from slurm_idle.metrics.serving import loads_by_replica, serving_model_load
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
from slurm_idle.replicajobs import partition_of, replica_views
from slurm_idle.slurm.protocol import ClusterReader, PoolSlurm
from slurm_idle.topology import group_views
from slurm_idle.transitions import ACTIVE_JOB_STATES, NodeDriver, StepResult

if TYPE_CHECKING:  # imported where used: a tick that needs no engine loads none
    from slurm_idle.engine import Engine, Identity
    from slurm_idle.metrics import MetricsSource
    from slurm_idle.router.sync import RouterSet

log = get_logger(__name__)

#: Nodes acted on at once in a tick. Their threads mostly sleep in shared polls; the cap bounds
#: the engine commands and `scontrol` writes in flight together on a large fleet. Nodes past it
#: start as threads free up, all within the same deadline.
MAX_ACTION_WORKERS = 32


#: Step outcomes that count as a tick's errors (the textfile's tick_error, `explain`).
FAILED_OUTCOMES = frozenset({StepOutcome.ERROR, StepOutcome.STUCK})

#: Share of the tick budget observe may spend on metrics and identity checks (Slurm reads have
#: their own command timeout): the rest is for acting, which a surge needs most.
OBSERVE_SHARE = 0.5

#: model name, replica -> whether its endpoint is the expected engine (engine.Identity).
Identify = Callable[[str, ReplicaConfig], "Identity"]


def observe(
    config: Config,
    slurm: ClusterReader,
    metrics: MetricsSource,
    now: float,
    *,
    identify: Identify | None = None,
    budget_s: float | None = None,
) -> Observation:
    """Build one frozen snapshot of the pool from Slurm and the engines' metrics.

    Phases come first (from Slurm), so that only the replicas we know are ours and serving
    count: each serving-phase endpoint is checked to be the expected engine (`identify`, every
    tick), and each model's present demand is summed over those replicas alone
    (metrics.serving), never over a lent node's port. `budget_s` bounds the metrics calls and
    identity checks together (each HTTP call has a total deadline within it).

    Python's cyclic GC is paused meanwhile: decoding and parsing 10,000 nodes' JSON allocates
    some 10^5 containers and no cycles, and the collector's passes over them cost as much CPU as
    the parsing itself. The previous GC state is restored on the way out, also on errors.
    """
    started = time.monotonic()

    def left() -> float | None:
        return None if budget_s is None else max(0.0, budget_s - (time.monotonic() - started))

    collecting = gc.isenabled()
    gc.disable()
    try:
        # Jobs first: the CLI backend learns the Slurm release from that answer, so on 23.02+
        # the node query goes straight to `scontrol show node --json` (2 reads per tick, not 3).
        jobs: list[SlurmJob] = list(slurm.jobs())
        nodes = {node.name: node for node in slurm.nodes()}
        errors: list[str] = []
        # `placement: jobs` replicas: rebuilt from the same squeue answer (replicajobs.py).
        replica_jobs = replica_views(config, jobs)
        placed = [r for r in replica_jobs if r.nodes and r.url]
        job_serving = [r for r in placed if takes_traffic(r.phase)]
        replicas = [(m.name, r) for m in config.models for r in m.replicas]
        tag = config.slurm.tag
        infos: dict[str, PhaseInfo] = {}
        model_of: dict[str, str] = {}  # node -> the model of its first replica
        headed: dict[str, list[tuple[str, ReplicaConfig]]] = {}  # node -> replicas headed there
        for model_name, replica in replicas:
            headed.setdefault(replica.node, []).append((model_name, replica))
            for name in replica.nodes:
                model_of.setdefault(name, model_name)
        missing: list[str] = []
        for name in model_of:
            node = nodes.get(name)
            if node is None:
                # Left out of the snapshot below: a node Slurm does not have is no capacity to
                # lend (counting it would raise max_lent_fraction's share of the real ones).
                missing.append(name)
                infos[name] = PhaseInfo(Phase.UNKNOWN)  # nothing to act on, not an admin's
            else:
                infos[name] = derive_phase(node, tag)
        errors.extend(gres_mismatches(config, nodes))
        serving = serving_replicas(replicas, infos)
        foreign: dict[str, str] = {}  # replica name -> why
        if identify is not None and serving:
            foreign = check_identities(identify, serving, left())
            for name, why in sorted(foreign.items()):
                errors.append(f"{name}: its endpoint is not the expected engine ({why}): not "
                              "counted as serving")
        # Per replica, never per node: two replicas on one node (or one spanning nodes) are
        # counted, or not, each on its own; a foreign one never takes its neighbour with it.
        counted = {r.name for _, r in serving if r.name not in foreign}
        found: list[ReplicaLoad] = []
        model_loads: tuple[ModelLoad, ...]
        try:
            probes = [(r.model, probe_config(r)) for r in placed]
            found = list(metrics.replica_loads([*replicas, *probes], budget_s=left(),
                                               serving=counted | {r.name for r in job_serving}))
            model_loads = tuple(metrics.model_loads(config.models, now, budget_s=left(),
                                                    serving=counted))
        except MetricsUnavailable as exc:
            errors.append(f"metrics unavailable: {exc}")
            model_loads = tuple(ModelLoad(model=m.name, known=False) for m in config.models)
        fallen_back = getattr(metrics, "primary_error", None)
        if fallen_back and getattr(metrics, "source", "") == "scrape":
            errors.append(f"{fallen_back}: planned on direct scrapes of the serving replicas "
                          "(nothing new is lent without Prometheus' history)")
        of_replica = loads_by_replica(replicas, found)  # replica name -> load
        by_url = {load.url: load for load in found if load.url}  # replica jobs' loads
        for model_name, replica in serving:
            if replica.name in foreign:  # its metrics are not a replica of ours: never counted
                of_replica[replica.name] = ReplicaLoad(
                    model=model_name, node=replica.node, url=replica.url, known=False, foreign=True
                )
        counted_of: dict[str, list[ReplicaLoad | None]] = {}
        for model_name, replica in replicas:
            if replica.name in counted:
                counted_of.setdefault(model_name, []).append(of_replica.get(replica.name))
        for r in job_serving:
            counted_of.setdefault(r.model, []).append(by_url.get(r.url))
        replica_jobs = tuple(replace(r, load=by_url.get(r.url)) if r.url else r
                             for r in replica_jobs)
        weight = config.policy.prompt_token_weight
        model_loads = tuple(
            serving_model_load(load, counted_of.get(load.model, ()), weight) for load in model_loads
        )
        jobs_by_node: dict[str, list[SlurmJob]] = {}
        for job in jobs:
            if job.state in ACTIVE_JOB_STATES:
                for name in job.nodes:
                    jobs_by_node.setdefault(name, []).append(job)
        views = []
        for name, model_name in model_of.items():
            if name in missing:
                continue
            info = infos[name]
            node_jobs = jobs_by_node.get(name)
            here = headed.get(name, [])
            loads = _loads_of(here, of_replica)
            views.append(
                NodeView(
                    node=nodes[name],  # pool nodes Slurm does not know were left out above
                    model=model_name,
                    phase=info.phase,
                    phase_since=info.since,
                    pinned=info.pinned,
                    jobs=tuple(node_jobs) if node_jobs else (),
                    replica=loads[0] if loads else None,
                    replicas=loads if len(here) > 1 else (),
                )
            )
        if missing:  # one line per tick, however many: a typo'd range must not flood the log
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            errors.append(
                f"{len(missing)} pool node(s) not known to Slurm, left out: {shown} (check the config)"
            )
        placement_nodes = _placement_nodes(config, nodes, jobs) if replica_jobs else ()
        for r in replica_jobs:
            if r.duplicates:
                errors.append(f"{r.name}: duplicate replica job(s) {', '.join(map(str, r.duplicates))} "
                              f"beside job {r.job_id}: the extra ones are cancelled")
        return Observation(now=now, nodes=tuple(views), models=model_loads, errors=tuple(errors),
                           metrics_source=str(getattr(metrics, "source", "")),
                           replica_jobs=replica_jobs, placement_nodes=placement_nodes)
    finally:
        if collecting:
            gc.enable()


def _placement_nodes(config: Config, nodes: dict[str, SlurmNode],
                     jobs: Sequence[SlurmJob]) -> tuple[NodeView, ...]:
    """The nodes replica jobs may run on (their partitions), each with its active jobs of the
    lend partition: what a replica job would preempt there."""
    parts = {partition_of(config, m) for m in config.models if m.job is not None}
    lend = config.slurm.lend_partition
    on: dict[str, list[SlurmJob]] = {}
    for job in jobs:
        if job.state in ACTIVE_JOB_STATES and lend in job.partition.split(","):
            for name in job.nodes:
                on.setdefault(name, []).append(job)
    return tuple(NodeView(node=n, model="", phase=Phase.UNKNOWN, jobs=tuple(on.get(n.name, ())))
                 for n in nodes.values() if parts & set(n.partitions))


def serving_replicas(
    replicas: Sequence[tuple[str, ReplicaConfig]], infos: dict[str, PhaseInfo]
) -> list[tuple[str, ReplicaConfig]]:
    """The replicas in a serving phase on every node they span: a replica with one node lent
    (a half-converged group) is not whole, and that node's ports are a job's, never ours."""
    return [(m, r) for m, r in replicas
            if all(takes_traffic(infos[n].phase) for n in r.nodes)]


def gres_mismatches(config: Config, nodes: dict[str, SlurmNode]) -> list[str]:
    """Warnings for nodes whose GPUs in Slurm (gres) differ from the config's gpus_per_node:
    the replicas' GPU sets, and what a lend is worth, would not be what the config says."""
    out = []
    for m in config.models:
        if m.gpus_per_node is None:
            continue
        for n in dict.fromkeys(n for r in m.replicas for n in r.nodes):
            node = nodes.get(n)
            if node is not None and node.gpus_total and node.gpus_total != m.gpus_per_node:
                out.append(f"{n}: Slurm reports {node.gpus_total} GPU(s) (gres), the config says "
                           f"gpus_per_node {m.gpus_per_node} for {m.name!r}: check the config")
    return out


def _loads_of(
    here: list[tuple[str, ReplicaConfig]], loads: dict[str, ReplicaLoad]
) -> tuple[ReplicaLoad, ...]:
    """The loads of the replicas headed on one node (`loads`: by replica name, see
    metrics.serving.loads_by_replica), named after their replica when the node has several."""
    out = []
    for _, replica in here:
        load = loads.get(replica.name)
        if load is not None:
            out.append(load if len(here) == 1 else replace(load, name=replica.name))
    return tuple(out)


def check_identities(
    identify: Identify, serving: Sequence[tuple[str, ReplicaConfig]], budget_s: float | None
) -> dict[str, str]:
    """replica name -> why, for the serving replicas whose endpoint proved not to be the expected
    engine. Checked in parallel; a check that does not answer within `budget_s` tells nothing
    (the replica's metrics decide, as before), only a definite "not ours" excludes it."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(serving), MAX_ACTION_WORKERS)))
    try:
        futures = {pool.submit(identify, m, r): r.name for m, r in serving}
        done, _ = wait(futures, timeout=budget_s)
        foreign = {}
        for future in done:
            try:
                identity = future.result()
            except Exception as exc:  # noqa: BLE001 - a probe bug tells nothing either way
                log.warning("%s: identity check failed: %s", futures[future], exc)
                continue
            if identity.ours is False:
                foreign[futures[future]] = identity.why
        return foreign
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


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
    # Set when the lock's holder is not one of our ticks and has held it past the tick
    # budget: reported (exit 1, log, textfile, alert), not obeyed silently.
    lock_problem: str | None = None
    lock_holder: Holder | None = None
    duration_s: float = 0.0
    error: str | None = None
    started: float = 0.0  # unix seconds the tick began
    router_changes: list[dict[str, Any]] = field(default_factory=list)  # the tick's reconcile
    router_errors: int = 0  # failed router calls (reconcile and transitions)

    @property
    def errors(self) -> int:
        return (sum(1 for s in self.steps if s.outcome in FAILED_OUTCOMES) + bool(self.error)
                + bool(self.lock_problem))

    def as_json(self) -> dict[str, Any]:
        return {
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
    router: RouterSet | None = None  # None: no router is told

    def __post_init__(self) -> None:
        if self.journal is None:
            self.journal = Journal(Path(self.config.paths.journal))

    def observe(self, budget_s: float | None = None) -> Observation:
        return observe(self.config, self.slurm, self.metrics, self.clock(),
                       identify=self._identify, budget_s=budget_s)

    def _identify(self, model: str, replica: ReplicaConfig) -> Identity:
        """The model's engine's identity check of one replica (engines without one: ours)."""
        from slurm_idle.engine import Identity

        check = getattr(self.engine_for(model), "identify", None)
        return check(replica) if check is not None else Identity(True, "engine cannot tell")

    def tick(self, dry_run: bool = False) -> TickResult:
        """One reconcile pass under the lock. A second concurrent tick returns at once.

        A dry run changes nothing, so it takes no lock (and needs no access to its directory).
        """
        if dry_run:
            return self._tick_locked(dry_run)
        with try_lock(self.config.paths.lock, self.clock()) as locked:
            if not locked:
                return self._locked_out()
            return self._tick_locked(dry_run)

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

    def run_actions(
        self, actions: Sequence[Action], observation: Observation, deadline: float | None = None
    ) -> list[StepResult]:
        """Apply actions (admin commands use this too), a thread per node up to `max_workers`,
        by `deadline` (default: the tick budget from now)."""
        if deadline is None:
            deadline = self.clock() + self.config.timeouts.tick_budget_s
        driver = NodeDriver(
            self.config, self.slurm, self.engine_for, self.clock, self.sleep,
            on_step=self._journal_step, on_event=self._journal_event, router=self.router,
        )
        groups = {g.name: g for g in group_views(observation, self.config)}
        todo: list[tuple[Callable[..., list[StepResult]], Any, Action]] = [
            (driver.drive, groups[a.node], a) for a in actions if a.node in groups]
        replica_jobs = {r.name: r for r in observation.replica_jobs}
        if any(r.duplicates for r in observation.replica_jobs) or any(
                a.node in replica_jobs for a in actions):
            jobs = JobDriver(self.config, self.slurm, self.engine_for, self.clock, self.sleep,
                             on_step=self._journal_step, router=self.router)
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
        try:
            # One budget for the whole tick: observe may use part of it, acting has the rest.
            budget_s = self.config.timeouts.tick_budget_s
            obs = self.observe(budget_s=budget_s * OBSERVE_SHARE)
            result.observation = obs
            for problem in obs.errors:
                log.warning("%s", problem)
            if log.isEnabledFor(logging.DEBUG):
                _log_observation(obs)
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
            replicas = replica_views(self.config, self.slurm.jobs())
        filesd.write(path, replicas)

    def _journal_step(self, step: StepResult) -> None:
        assert self.journal is not None
        self.journal.append(step.to_record())

    def _journal_event(self, record: JobRecord | dict[str, Any]) -> None:
        """What a reclaim did to one job (eviction.py: signalled, requeued, cancelled, error)."""
        assert self.journal is not None
        self.journal.append(record)

    def _journal_tick(self, result: TickResult, started: float) -> None:
        assert self.journal is not None
        self.journal.append(TickRecord(
            ts=started,
            duration_s=result.duration_s,
            actions=len(result.actions),
            errors=result.errors,
            phases=phase_counts(result),
            needed={p.model: p.needed_replicas for p in result.plans},
            serving={p.model: p.serving_replicas for p in result.plans},
            error=result.error,
        ))


def phase_counts(result: TickResult) -> dict[str, int]:
    """Nodes (and replica jobs) per phase after the tick's steps (every phase present, 0 when
    none)."""
    counts: Counter[str] = Counter({p.value: 0 for p in Phase})
    if result.observation is None:
        return dict(counts)
    final: dict[str, Phase] = {v.name: v.phase for v in result.observation.nodes}
    final.update((r.name, r.phase) for r in result.observation.replica_jobs)  # placement: jobs
    for step in result.steps:
        if step.outcome is StepOutcome.OK:
            for node in step.nodes or (step.node,):
                final[node] = step.to_phase
    counts.update(p.value for p in final.values())
    return dict(counts)
