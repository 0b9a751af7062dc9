"""The fast check of `slurm-idle agent`: between full ticks, start only the reclaims that
pressure asks for. Pure.

A full tick runs every policy.tick_interval_s; a queue building just after it would wait for
the next one. The fast check runs every policy.fast_interval_s on the same observation and
planner, and keeps only the scale-up actions (abort a lend, reclaim) of models whose serving
replicas show pressure now (a sustained queue, a hot KV cache, TTFT over its SLO, or a
serving replica gone out of service: failing the probe the fast check's observe makes, asleep
or not ours, so it is replaced within one fast check; or fewer replicas serving than the
model's floor, whoever lent them: rules.below_floor): never a lend, nothing on a trend or a
forecast alone (those wait for the full tick, which sees the same numbers a few seconds later).
A repair of a dead engine waits for the full tick too: the replacement is what cannot wait.
It also carries on reclaims under way (RECLAIMING, HELD, STARTING), so a replica serves as
soon as its engine is healthy; lends wait for the tick.
"""

from __future__ import annotations

from slurm_idle.config import Config
from slurm_idle.lifecycle import arriving_phases
from slurm_idle.model import Action, ActionKind, Observation, Phase
from slurm_idle.policy.capacity import pressure_now
from slurm_idle.policy.planner import plan
from slurm_idle.policy.rules import below_floor
from slurm_idle.policy.service import out_of_service

#: The actions a fast check may start: the scale-up edges.
SCALE_UP = frozenset({ActionKind.RECLAIM, ActionKind.ABORT_LEND})


def under_pressure(observation: Observation, config: Config) -> dict[str, list[str]]:
    """model -> its pressure signals, for models with known load and at least one signal, or
    with a serving replica out of service, or fewer serving than its floor (an admin's forced
    lend; whatever its load: the capacity is gone now)."""
    out: dict[str, list[str]] = {}
    for load in observation.models:
        if load.known:
            signals = pressure_now(load, config.policy)
            if signals:
                out[load.model] = signals
    for model, name in out_of_service_replicas(observation):
        out.setdefault(model, []).append(f"replica {name} not serving")
    for model, why in below_floor(observation, config).items():
        out.setdefault(model, []).append(why)
    return out


def out_of_service_replicas(observation: Observation) -> list[tuple[str, str]]:
    """(model, replica name) of every SERVING replica out of service, both placements."""
    out = [(ld.model, ld.name or v.name) for v in observation.nodes if v.phase is Phase.SERVING
           for ld in v.loads() if out_of_service(ld)]
    out += [(r.model, r.name) for r in observation.replica_jobs
            if r.phase is Phase.SERVING and out_of_service(r.load)]
    return out


def fast_plan(observation: Observation, config: Config, now: float) -> list[Action]:
    """plan()'s scale-up actions of the models under pressure, and the carry-on of reclaims
    already under way (a replica whose engine is healthy serves now, not at the next tick);
    never a lend, never a carry-on of a lend."""
    hot = under_pressure(observation, config)
    return [
        a for a in plan(observation, config, now)
        if (a.kind in SCALE_UP and a.model in hot)
        or (a.kind is ActionKind.CONTINUE and a.from_phase in arriving_phases())
    ]
