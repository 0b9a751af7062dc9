"""The safety rules every lend must pass, written once for both placements. Pure.

`placement: nodes` lends lend groups (planner.py) and `placement: jobs` lends replica jobs
(jobs.py); both ask these functions, so a rule removed here fails its test in both
placements (tests/unit/test_lend_rules.py):
- the floor: a model keeps `min_serving_replicas` serving whatever the load (all it has, if
  it has fewer);
- the lent cap: at most `policy.max_lent_fraction` of a model's replicas are lent or on their
  way to be (the lifecycle's lent side: RETIRING, LENDING, LENT);
- the evidence: nothing is lent unless the model's load is known and every replica taking
  traffic is seen, healthy, awake and ours; a lend under way on bad evidence stops;
- pins: a pinned replica is never lent, and a lend of it under way stops;
- the budget: at most `policy.max_transitions_per_tick` lends per tick for the whole pool,
  both placements together (plan() hands what the node models left to the jobs models).
An admin's `lend` asks `lend_refusal` (the floor and the lent cap, counted on the observation
by `headcount`), and the fast check `below_floor`, so a floor broken by anyone (an admin's
`--force`, a dead engine) is restored within one fast check, not the next full tick.
Stuck reclaims stop counting as supply by the lifecycle's own timeouts (lifecycle.overdue and
job_overdue), and the need itself is capacity.assess_need's, for both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slurm_idle.config import Config, ModelConfig, PolicyConfig
from slurm_idle.lifecycle import (
    arriving_phases,
    job_arriving_phases,
    job_lent_phases,
    job_overdue,
    lent_phases,
    overdue,
)
from slurm_idle.model import ModelLoad, Observation, Phase, ReplicaLoad
from slurm_idle.policy.service import failing, out_of_service, usable
from slurm_idle.topology import group_views


def floor(model: ModelConfig, total: int) -> int:
    """The fewest replicas of `model` that serve whatever the load: `min_serving_replicas`, or
    every one of its `total` if it has fewer."""
    return min(model.min_serving_replicas, total)


def lent_cap(policy: PolicyConfig, total: int) -> int:
    """The most of a model's `total` replicas that may be lent or on their way to be: the
    fraction rounded down (0.75 of 2 is 1), so the cap is never exceeded by rounding."""
    return int(policy.max_lent_fraction * total + 1e-9)


def may_lend(policy: PolicyConfig, total: int, out: int, more: int) -> bool:
    """Whether `more` replicas may join the `out` already on the lent side (the cap)."""
    return out + more <= lent_cap(policy, total)


def lend_evidence(load: ModelLoad | None,
                  serving: Iterable[tuple[str, ReplicaLoad | None]]) -> tuple[bool, str]:
    """(good enough to lend on, why not): the model's load known and every replica taking
    traffic (`serving`: its name and load) seen, ours, healthy and awake. A replica that is none
    of these serves nothing the metrics can vouch for, and a lend on top of it could leave the
    model short without anyone seeing it."""
    if load is None:
        return False, "no load metrics for the model"
    if not load.known:
        return False, "model load metrics missing or stale"
    replicas = list(serving)
    foreign = [name for name, ld in replicas if ld is not None and ld.foreign]
    if foreign:
        return False, f"serving replica(s) {', '.join(foreign)} not the expected engine (not counted)"
    down = [name for name, ld in replicas
            if failing(ld) and ld is not None and not ld.sleeping]  # asleep: said below
    if down:
        return False, f"serving replica(s) {', '.join(down)} failing their health check (not counted)"
    blind = [name for name, ld in replicas if not usable(ld)]  # unread, stale or not finite
    if blind:
        return False, f"metrics unknown for serving replica(s) {', '.join(blind)}"
    asleep = [name for name, ld in replicas if ld is not None and ld.sleeping]
    if asleep:
        return False, (f"engine asleep on serving replica(s) {', '.join(asleep)} "
                       "(not counted until it wakes)")
    return True, ""


def stop_lend(pinned: bool, known: bool, why_unknown: str) -> str | None:
    """Why a lend under way (RETIRING, or LENDING where it can still come back) must stop and
    the replica serve again, None if it may go on: pinned by an admin, or the evidence gone."""
    if pinned:
        return "pinned: keep serving"
    if not known:
        return f"{why_unknown}: not lending on unknown metrics"
    return None


@dataclass(frozen=True)
class Headcount:
    """A model's replicas as the floor and the lent cap count them on one observation."""

    total: int  # replicas not held by an admin
    serving: int  # in SERVING and in service (a RETIRING one is on its way out)
    lent: int  # on the lent side (RETIRING, LENDING, LENT)
    arriving: int = 0  # on their way back (RECLAIMING, HELD, STARTING), not stuck


def headcount(obs: Observation, config: Config, model: ModelConfig) -> Headcount:
    """`model`'s Headcount: its replica jobs (`placement: jobs`) or its replicas on the lend
    groups (`placement: nodes`; a group an admin drained counts for nothing)."""
    now = obs.now
    if model.placement == "jobs" and model.job is not None:
        mine = [r for r in obs.replica_jobs if r.model == model.name]
        return Headcount(
            model.job.replicas,
            sum(1 for r in mine if r.phase is Phase.SERVING and not out_of_service(r.load)),
            sum(1 for r in mine if r.phase in job_lent_phases()),
            sum(1 for r in mine if r.phase in job_arriving_phases()
                and not job_overdue(r.phase, r.phase_since, config, now)))
    total = serving = lent = arriving = 0
    for g in group_views(obs, config):
        if g.phase is Phase.ADMIN:
            continue
        coming = g.phase in arriving_phases() and not overdue(g.phase, g.phase_since, config, now)
        for r in g.group.replicas:
            if r.model != model.name:
                continue
            total += 1
            serving += g.phase is Phase.SERVING and not out_of_service(g.load(r))
            lent += g.phase in lent_phases()
            arriving += coming
    return Headcount(total, serving, lent, arriving)


@dataclass(frozen=True)
class Refusal:
    """A lend an admin asked for that would break a rule: which (`floor` or
    `max_lent_fraction`) and one line saying how."""

    rule: str
    why: str


def lend_refusal(obs: Observation, config: Config,
                 leaving: Sequence[tuple[str, bool]]) -> Refusal | None:
    """Why lending these replicas now (`leaving`: each one's model and whether it serves)
    would break a model's floor or its max_lent_fraction; None if it would not."""
    for name in dict.fromkeys(m for m, _ in leaving):
        model = config.model(name)
        count = headcount(obs, config, model)
        mine = [serves for m, serves in leaving if m == name]
        left, low = count.serving - sum(mine), floor(model, count.total)
        if left < low:
            return Refusal("floor", f"{name} would have {left} serving replica(s), under its floor "
                                    f"(min_serving_replicas {model.min_serving_replicas})")
        if not may_lend(config.policy, count.total, count.lent, len(mine)):
            return Refusal("max_lent_fraction", (
                f"{name} would have {count.lent + len(mine)} of its {count.total} replicas lent, "
                f"over policy.max_lent_fraction {config.policy.max_lent_fraction:g} "
                f"(at most {lent_cap(config.policy, count.total)})"))
    return None


def below_floor(obs: Observation, config: Config) -> dict[str, str]:
    """model -> why, for every model with fewer replicas serving or on their way back (not
    stuck) than its floor: one already coming back restores it without another reclaim."""
    out: dict[str, str] = {}
    for model in config.models:
        count = headcount(obs, config, model)
        low = floor(model, count.total)
        if count.serving + count.arriving < low:
            out[model.name] = f"{count.serving} serving, under its floor {low}"
    return out
