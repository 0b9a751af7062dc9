"""Prometheus answers read into loads: the instant-query vector, and one model's ModelLoad from
its fleet-wide series (window figures only when Prometheus holds the window, the forecast
through `metrics.forecast`, the simulator's arithmetic). Pure: prometheus.py sends the queries.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from slurm_idle.config import PolicyConfig
from slurm_idle.metrics import demand_tokens_per_s
from slurm_idle.metrics.forecast import NOISE_SPAN_S, Peak, forecasts
from slurm_idle.metrics.promql import Queries
from slurm_idle.model import ModelLoad


@dataclass
class _Vector:
    """One instant-query answer: the raw series list and the evaluation time."""

    result: list[dict[str, Any]]
    eval_ts: float | None

    def values(self) -> Iterator[tuple[dict[str, str], float]]:
        """(labels, value) per series; NaN kept (a percentile over no requests)."""
        for item in self.result:
            yield item["metric"], float(item["value"][1])


def parse_vector(result: Any) -> _Vector:
    """Check the shape of prometheus_api_client's `result` list; values are read lazily."""
    if not isinstance(result, list):
        raise TypeError(f"expected a list of series, got {type(result).__name__}")
    eval_ts = float(result[-1]["value"][0]) if result else None
    return _Vector(result, eval_ts)


def _finite(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) or math.isinf(v) else v


def model_load(
model: str, v: Mapping[str, float], lead_s: int | None, policy: PolicyConfig, q: Queries
) -> ModelLoad:
    """One model's ModelLoad from its answers (`signal` or `signal:kind` -> value); unknown
    without the present's generation, prompt and running figures, a window figure None unless
    Prometheus holds (nearly) the whole window."""
    gen, prompt = _finite(v.get("generation")), _finite(v.get("prompt"))
    running = _finite(v.get("running"))
    if gen is None or prompt is None or running is None:
        return ModelLoad(model=model, known=False)
    waiting = _finite(v.get("waiting")) or 0.0
    demand_now = demand_tokens_per_s(gen, prompt, policy.prompt_token_weight)
    window_s = policy.scale_down_window_s
    windowed = window_s > 0
    # Without (nearly) the whole window in Prometheus, "low for the whole window" is unknown.
    covered = not windowed or q.covered(_finite(v.get("demand_max:points")), window_s)
    # The queue's minimum over the sustain span, the present included (the subquery's last
    # step may predate it); None unless Prometheus holds the span.
    recent: float | None = waiting
    if policy.queue_sustain_s > 0:
        span_min = _finite(v.get("waiting:recent_min"))
        points = _finite(v.get("waiting:recent_points"))
        covered_span = q.covered(points, policy.queue_sustain_s)
        recent = min(span_min, waiting) if span_min is not None and covered_span else None
    forecast, forecast_window = (
        forecast_inputs(v, demand_now, lead_s, window_s) if lead_s is not None else (None, None)
    )
    return ModelLoad(
        model=model,
        known=True,
        prompt_tokens_per_s=prompt,
        generation_tokens_per_s=gen,
        running=running,
        waiting=waiting,
        waiting_min_recent=recent,
        kv_cache_usage_max=_finite(v.get("kv")) or 0.0,
        ttft_p95_s=_finite(v.get("ttft")),
        demand_tokens_per_s_max_window=(
            demand_now if not windowed
            else _max_opt(_finite(v.get("demand_max")), demand_now) if covered else None
        ),
        waiting_max_window=(
            waiting if not windowed
            else _max_opt(_finite(v.get("waiting_max")), waiting) if covered else None
        ),
        waiting_min_window=(
            waiting if not windowed else _finite(v.get("waiting_min")) if covered else None
        ),
        demand_tokens_per_s_mean_window=(
            _finite(v.get("demand_max:mean")) if windowed and covered else None
        ),
        demand_trend_per_s_window=(
            _finite(v.get("demand_max:trend")) if windowed and covered else None
        ),
        demand_noise_tokens_per_s=(
            _finite(v.get("demand_max:noise"))
            if windowed and q.covered(_finite(v.get("demand_max:noise_points")), NOISE_SPAN_S)
            else None
        ),
        forecast_demand_tokens_per_s=forecast,
        forecast_demand_tokens_per_s_max_window=forecast_window,
    )


def forecast_inputs(
    v: Mapping[str, float], demand_now: float, lead_s: int, window_s: int
) -> tuple[float | None, float | None]:
    """(forecast over the lead, forecast over lead + scale-down window) from the `forecast:*`
    series of one model (`then_<o>`, `ahead_<o>@<lead>`, `later_<o>@<lead>`, `trend`), through
    `metrics.forecast.forecasts`, the simulator's arithmetic."""
    peaks = [
        Peak(
            then,
            ahead=_finite(v.get(f"forecast:ahead_{tag}@{lead_s}")),
            later=_finite(v.get(f"forecast:later_{tag}@{lead_s}")),
        )
        for tag in ("1d", "7d")
        if (then := _finite(v.get(f"forecast:then_{tag}"))) is not None
    ]
    return forecasts(demand_now, peaks, _finite(v.get("forecast:trend")), lead_s, window_s)


def _max_opt(window: float | None, now: float) -> float | None:
    # The window's max must cover the present too (the subquery's last step may predate it).
    return None if window is None else max(window, now)
