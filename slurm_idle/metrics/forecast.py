"""The forecast fields of a ModelLoad, computed as the simulator computes them. Pure.

`policy.forecast_demand` does the arithmetic; this module only decides what goes into it, the
same way `slurm_idle/sim/planner_driver.py` does for the benchmarks: per model, its own lead
(`policy.default_forecast_lead_s`, rounded up to whole seconds as the simulator rounds to whole
minutes), history pairs per offset (demand then, its peak over the lead after that; both as
the demand's scale-down-window means centred on each moment), the trend
of the demand over the scale-down window (a least-squares slope, Prometheus `deriv`), and for
`forecast_demand_tokens_per_s_max_window` the same over lead + scale-down window. Both metrics
sources call this, so Prometheus, the direct scrape and the simulator cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slurm_idle.config import Config, ModelConfig
from slurm_idle.policy.capacity import default_forecast_lead_s, forecast_demand


def forecast_leads(config: Config, models: Sequence[ModelConfig]) -> dict[str, int]:
    """model -> how far ahead its forecast looks, whole seconds (rounded up, at least 1)."""
    return {m.name: max(1, math.ceil(default_forecast_lead_s(config, m.name))) for m in models}


@dataclass(frozen=True)
class Peak:
    """One offset's history (e.g. 1 day ago): demand then, and its peaks after then over the
    lead (`ahead`) and over lead + scale-down window (`later`); None where there is no data."""

    then: float
    ahead: float | None
    later: float | None


def forecasts(
    demand_now: float,
    peaks: Iterable[Peak],
    trend_per_s: float | None,
    lead_s: float,
    window_s: float,
) -> tuple[float | None, float | None]:
    """(forecast over the lead, forecast over lead + scale-down window); None without evidence.

    A peak over the longer reach is never taken below the one over the lead (in Prometheus the
    two subqueries sample at different steps), so the second never undercuts the first. With no
    scale-down window both are the same number.
    """
    history: list[tuple[float, float]] = []
    history_later: list[tuple[float, float]] = []
    for p in peaks:
        if p.ahead is not None:
            history.append((p.then, p.ahead))
        reach = p.ahead if p.later is None else p.later if p.ahead is None else max(p.ahead, p.later)
        if reach is not None:
            history_later.append((p.then, reach))
    forecast = forecast_demand(demand_now, history, trend_per_s, lead_s)
    if window_s <= 0:
        return forecast, forecast
    return forecast, forecast_demand(demand_now, history_later, trend_per_s, lead_s + window_s)


def slope_per_s(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t, value) points per second, as Prometheus `deriv`; None with
    fewer than two distinct times."""
    n = len(points)
    if n < 2:
        return None
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    den = sum((t - mean_t) ** 2 for t, _ in points)
    if den == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / den


#: The demand's variability is measured on its changes over NOISE_LAG_S, over the last
#: NOISE_SPAN_S: a lag of 10 minutes sees rates held in 10-minute steps as well as minute noise;
#: an hour gives ~60 changes, enough for a standard deviation that does not swing tick to tick.
NOISE_LAG_S = 600
NOISE_SPAN_S = 3600


def noise_from_changes(changes: Sequence[float]) -> float | None:
    """The demand's noise (tokens/s) from its NOISE_LAG_S changes: their population standard
    deviation / sqrt(2) (a change is the difference of two independent draws around a level;
    a steady trend shifts every change alike and drops out). None with fewer than 2 changes."""
    n = len(changes)
    if n < 2:
        return None
    mean = sum(changes) / n
    return math.sqrt(max(0.0, sum((c - mean) ** 2 for c in changes) / n) / 2.0)
