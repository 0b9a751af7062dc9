"""The PromQL of one tick, built from the config: pure text, so tests read the queries.

Each signal is ONE fleet-wide instant query grouped by scrape target and served model (see
prometheus.py, which sends them); window extremes come with their `count_over_time` so a
window Prometheus does not (nearly) hold reads as "no window yet".
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from slurm_idle.config import Config, GpuConfig
from slurm_idle.metrics import names
from slurm_idle.metrics.forecast import NOISE_LAG_S, NOISE_SPAN_S
from slurm_idle.metrics.history import WINDOW_COVERAGE

DAY_S = 86_400
WEEK_S = 7 * DAY_S


@dataclass(frozen=True)
class Queries:
    """The PromQL of one tick, built from the config (pure, so tests can read it)."""

    selector: str  # e.g. `{job="vllm"}` or ``
    instance_label: str
    rate_window_s: int
    prompt_token_weight: float
    staleness_s: float = 120.0
    queue_sustain_s: int = 60  # the queue's minimum over this span is the queue signal

    def _sel(self, extra: str = "") -> str:
        inner = ",".join(p for p in (self.selector.strip("{}"), extra) if p)
        return "{" + inner + "}" if inner else ""

    def _rate(self, metric: str, offset_s: int = 0, valid: bool = False) -> str:
        off = f" offset {offset_s}s" if offset_s else ""
        expr = f"rate({metric}{self._sel()}[{self.rate_window_s}s]{off})"
        return _valid(expr) if valid else expr

    def _gauge(self, metric: str, valid: bool = False) -> str:
        return _valid(f"{metric}{self._sel()}") if valid else f"{metric}{self._sel()}"

    def _p95(self, hist: str, by: str, valid: bool = False) -> str:
        return (
            f"histogram_quantile(0.95, sum by (le, {by}) "
            f"({self._rate(hist + '_bucket', valid=valid)}))"
        )

    # Per replica (grouped by the scrape target and the served model: a series of another
    # model on the same target is not this replica's load, see PrometheusSource._by_node).
    def replica(self) -> dict[str, str]:
        i = f"{self.instance_label}, {names.MODEL_LABEL}"
        awake = f'{names.SLEEP_STATE_LABEL}="{names.SLEEP_AWAKE}"'
        return {
            "running": f"sum by ({i}, {names.ENGINE_LABEL}) ({names.RUNNING}{self._sel()})",
            "waiting": f"sum by ({i}) ({names.WAITING}{self._sel()})",
            # `or` keeps the legacy gauge only for targets without the new one.
            "kv": (
                f"max by ({i}) ({names.KV_CACHE_USAGE}{self._sel()}) "
                f"or max by ({i}) ({names.KV_CACHE_USAGE_LEGACY}{self._sel()})"
            ),
            # The next two list only the exceptions (asleep, stale), to keep answers small.
            "asleep": f"max by ({i}) ({names.SLEEP_STATE}{self._sel(awake)}) < 0.5",
            "prompt": f"sum by ({i}) ({self._rate(names.PROMPT_TOKENS)})",
            "generation": f"sum by ({i}) ({self._rate(names.GENERATION_TOKENS)})",
            "stale": (
                f"time() - max by ({i}) (timestamp({names.RUNNING}{self._sel()})) > {self.staleness_s:g}"
            ),
            # `>= 0` drops NaN: replicas without requests in the window have no percentile.
            "ttft": f"{self._p95(names.TTFT, i)} >= 0",
            "queue": f"{self._p95(names.QUEUE_TIME, i)} >= 0",
        }

    def _subquery(self, expr: str, range_s: int) -> str:
        return f"{expr}[{range_s}s:{subquery_step(range_s, self.rate_window_s)}s]"

    def covered(self, points: float | None, range_s: int) -> bool:
        """Whether a subquery over range_s had data at >= WINDOW_COVERAGE of its steps."""
        expected = range_s // subquery_step(range_s, self.rate_window_s)
        return points is not None and points >= WINDOW_COVERAGE * expected

    def demand(self, offset_s: int = 0) -> str:
        m = names.MODEL_LABEL
        gen = self._rate(names.GENERATION_TOKENS, offset_s, valid=True)
        prompt = self._rate(names.PROMPT_TOKENS, offset_s, valid=True)
        return f"(sum by ({m}) ({gen}) + {self.prompt_token_weight!r} * sum by ({m}) ({prompt}))"

    # Fleet-wide per model.
    def model(self, window_s: int, leads: Collection[int] | None) -> dict[str, str]:
        """The per-model queries; `leads`: the models' forecast lead times (None: no forecast)."""
        m = names.MODEL_LABEL
        # Every series passes `_valid` before it is summed: one NaN or negative series (a fake
        # exporter on a lent node's port) must not poison a model's fleet-wide figures.
        waiting = f"sum by ({m}) ({self._gauge(names.WAITING, valid=True)})"
        q = {
            "generation": f"sum by ({m}) ({self._rate(names.GENERATION_TOKENS, valid=True)})",
            "prompt": f"sum by ({m}) ({self._rate(names.PROMPT_TOKENS, valid=True)})",
            "running": f"sum by ({m}) ({self._gauge(names.RUNNING, valid=True)})",
            "waiting": waiting,
            "kv": (
                f"max by ({m}) ({self._gauge(names.KV_CACHE_USAGE, valid=True)}) "
                f"or max by ({m}) ({self._gauge(names.KV_CACHE_USAGE_LEGACY, valid=True)})"
            ),
            "ttft": self._p95(names.TTFT, m, valid=True),
        }
        if self.queue_sustain_s > 0:
            # the queue now, and its minimum over the sustain span with the span's points
            recent = self._subquery(waiting, self.queue_sustain_s)
            q["waiting"] = " or ".join([
                waiting,
                _kind(f"min_over_time({recent})", "recent_min"),
                _kind(f"count_over_time({recent})", "recent_points"),
            ])
        if window_s > 0:
            # the window's points (`kind="points"`) say whether Prometheus holds all of it
            demand = self._subquery(self.demand(), window_s)
            points = _kind(f"count_over_time({demand})", "points")
            # the adaptive headroom's inputs ride on the same query (capacity.Spread): the
            # window's mean and slope, and the noise of the demand's 10-minute changes over an hour
            changes = f"({self.demand()} - {self.demand(NOISE_LAG_S)})"
            noise_sub = f"{changes}[{NOISE_SPAN_S}s:{subquery_step(NOISE_SPAN_S, self.rate_window_s)}s]"
            q["demand_max"] = " or ".join([
                f"max_over_time({demand})", points,
                _kind(f"avg_over_time({demand})", "mean"),
                _kind(f"deriv({demand})", "trend"),
                _kind(f"stddev_over_time({noise_sub}) / {math.sqrt(2)!r}", "noise"),
                _kind(f"count_over_time({noise_sub})", "noise_points"),
            ])
            q["waiting_max"] = f"max_over_time({self._subquery(waiting, window_s)})"
            q["waiting_min"] = f"min_over_time({self._subquery(waiting, window_s)})"
        if leads is not None:
            q["forecast"] = self.forecast(leads, window_s)
        return q

    @staticmethod
    def gpus(gpu: GpuConfig) -> str:
        """Every GPU's memory in ONE query, told apart by `kind`: `used`, `free` and/or `total`
        (what the config names), and `ts`, the sample time of `used` (an instant query's own
        timestamps are evaluation times, so freshness needs `timestamp()`). Not restricted to
        metrics.job_label: the GPU exporter is another scrape job than vLLM's."""
        parts = [_kind(gpu.used_metric, "used")]
        if gpu.free_metric is not None:
            parts.append(_kind(gpu.free_metric, "free"))
        if gpu.total_metric is not None:
            parts.append(_kind(gpu.total_metric, "total"))
        parts.append(_kind(f"timestamp({gpu.used_metric})", "ts"))
        return " or ".join(parts)

    def forecast(self, leads: Collection[int], window_s: int) -> str:
        """Every input of `policy.forecast_demand`, for every model, in one query.

        Series are told apart by a `kind` label. Per offset (1d, 7d): `then_<o>`, the demand at
        now-offset; for each distinct lead time L of the models, `ahead_<o>@L`, its peak over
        the L seconds after that moment, and `later_<o>@L`, its peak over L + the scale-down
        window (what `forecast_demand_tokens_per_s_max_window` needs). And `trend`: `deriv` of
        the demand over the scale-down window, tokens/s per second. Models with different leads
        (cold start vs sleep-mode wake) each read their own L; the query stays one per tick.

        The past is read smoothed: "the demand at a moment" is its mean over the scale-down
        window centred on that moment (`avg_over_time`, offset by half a window), and the peaks
        are of that mean. Read raw, yesterday's ramp was the peak of a few noisy minutes less
        one noisy minute: it moved with every minute's noise, and today's plan with it.
        """
        parts = []
        half = window_s // 2
        for ago, tag in ((DAY_S, "1d"), (WEEK_S, "7d")):
            then = self._past_mean(window_s, max(ago - half, 1))
            parts.append(f'label_replace({then}, "kind", "then_{tag}", "", "")')
            for lead in sorted({max(int(v), 1) for v in leads}):
                reaches = [("ahead", lead)] + ([("later", lead + window_s)] if window_s > 0 else [])
                for name, span in reaches:
                    step = subquery_step(span, self.rate_window_s)
                    peak = (f"max_over_time(({self._past_mean(window_s)})[{span}s:{step}s] "
                            f"offset {max(ago - span - half, 1)}s)")
                    parts.append(f'label_replace({peak}, "kind", "{name}_{tag}@{lead}", "", "")')
        if window_s > 0:
            step = subquery_step(window_s, self.rate_window_s)
            trend = f"deriv({self.demand()}[{window_s}s:{step}s])"
            parts.append(f'label_replace({trend}, "kind", "trend", "", "")')
        return " or ".join(parts)

    def _past_mean(self, window_s: int, offset_s: int = 0) -> str:
        """The demand's mean over the `window_s` before now - `offset_s` (without a window, the
        demand then)."""
        if window_s <= 0:
            return self.demand(offset_s)
        step = subquery_step(window_s, self.rate_window_s)
        off = f" offset {offset_s}s" if offset_s else ""
        return f"avg_over_time({self.demand()}[{window_s}s:{step}s]{off})"


def _valid(expr: str) -> str:
    """Only the series of `expr` that are finite and not negative (`>= 0` drops NaN too)."""
    return f"({expr} >= 0 < +Inf)"


def _kind(expr: str, kind: str) -> str:
    """expr with the label `kind` set, to send several answers in one query."""
    return f'label_replace({expr}, "kind", "{kind}", "", "")'


def subquery_step(range_s: int, rate_window_s: int) -> int:
    """Resolution of a range subquery: ~10-30 points, never finer than half the rate window."""
    return max(1, min(max(rate_window_s // 2, 1), max(range_s // 10, 1)))


def queries_for(config: Config) -> Queries:
    job = config.metrics.job_label
    return Queries(
        selector=f'{{job="{job}"}}' if job else "",
        instance_label=config.metrics.instance_label,
        rate_window_s=config.metrics.rate_window_s,
        prompt_token_weight=config.policy.prompt_token_weight,
        staleness_s=config.metrics.staleness_s,
        queue_sustain_s=config.policy.queue_sustain_s,
    )
