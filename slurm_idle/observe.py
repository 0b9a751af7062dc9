"""Observe: the tick's passive "sync from the world", one frozen snapshot of the pool.

One `sinfo`/`scontrol show node` and one `squeue` call, one batch of metrics queries, one GPU
memory query and one probe of each serving replica, both placements (identity, /health, and
the sleep state where the engine sleeps; in parallel, within a share of the observe budget),
whatever the fleet size. Phases come from Slurm first, so that only replicas we know are ours,
live and serving count.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TYPE_CHECKING

from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.jobdriver import probe_config
from slurm_idle.lifecycle import PhaseInfo, derive_phase, takes_traffic
from slurm_idle.logs import get_logger
from slurm_idle.metrics.serving import loads_by_replica, serving_model_load
from slurm_idle.model import (
    GpuReading,
    ModelLoad,
    NodeView,
    Observation,
    Phase,
    ReplicaLoad,
    SlurmJob,
    SlurmNode,
)
from slurm_idle.replicajobs import foreign_replica_jobs, placement_nodes_of, replica_views
from slurm_idle.replicatrust import ReplicaTrust, agent_user
from slurm_idle.slurm.protocol import ClusterReader
from slurm_idle.transitions import ACTIVE_JOB_STATES

if TYPE_CHECKING:  # imported where used: a tick that needs no engine loads none
    from slurm_idle.engine import EngineHealth
    from slurm_idle.metrics import MetricsSource
    from slurm_idle.metrics.gpus import GpuSource

log = get_logger(__name__)

#: Probes in flight at once (threads that mostly wait on HTTP), as many as the nodes a tick
#: acts on at once (agent.MAX_ACTION_WORKERS).
MAX_PROBES = 32
#: Share of what is left of the observe budget the probes may take: the metrics queries after
#: them keep the rest, so hung engines cannot leave the tick without its load figures.
PROBE_SHARE = 0.5

#: model name, replica -> its engine's probe now (engine.Engine.check).
Probe = Callable[[str, ReplicaConfig], "EngineHealth"]


def observe(
    config: Config,
    slurm: ClusterReader,
    metrics: MetricsSource,
    now: float,
    *,
    probe: Probe | None = None,
    budget_s: float | None = None,
    trust: ReplicaTrust | None = None,
    gpus: GpuSource | None = None,
) -> Observation:
    """Build one frozen snapshot of the pool from Slurm and the engines' metrics.

    Phases come first (from Slurm), so that only the replicas we know are ours and serving
    count: each serving-phase replica, node or job, is probed every tick (`probe`: the expected
    engine, /health 200, awake where the engine sleeps) and its load says so (`healthy`,
    `foreign`); each model's present demand is summed over the replicas proved ours alone
    (metrics.serving), never over a lent node's port. `budget_s` bounds the metrics calls and
    probes together (each HTTP call has a total deadline within it). `gpus` fills each pool
    node's and each `placement: jobs` node's `NodeView.gpus` in one call; without it, or when it
    fails (an error of the snapshot, never of the tick), they stay None: not observed.

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
        # Only jobs the agent can prove its own (replicatrust.py); without `trust` (no key at
        # hand) the jobs of the user we run as.
        trust = trust if trust is not None else ReplicaTrust(agent_user())
        replica_jobs = replica_views(config, jobs, trust)
        foreign_jobs = tuple(foreign_replica_jobs(config, jobs, trust))
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
        targets = [*serving, *((r.model, probe_config(r)) for r in job_serving)]
        checked: dict[str, EngineHealth] = {}  # replica name -> its probe, when it answered
        if probe is not None and targets:
            budget = left()
            checked = probe_replicas(probe, targets, None if budget is None else budget * PROBE_SHARE)
        foreign = {name: h.foreign or "" for name, h in checked.items() if h.foreign_proven}
        for name, health in sorted(checked.items()):
            trouble = not_serving_why(health)
            if trouble is not None:
                errors.append(f"{name}: {trouble}: not counted as serving")
        # Per replica, never per node: two replicas on one node (or one spanning nodes) are
        # counted, or not, each on its own; a foreign one never takes its neighbour with it.
        counted = {r.name for _, r in serving if r.name not in foreign}
        jobs_counted = {r.name for r in job_serving if r.name not in foreign}
        found: list[ReplicaLoad] = []
        model_loads: tuple[ModelLoad, ...]
        try:
            probes = [(r.model, probe_config(r)) for r in placed]
            found = list(metrics.replica_loads([*replicas, *probes], budget_s=left(),
                                               serving=counted | jobs_counted))
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
            if replica.name in checked:
                of_replica[replica.name] = probed(of_replica.get(replica.name), checked[replica.name],
                                                  model_name, replica.node, replica.url)
        job_loads = {r.name: probed(by_url.get(r.url), checked[r.name], r.model, r.nodes[0], r.url)
                     if r.name in checked else by_url.get(r.url) for r in placed}
        counted_of: dict[str, list[ReplicaLoad | None]] = {}
        for model_name, replica in replicas:
            if replica.name in counted:
                counted_of.setdefault(model_name, []).append(of_replica.get(replica.name))
        for r in job_serving:
            if r.name in jobs_counted:
                counted_of.setdefault(r.model, []).append(job_loads[r.name])
        replica_jobs = tuple(replace(r, load=job_loads.get(r.name)) if r.url else r
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
        placement = placement_nodes_of(config, nodes.values()) if replica_jobs else []
        readings: dict[str, tuple[GpuReading, ...]] = {}
        if gpus is not None:  # one call for every node an engine may wake or start on
            asked = [n for n in model_of if n not in missing] + [n.name for n in placement]
            budget = left()
            readings = gpu_readings(gpus, list(dict.fromkeys(asked)),
                                config.metrics.query_timeout_s if budget is None else budget, errors)
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
                    gpus=readings.get(name),
                )
            )
        if missing:  # one line per tick, however many: a typo'd range must not flood the log
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            errors.append(
                f"{len(missing)} pool node(s) not known to Slurm, left out: {shown} (check the config)"
            )
        placement_nodes = _placement_nodes(config, placement, jobs, readings)
        for r in replica_jobs:
            if r.duplicates:
                errors.append(f"{r.name}: duplicate replica job(s) {', '.join(map(str, r.duplicates))} "
                              f"beside job {r.job_id}: the extra ones are cancelled")
        return Observation(now=now, nodes=tuple(views), models=model_loads, errors=tuple(errors),
                           metrics_source=str(getattr(metrics, "source", "")),
                           replica_jobs=replica_jobs, placement_nodes=placement_nodes,
                           foreign_replica_jobs=foreign_jobs)
    finally:
        if collecting:
            gc.enable()


