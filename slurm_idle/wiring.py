"""Build the real Agent from a Config: the one place that picks adapters.

Kept apart from the CLI so that scripts (demo, benchmarks) and tests build agents the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING, Any

from slurm_idle.agent import Agent, TickResult
from slurm_idle.config import Config
from slurm_idle.handover import HeldEntry, WakeFailedEntry, parse_reason, parse_wake_failed
from slurm_idle.journal import StepOutcome
from slurm_idle.lifecycle import takes_traffic
from slurm_idle.model import GroupView, Phase

if TYPE_CHECKING:  # the adapters are imported where they are built
    from slurm_idle.engine import Engine
    from slurm_idle.metrics import MetricsSource
    from slurm_idle.metrics.gpus import GpuSource
    from slurm_idle.router.sync import RouterSet


def make_metrics_source(config: Config, read_only: bool = False) -> MetricsSource:
    """Prometheus (one vector query per signal per tick) or direct /metrics scrapes."""
    from slurm_idle import metrics

    return metrics.make_source(config, read_only=read_only)


def make_gpu_source(config: Config) -> GpuSource | None:
    """The GPU exporter's series through Prometheus; None with `metrics.source: scrape` (the
    GPUs' memory is read from Prometheus only: no node's GPUs are observed)."""
    if config.metrics.source != "prometheus":
        return None
    from slurm_idle.metrics.gpus import PrometheusGpuSource

    return PrometheusGpuSource(config)


def build_agent(config: Config, with_textfile: bool = True, read_only: bool = False) -> Agent:
    """An Agent on the real Slurm backend, engines, metrics and planner named in `config`.

    `read_only`: for commands that only look (`status`, `tick --dry-run`): the metrics source
    writes no state (the scrape state file belongs to ticks, which hold the lock).
    """
    import time

    from slurm_idle import policy
    from slurm_idle.engine import IdentityStore, identity_dir, make_engine
    from slurm_idle.replicatrust import trust_for
    from slurm_idle.slurm import make_backend

    # The replicas' secret served names, beside the journal (root-only): one store for every
    # model's engine, so an admin command and a tick agree on each replica's name.
    identities = IdentityStore(identity_dir(config.paths.journal))

    @cache
    def engine_for(model: str) -> Engine:
        return make_engine(config.engine_for(model), model, identities=identities)

    on_tick = None
    if with_textfile and config.paths.textfile:
        on_tick = _textfile_writer(config)
    agent = Agent(
        config=config,
        slurm=make_backend(config),
        metrics=make_metrics_source(config, read_only=read_only),
        engine_for=engine_for,
        planner=policy.plan,
        assessor=policy.assess,
        on_tick=on_tick,
        # A look-only command makes no key; one that cannot read it checks users alone.
        trust=trust_for(config, create=not read_only, now=time.time()),
        gpus=make_gpu_source(config),
    )
    agent.router = make_router_set(config, agent)
    return agent


def make_router_set(config: Config, agent: Agent) -> RouterSet | None:
    """The pool's routers (issue 14), journaling into the agent's journal; None with `none`."""
    from slurm_idle.router.sync import RouterSet

    journal = agent.journal
    assert journal is not None
    routers = RouterSet(config, journal=journal.record)
    return routers if routers.active else None


def _textfile_writer(config: Config) -> Callable[[TickResult], None]:
    from slurm_idle.agent import phase_counts
    from slurm_idle.agent_metrics import set_lock_blocked, write_textfile

    def write(result: TickResult) -> None:
        _write(result)
        if result.instance is not None:  # under a lease: who leads, also from a standby
            from slurm_idle.agent_metrics import set_leadership

            assert config.paths.textfile is not None
            age = result.leader["age_s"] if result.leader else None
            set_leadership(config.paths.textfile, result.instance, bool(result.leads), age,
                           now=result.started)

    def _write(result: TickResult) -> None:
        assert config.paths.textfile is not None
        if result.standby is not None:  # observed nothing: the other gauges stay as they were
            return
        if result.lock_holder is not None:  # locked out by a stranger: only that gauge
            holder = result.lock_holder
            set_lock_blocked(config.paths.textfile, holder.held_s or 0.0, holder.pid,
                             holder.command)
            return
        write_textfile(
            config.paths.textfile,
            phases=phase_counts(result) if result.observation is not None else None,
            needed={p.model: p.needed_replicas for p in result.plans},
            serving=serving_after(result, config),
            tick_duration_s=result.duration_s,
            tick_ts=result.started,
            transitions=[
                (s.from_phase.value, s.to_phase.value) for s in result.steps if s.outcome is StepOutcome.OK
            ],
            tick_error=result.errors > 0,
            floors={m.name: m.min_serving_replicas for m in config.models},
            metrics_source=(result.observation.metrics_source or None)
            if result.observation is not None else None,
            router_errors=result.router_errors,
            gpu_held=gpus_handed_over(result, config),
            wake_failed=wakes_handed_over(result, config),
            **group_counts(result, config),
        )

    return write


def gpus_handed_over(result: TickResult, config: Config) -> list[HeldEntry]:
    """The GPUs named in the hand-over Reasons of the observed nodes (handover.py): the
    pool's, and those `placement: jobs` replicas run on."""
    obs = result.observation
    if obs is None:
        return []
    tag = config.slurm.tag
    views = {v.name: v for v in (*obs.nodes, *obs.placement_nodes)}  # a node may be in both
    return [entry for v in views.values()
            for entry in parse_reason(tag, v.name, v.node.reason.strip()) or ()]


