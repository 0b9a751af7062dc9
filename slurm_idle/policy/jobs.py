"""The planner of `placement: jobs` models: replicas, not nodes, lent and reclaimed. Pure.

Each replica is one Slurm job (replicajobs.py), so the unit of lending is the replica itself
(GPU-granular: half of an 8-GPU node can be lent while the other half serves). The need comes
from the same capacity model as node mode (capacity.assess_need), and the same rules hold:
scale up at once and without limit (abort RETIRING replicas first, then submit LENT ones,
lowest index first); scale down only on known metrics, inside the lending windows, with nothing
on its way back, never below the need over the window or the floor, within max_lent_fraction,
from the pool's one budget of `max_transitions_per_tick` lends a tick (highest index, least busy
first), the same rules as node mode (policy/rules.py: a pin or bad evidence also stops a lend
still RETIRING); carry every other transitional replica one step on. A serving replica out of
service (policy/service.py) is no capacity and nothing is lent meanwhile; one whose endpoint is proved
not its engine (the vLLM inside the job is gone) is repaired: its job is cancelled (SERVING ->
RETIRING -> LENDING -> LENT) and submitted again when the need asks for it. A replica job whose
script waits for a held GPU (HELD) counts as coming back until timeouts.gpu_free_s, then is
handed over (its node to the admin, the job cancelled), and like any replica stuck on its way
back it is no longer counted, so the same tick submits another. With unknown metrics nothing is
lent and what serves or is on its way back is held (or everything comes back with
`policy.reclaim_on_unknown_metrics`); a model with no replica at all starts its floor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slurm_idle.config import Config, ModelConfig
from slurm_idle.lifecycle import (
    job_arriving_phases,
    job_lent_phases,
    job_next_phase,
    job_overdue,
    takes_traffic,
)
from slurm_idle.model import Action, ActionKind, JobReplica, ModelPlan, Observation, Phase
from slurm_idle.policy.capacity import assess_need, default_forecast_lead_s
from slurm_idle.policy.reclaim_order import reclaim_rank
from slurm_idle.policy.rules import floor as floor_of
from slurm_idle.policy.rules import lend_evidence, may_lend, stop_lend
from slurm_idle.policy.service import out_of_service
from slurm_idle.policy.windows import in_windows
from slurm_idle.replicajobs import partition_of


def _arriving(config: Config, mine: list[JobReplica], now: float) -> list[JobReplica]:
    """The replicas on their way back (RECLAIMING, HELD, STARTING) not stuck past their
    phase's timeout: one that never gets there must not hold the model below its need."""
    return [r for r in mine
            if r.phase in job_arriving_phases() and not job_overdue(r.phase, r.phase_since, config, now)]


def _act(kind: ActionKind, r: JobReplica, to: Phase, reason: str) -> Action:
    return Action(kind, r.name, r.model, r.phase, to, reason,
                  {"index": r.index, **({"job_id": r.job_id} if r.job_id is not None else {})})


@dataclass(frozen=True)
class _Verdict:
    """One model's verdict this tick: what supply must reach, what it may go down to (None:
    lend nothing), whether the evidence allows a lend (rules.lend_evidence), and why."""

    needed: int
    down: int | None
    known: bool
    reason: str


