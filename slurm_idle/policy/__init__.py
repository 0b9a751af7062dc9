"""The planner: how many replicas each model needs, and which nodes to lend or reclaim. Pure.

`plan(observation, config, now)` returns this tick's actions; `assess(...)` the per-model
verdict that `status` and the agent's metrics show. No I/O, no clock, no randomness: the same
inputs always give the same answer, so every rule is unit-tested and the simulator replays
weeks of traffic through this very code.
"""

from slurm_idle.policy.capacity import (
    Need,
    assess_need,
    default_forecast_lead_s,
    demand_tokens_per_s,
    forecast_demand,
    replicas_for,
)
from slurm_idle.policy.fast import fast_plan
from slurm_idle.policy.planner import apply_actions, assess, plan
from slurm_idle.policy.windows import in_windows, parse_window

__all__ = [
    "Need",
    "apply_actions",
    "assess",
    "assess_need",
    "default_forecast_lead_s",
    "demand_tokens_per_s",
    "fast_plan",
    "forecast_demand",
    "in_windows",
    "parse_window",
    "plan",
    "replicas_for",
]