def wakes_handed_over(result: TickResult, config: Config) -> list[WakeFailedEntry]:
    """The replicas named in the wake-failed Reasons of the observed pool nodes (handover.py)."""
    if result.observation is None:
        return []
    tag = config.slurm.tag
    return [entry for v in result.observation.nodes
            if (entry := parse_wake_failed(tag, v.name, v.node.reason.strip())) is not None]


def _final_groups(result: TickResult, config: Config) -> list[tuple[GroupView, Phase, bool]]:
    """(group view, phase after the tick's steps, moved by a step) of every lend group."""
    from slurm_idle.topology import group_views

    assert result.observation is not None
    final = {s.node: s.to_phase for s in result.steps if s.outcome is StepOutcome.OK}
    return [(g, final.get(g.name, g.phase), g.name in final)
            for g in group_views(result.observation, config)]


def group_counts(result: TickResult, config: Config) -> dict[str, Any]:
    """`replicas` ((model, phase) -> n) and `groups` (phase -> n) after the tick's steps, every
    phase present (0 when none); empty without an observation."""
    if result.observation is None:
        return {}
    replicas = {(m.name, p.value): 0 for m in config.models for p in Phase}
    groups = {p.value: 0 for p in Phase}
    for g, phase, _ in _final_groups(result, config):
        groups[phase.value] += 1
        for r in g.group.replicas:
            replicas[(r.model, phase.value)] = replicas.get((r.model, phase.value), 0) + 1
    final = {s.node: s.to_phase for s in result.steps if s.outcome == "ok"}
    for j in result.observation.replica_jobs:  # `placement: jobs`: no lend group
        key = (j.model, final.get(j.name, j.phase).value)
        replicas[key] = replicas.get(key, 0) + 1
    return {"replicas": replicas, "groups": groups}


def serving_after(result: TickResult, config: Config | None = None) -> dict[str, int]:
    """Replicas taking traffic per model after the tick's steps, as `slurm_idle_nodes` counts
    phases: the plans' own count predates the actions, so a reclaim that finished this tick
    (or a lend that began) would show one tick late. A replica whose engine reported sleeping
    at the observation and that no step moved is not counted (the planner's rule; a step into
    serving has just started or woken it). Models of the plans with no serving node read 0.
    Without an observation, the plans' counts are all there is.
    """
    if result.observation is None:
        return {p.model: p.serving_replicas for p in result.plans}
    if config is not None:  # per replica, on lend groups
        counts = {p.model: 0 for p in result.plans}
        for g, phase, moved in _final_groups(result, config):
            for r in g.group.replicas:
                load = g.load(r)
                asleep = not moved and load is not None and load.sleeping
                if takes_traffic(phase) and not asleep:
                    counts[r.model] = counts.get(r.model, 0) + 1
        final_jobs = {s.node: s.to_phase for s in result.steps if s.outcome == "ok"}
        for j in result.observation.replica_jobs:  # `placement: jobs`
            if takes_traffic(final_jobs.get(j.name, j.phase)):
                counts[j.model] = counts.get(j.model, 0) + 1
        return counts
    final = {s.node: s.to_phase for s in result.steps if s.outcome is StepOutcome.OK}
    counts = {p.model: 0 for p in result.plans}
    for view in result.observation.nodes:
        moved = view.name in final
        asleep = not moved and view.replica is not None and (
            view.replica.sleeping or view.replica.foreign)
        if takes_traffic(final.get(view.name, view.phase)) and not asleep:
            counts[view.model] = counts.get(view.model, 0) + 1
    return counts


def under_lease(agent: Agent, instance: str | None = None) -> Agent:
    """The agent acting only while it holds the leadership lease (ha.enabled; leadership.py),
    or itself unchanged when ha is off. `instance` names it (default: the short host name)."""
    import socket

    from slurm_idle.leadership import Leadership, SlurmLeaseStore

    config = agent.config
    if not config.ha.enabled:
        return agent
    host = socket.gethostname().split(".")[0]
    store = SlurmLeaseStore(agent.slurm,  # type: ignore[arg-type]  # the backend, unfenced
                            config.ha.partition or config.slurm.lend_partition)
    leadership = Leadership(store, instance or host, host, lease_s=config.ha.lease_s,
                            settle_s=config.ha.settle_s,
                            on_gain=lambda: forget_identities(config))
    return replace(agent, leadership=leadership)


def forget_identities(config: Config) -> None:
    """On taking the lead: the engines' secret names this host issued when it last led are
    stale if another leader restarted engines since (engine/identity.py), and a stale name
    would make a serving replica look foreign and be restarted. Forgotten, a replica is
    checked by its model name until this leader starts its engine with a new one."""
    from slurm_idle.engine import identity_dir

    directory = identity_dir(config.paths.journal)
    try:
        names = list(directory.iterdir())
    except OSError:
        return
    for path in names:
        path.unlink(missing_ok=True)