def _verdict(obs: Observation, config: Config, model: ModelConfig, mine: list[JobReplica]) -> _Verdict:
    assert model.job is not None
    total = model.job.replicas
    serving = [r for r in mine if takes_traffic(r.phase)]
    taking = [r for r in serving if not out_of_service(r.load)]
    supply = len(taking) + len(_arriving(config, mine, obs.now))
    policy = config.policy
    load = obs.model_load(model.name)
    window_ok = in_windows(obs.now, policy.lending_windows, policy.timezone)
    known, why = lend_evidence(load, ((r.name, r.load) for r in serving))
    if load is None or not load.known:
        if not window_ok or policy.reclaim_on_unknown_metrics:
            return _Verdict(total, None, False, f"{why}: reclaiming everything")
        held = max(floor_of(model, total), min(supply, total))
        return _Verdict(held, None, False, f"{why}: holding {held} (nothing lent on unknown load)")
    loads = [r.load for r in taking if r.load is not None]
    need = assess_need(model, policy, load, loads, len(taking), total,
                       default_forecast_lead_s(config, model.name))
    if not window_ok:
        return _Verdict(total, None, known, f"{need.reason}; outside lending windows")
    if not known:
        return _Verdict(need.up, None, False, f"{need.reason}; {why}: nothing lent")
    return _Verdict(need.up, need.down, True, need.reason)


def _plan_model(obs: Observation, config: Config, model: ModelConfig,
                budget: int) -> tuple[list[Action], ModelPlan]:
    """The model's actions and verdict; at most `budget` lends (the pool's, rules)."""
    assert model.job is not None
    mine = [r for r in obs.replica_jobs if r.model == model.name]
    verdict = _verdict(obs, config, model, mine)
    needed, down, reason = verdict.needed, verdict.down, verdict.reason
    by = {p: [r for r in mine if r.phase is p] for p in Phase}
    live = {p: [r for r in by[p] if not out_of_service(r.load)] for p in (Phase.SERVING, Phase.RETIRING)}
    serving = len(live[Phase.SERVING])
    taking = serving + len(live[Phase.RETIRING])
    supply = serving + len(_arriving(config, mine, obs.now))
    actions: list[Action] = []
    touched: set[str] = set()
    for r in by[Phase.HELD]:
        if job_overdue(r.phase, r.phase_since, config, obs.now):
            actions.append(_act(ActionKind.HAND_OVER, r, Phase.LENDING,
                                f"GPU memory still held after timeouts.gpu_free_s "
                                f"({config.timeouts.gpu_free_s:.0f} s): its node to the admin, "
                                "the replica elsewhere"))
            touched.add(r.name)
    for r in by[Phase.SERVING]:
        if r.load is not None and r.load.foreign:
            # Its vLLM is gone (nothing listens) or another server holds the port, while the job
            # runs on: cancelled through the lend's edges, so its GPUs are freed and the
            # replica is submitted afresh (maybe elsewhere) when the need asks for it.
            actions.append(_act(ActionKind.REPAIR, r, Phase.RETIRING,
                                f"engine of serving replica {r.name} gone or not ours: "
                                f"cancelling job {r.job_id}, submitted again when needed"))
            touched.add(r.name)
    # A lend under way stops while its job can still serve (RETIRING and in service; a LENDING
    # job is being cancelled, and one out of service is being repaired or has nothing to serve
    # with) when the replica is pinned or the evidence is not good enough to lend on.
    for r in live[Phase.RETIRING]:
        why = stop_lend(r.pinned, verdict.known, reason)
        if why:
            actions.append(_act(ActionKind.ABORT_LEND, r, Phase.SERVING, why))
            touched.add(r.name)
            supply += 1
    deficit = needed - supply
    if deficit > 0:
        why = f"{reason}; {supply} serving or coming back: needs {needed}"
        candidates = ([(ActionKind.ABORT_LEND, r, Phase.SERVING)
                       for r in live[Phase.RETIRING] if r.name not in touched]
                      + [(ActionKind.RECLAIM, r, Phase.RECLAIMING) for r in by[Phase.LENT]])
        taken: dict[str, int] = {}
        for kind, r, to in candidates[:deficit]:
            action = _act(kind, r, to, why)
            if kind is ActionKind.RECLAIM:
                node = steer(obs, config, model, taken)
                if node is not None:
                    action.details["nodelist"] = node
                    action = replace(action, reason=f"{why}; steered to {node} (no free GPUs: "
                                                    "its idle jobs lose the least work)")
            actions.append(action)
            touched.add(r.name)
    elif (down is not None and not any(by[p] for p in job_arriving_phases())
          and serving > down):
        spare = sorted((r for r in live[Phase.SERVING]
                        if stop_lend(r.pinned, verdict.known, reason) is None and r.name not in touched),
                       key=lambda r: (r.load.running if r.load else 0.0, -r.index))
        after = {r.name: r.phase for r in mine} | {a.node: a.to_phase for a in actions}
        out = sum(1 for p in after.values() if p in job_lent_phases())
        lends = spare[:min(budget, serving - down)]
        while lends and not may_lend(config.policy, model.job.replicas, out, len(lends)):
            lends.pop()
        for r in lends:
            actions.append(_act(ActionKind.LEND, r, Phase.RETIRING,
                                f"{reason}; {serving} serving, needs {down} over the window: lending"))
            touched.add(r.name)
    for r in mine:
        nxt = job_next_phase(r.phase)
        if r.name not in touched and nxt is not None:
            why = f"carry on {r.phase.value} -> {nxt.value}"
            if r.phase is Phase.RECLAIMING and r.state_reason:
                why += f" (job {r.job_id} PENDING: {r.state_reason})"
            actions.append(_act(ActionKind.CONTINUE, r, nxt, why))
    return actions, ModelPlan(model.name, needed, taking, reason)