def gpu_readings(gpus: GpuSource, nodes: Sequence[str], budget_s: float,
                 errors: list[str]) -> dict[str, tuple[GpuReading, ...]]:
    """node -> its GPU readings; {} with one line in `errors` when the source cannot answer."""
    try:
        return gpus.readings(nodes, budget_s=budget_s)
    except MetricsUnavailable as exc:
        errors.append(f"GPU memory unavailable (no node's GPUs observed): {exc}")
        return {}


def _placement_nodes(config: Config, nodes: Sequence[SlurmNode], jobs: Sequence[SlurmJob],
                     gpus: dict[str, tuple[GpuReading, ...]]) -> tuple[NodeView, ...]:
    """The nodes replica jobs may run on (placement_nodes_of), each with its active jobs of
    the lend partition (what a replica job would preempt there) and its GPU readings."""
    lend = config.slurm.lend_partition
    on: dict[str, list[SlurmJob]] = {}
    for job in jobs:
        if job.state in ACTIVE_JOB_STATES and lend in job.partition.split(","):
            for name in job.nodes:
                on.setdefault(name, []).append(job)
    return tuple(NodeView(node=n, model="", phase=Phase.UNKNOWN, jobs=tuple(on.get(n.name, ())),
                          gpus=gpus.get(n.name))
                 for n in nodes)


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


def probe_replicas(
    probe: Probe, targets: Sequence[tuple[str, ReplicaConfig]], budget_s: float | None
) -> dict[str, EngineHealth]:
    """replica name -> its probe, for the serving replicas whose probe answered within
    `budget_s` (in parallel). One that did not, or raised, tells nothing: its load stays
    unchecked (`healthy` None) and its metrics decide, as before the probe."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(targets), MAX_PROBES)))
    try:
        futures = {pool.submit(probe, m, r): r.name for m, r in targets}
        done, _ = wait(futures, timeout=budget_s)
        checked = {}
        for future in done:
            try:
                checked[futures[future]] = future.result()
            except Exception as exc:  # noqa: BLE001 - a probe bug tells nothing either way
                log.warning("%s: probe failed: %s", futures[future], exc)
        return checked
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def not_serving_why(health: EngineHealth) -> str | None:
    """Why a probed serving replica does not count, for the tick's errors; None when it does
    or when it only sleeps (the planner says that itself)."""
    if health.foreign_proven:
        return f"its endpoint is not the expected engine ({health.foreign})"
    if not health.up:
        return f"engine failing its health check ({health.error or '/health did not answer'})"
    if not health.live and health.awake is None:
        return "engine's sleep state unknown (neither /is_sleeping nor the sleep gauge told)"
    return None


def probed(load: ReplicaLoad | None, health: EngineHealth, model: str, node: str,
           url: str) -> ReplicaLoad:
    """A serving replica's load as its probe found it: `healthy` when live (a failing one gets
    a load even without series, so that it is never counted), asleep when it said so, and
    one proven not ours keeps no metrics: they are not a replica of ours."""
    if health.foreign_proven:
        return ReplicaLoad(model=model, node=node, url=url, known=False, foreign=True, healthy=False)
    base = load if load is not None else ReplicaLoad(model=model, node=node, url=url, known=False)
    return replace(base, healthy=health.live, sleeping=base.sleeping or health.awake is False)


def log_observation(obs: Observation) -> None:
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
