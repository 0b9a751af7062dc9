"""Trace-driven simulator: how much idle GPU time a policy harvests, and at what risk.

`simulate(trace, fleet, params, policy)` replays a per-minute load trace on a simulated fleet
under `slurm-idle` (the real planner), `reactive`, `night-window` or `oracle`, and scores the
run (harvested vs. oracle GPU-hours, SLO-violation minutes, preemptions, lost work).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from slurm_idle.config import Config, PolicyConfig
from slurm_idle.errors import ConfigError
from slurm_idle.sim.baselines import NightWindow, Oracle, Reactive
from slurm_idle.sim.engine import FleetModel, SimParams, SimPolicy, SimResult, Simulation
from slurm_idle.sim.planner_driver import SIM_POLICY, PlannerPolicy, fleet_config, sim_policy
from slurm_idle.traces import Trace

__all__ = [
    "POLICIES",
    "SIM_POLICY",
    "FleetModel",
    "SimParams",
    "SimResult",
    "Simulation",
    "fleet_from_config",
    "parse_fleet",
    "sim_policy",
    "simulate",
]

POLICIES = ("slurm-idle", "reactive", "night-window", "oracle")

_FLEET = re.compile(
    r"^(?P<model>[^=]+)=(?P<replicas>\d+):(?P<gpus>\d+):(?P<tps>\d+(?:\.\d*)?)(?::(?P<per>\d+))?$"
)


def parse_fleet(spec: str, placement: str = "nodes") -> FleetModel:
    """`MODEL=REPLICAS:GPUS_PER_REPLICA:TOKENS_PER_S[:PER_NODE]`, e.g. `llama-70b=16:4:2500`, or
    `llama-70b=16:4:2500:2` for two replicas per (8-GPU) node. `placement` jobs: replica jobs
    (GPU-granular: no PER_NODE)."""
    match = _FLEET.match(spec.strip())
    if not match:
        raise ConfigError(
            f"--fleet {spec!r} is not MODEL=REPLICAS:GPUS_PER_REPLICA:TOKENS_PER_S[:PER_NODE] "
            "(e.g. llama=16:4:2500)"
        )
    fleet = FleetModel(
        match["model"].strip(), int(match["replicas"]), int(match["gpus"]), float(match["tps"]),
        int(match["per"] or 1), placement,
    )
    if placement == "jobs" and fleet.per_node != 1:
        raise ConfigError(f"--fleet {spec!r}: placement jobs lends each replica on its own "
                          "(no PER_NODE)")
    if fleet.replicas < 1 or fleet.gpus_per_replica < 1 or fleet.tokens_per_s <= 0 or fleet.per_node < 1:
        raise ConfigError(f"--fleet {spec!r}: replicas, GPUs, tokens/s and per-node must be positive")
    if fleet.replicas % fleet.per_node:
        raise ConfigError(f"--fleet {spec!r}: {fleet.replicas} replicas do not fill nodes of "
                          f"{fleet.per_node}")
    return fleet


def fleet_from_config(config: Config) -> list[FleetModel]:
    """The pool of a slurm-idle config as a simulated fleet: replicas per node from its lend
    groups (a model whose groups differ in size is simulated with the most common one)."""
    from collections import Counter

    from slurm_idle.topology import lend_groups

    sizes: dict[str, Counter[int]] = {}
    for g in lend_groups(config):
        for model in g.models():
            sizes.setdefault(model, Counter())[sum(1 for r in g.replicas if r.model == model)] += 1
    out = []
    for m in config.models:
        if m.placement == "jobs" and m.job is not None:  # each replica job its own lend unit
            out.append(FleetModel(m.name, m.job.replicas, m.job_gpus_per_replica,
                                  m.tokens_per_s_per_replica, 1, "jobs"))
            continue
        if not m.replicas:
            continue
        per_node = sizes[m.name].most_common(1)[0][0] if m.name in sizes else 1
        replicas = len(m.replicas) - len(m.replicas) % per_node
        out.append(FleetModel(m.name, replicas, m.gpus_per_replica, m.tokens_per_s_per_replica,
                              per_node))
    return out


def simulate(
    trace: Trace,
    fleet: Sequence[FleetModel],
    params: SimParams | None = None,
    policy: str = "slurm-idle",
    policy_config: PolicyConfig | None = None,
    night_lend: int | None = None,
) -> SimResult:
    """Run one policy over the trace and score it. The slurm-idle policy plans with
    `policy_config` (a site's knobs), else with SIM_POLICY fitted to the demand model."""
    if not fleet:
        raise ConfigError("no fleet: give --fleet MODEL=REPLICAS:GPUS_PER_REPLICA:TOKENS_PER_S or --config")
    params = params or SimParams()
    sim = Simulation(trace, fleet, params)
    knobs = policy_config or sim_policy(params)
    chosen: SimPolicy
    if policy == "slurm-idle":
        chosen = PlannerPolicy(sim, fleet_config(fleet, params, knobs))
    elif policy == "reactive":
        chosen = Reactive()
    elif policy == "night-window":
        chosen = NightWindow(lend=night_lend, timezone=knobs.timezone)
    elif policy == "oracle":
        chosen = Oracle()
    else:
        raise ConfigError(f"unknown policy {policy!r} (one of: {', '.join(POLICIES)})")
    return sim.run(chosen)