def steer(obs: Observation, config: Config, model: ModelConfig, taken: dict[str, int]) -> str | None:
    """Where a replica job being submitted should go (`--nodelist`), None to let Slurm choose.

    Slurm places a job on free GPUs before it preempts anything, so while some node of the
    partition has the GPUs free no steering is needed. Otherwise the node whose idle jobs would
    lose the least work (reclaim_order.reclaim_rank, node placement's rule) among those whose
    free and preemptible GPUs cover the replica; `taken` (node -> GPUs) counts this tick's
    earlier choices. Single-node replicas only (a multi-node one is left to Slurm).
    """
    assert model.job is not None
    if model.job.nodes_per_replica != 1 or not obs.placement_nodes:
        return None
    need = model.job_gpus_per_replica
    part = partition_of(config, model)
    usable = [v for v in obs.placement_nodes
              if part in v.node.partitions and not v.node.drained and not v.node.down]
    free = {v.name: v.node.gpus_total - v.node.gpus_used - taken.get(v.name, 0) for v in usable}
    if any(f >= need for f in free.values()):
        return None
    fits = [v for v in usable if free[v.name] + sum(j.gpus for j in v.jobs) >= need]
    if not fits:
        return None
    ckpt, young = config.report.checkpoint_interval_s, config.policy.min_job_runtime_s
    best = min(fits, key=lambda v: reclaim_rank(v, obs.now, ckpt, young))
    taken[best.name] = taken.get(best.name, 0) + need
    return best.name


def _jobs_models(config: Config) -> list[ModelConfig]:
    return [m for m in config.models if m.placement == "jobs" and m.job is not None]


def plan_jobs(observation: Observation, config: Config, now: float,
              budget: int | None = None) -> list[Action]:
    """The actions on replica jobs this tick, in model then replica order. `budget`: the lends
    the pool has left this tick (plan() passes what the node models left; default the whole
    `policy.max_transitions_per_tick`), shared by every jobs model."""
    left = config.policy.max_transitions_per_tick if budget is None else budget
    actions: list[Action] = []
    for m in _jobs_models(config):
        mine = _plan_model(observation, config, m, left)[0]
        left -= sum(1 for a in mine if a.kind is ActionKind.LEND)
        actions.extend(mine)
    return actions


def assess_jobs(observation: Observation, config: Config, now: float) -> list[ModelPlan]:
    """Per jobs-placement model: replicas needed now, replicas taking traffic, and why."""
    budget = config.policy.max_transitions_per_tick
    return [_plan_model(observation, config, m, budget)[1] for m in _jobs_models(config)]
