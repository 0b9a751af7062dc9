"""How many replicas a model needs: token demand against per-replica capacity, plus pressure.

Two numbers come out of here for each model. `up` is what the load needs *now* (current demand,
the forecast ramp, and +1 whenever a queue that lasted `queue_sustain_s`, the KV cache or latency
say the serving replicas are not enough): the planner reclaims at once when supply falls short
of it. `down` is what the load needed at any time over the scale-down window (Prometheus
`max_over_time`) and what it may need over the reclaim lead *and* the window after it, so a
replica is only lent after load has stayed low for the whole window and when it is not
expected back within the next: hysteresis without a state file, and no lending until the
window's history exists.
Everything here is arithmetic on one ModelLoad; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_idle.config import Config, ModelConfig, PolicyConfig
from slurm_idle.model import ModelLoad, ReplicaLoad
from slurm_idle.policy.rules import floor as floor_of

#: A reclaim decided now starts at the next tick at the latest (cron runs `tick` every minute).
TICK_S = 60.0

#: Relative slack so that demand exactly at a replica boundary needs that many replicas, not one
#: more because of floating point (e.g. 3 * 1600.0000000001).
_EPS = 1e-9


def demand_tokens_per_s(generation: float, prompt: float, prompt_token_weight: float) -> float:
    """The token demand a replica's capacity is measured in: generated + weighted prompt tokens."""
    return generation + prompt_token_weight * prompt


def replicas_for(demand: float, capacity: float, utilisation: float) -> int:
    """Replicas needed to serve `demand` tokens/s with each replica at most `utilisation` busy."""
    if demand <= 0:
        return 0
    return max(0, math.ceil(demand / (capacity * utilisation) * (1 - _EPS)))


def replica_capacity(
    model: ModelConfig, policy: PolicyConfig, replicas: Sequence[ReplicaLoad]
) -> tuple[float, str]:
    """Tokens/s one replica serves: configured, or learned from replicas that are saturated now.

    A replica with a queue is serving as fast as it can, so its throughput is its capacity.
    Learning is clamped to [0.5, 2] x the configured value so one odd replica cannot swing the
    plan far; without a saturated replica the configured value stands.
    """
    configured = model.tokens_per_s_per_replica
    if not policy.learn_capacity:
        return configured, ""
    saturated = [
        demand_tokens_per_s(r.generation_tokens_per_s, r.prompt_tokens_per_s, policy.prompt_token_weight)
        for r in replicas
        if r.known and r.running > 0 and r.waiting > policy.queue_waiting_threshold
    ]
    if not saturated:
        return configured, ""
    learned = min(2 * configured, max(0.5 * configured, sum(saturated) / len(saturated)))
    return learned, f"capacity learned {learned:.0f} tok/s from {len(saturated)} saturated replica(s)"


@dataclass(frozen=True)
class Spread:
    """The load's level now, its trend and its variability (tokens/s).

    The level is the least-squares line through the scale-down window at the window's end
    (mean + slope * W/2 for evenly spaced points): a smoothed "now" that one noisy minute does
    not move. The variability (`sigma`) is measured on the demand's 10-minute changes over the
    last hour (their standard deviation / sqrt 2, metrics/forecast.py): white minute noise,
    a persistent wobble and rates that move in 10-minute steps all show in it, and a steady
    trend does not (a standard deviation ignores the changes' mean).
    """

    level: float
    trend_per_s: float
    sigma: float


#: The expected maximum of ~15 independent normal draws (a 15-minute window of minute points)
#: lies this many standard deviations above their mean: the window's peak gives a first noise
#: estimate until the noise hour is on record.
_PEAK_SIGMAS = 1.74


def spread(load: ModelLoad, window_s: float) -> Spread | None:
    """The Spread of `load`; None when the window is not covered.

    Until the noise hour is on record (a new deployment, a Prometheus restart) the noise is
    estimated from the window alone: its peak above the fitted line, / _PEAK_SIGMAS. Cruder,
    but never zero on a noisy load, so lends in the first hour keep a margin too.
    """
    mean = load.demand_tokens_per_s_mean_window
    if mean is None or window_s <= 0:
        return None
    slope = load.demand_trend_per_s_window or 0.0
    noise = load.demand_noise_tokens_per_s
    if noise is None:
        peak = load.demand_tokens_per_s_max_window
        if peak is None:
            return None
        noise = max(0.0, peak - mean - max(0.0, slope) * window_s / 2.0) / _PEAK_SIGMAS
    return Spread(level=max(0.0, mean + slope * window_s / 2.0), trend_per_s=slope, sigma=noise)


#: The reclaim the noise margin's `headroom_sigmas` is stated for: 300 s start + 60 s grace +
#: a tick, plus the minute a rise takes to show (the setting of issue 15's goals).
REFERENCE_HORIZON_S = 480.0


def horizon_factor(lead_s: float) -> float:
    """How the noise margin widens with the time a wrong lend takes to undo.

    A lend that turns out wrong leaves the model short until a reclaim serves, `lead_s`
    (grace + start + a tick) after the tick that sees the rise, and every minute of that is a
    violation. The persistent part of the noise (a wandering level, rates held in steps)
    spreads with the square root of the horizon, so a 15-minute cold start needs a wider margin
    than the 300 s one `headroom_sigmas` is stated for. A faster reclaim keeps the whole margin:
    white minute noise crosses the line as often whatever the reclaim costs (measured on the
    tuning set: narrowing it for a 60 s start doubled the violations of a heavy-tailed trace).
    """
    return max(1.0, math.sqrt(max(0.0, lead_s + TICK_S) / REFERENCE_HORIZON_S))


def adaptive_demand(
    load: ModelLoad, policy: PolicyConfig, seasonal: float | None, lead_s: float,
    demand_now: float,
) -> tuple[float, str] | None:
    """The demand to plan for over `lead_s`: a high quantile of the load.

    The fitted level, raised by the larger of the seasonal rise (`seasonal` - `demand_now`:
    yesterday's ramp over the lead) and a rising trend carried for `lead_s` (grace + start +
    a tick: a replica reclaimed now serves only then), plus `policy.headroom_sigmas` standard
    deviations of the noise, scaled by `horizon_factor(lead_s)` (the cost of a wrong lend
    grows with the cold start). The ramp rides on the level, not on this minute's demand: a
    noisy minute is what the margin is for, and counting it twice moved the plan with every
    minute (a reclaim a minute after a lend). The margin follows the noise measured, so no
    planning factor has to be tuned per fleet. None without a covered window (the
    scale-down side then lends nothing anyway). assess_need calls it over the lead for
    reclaims and over lead + window for lends.
    """
    if policy.headroom_sigmas <= 0:
        return None
    est = spread(load, policy.scale_down_window_s)
    if est is None:
        return None
    rise = max(0.0, (seasonal or demand_now) - demand_now, est.trend_per_s * lead_s)
    base = est.level + rise
    margin = policy.headroom_sigmas * horizon_factor(lead_s) * est.sigma
    why = (f"level {est.level:.0f} tok/s, trend {60 * est.trend_per_s:+.0f} tok/s/min, "
           f"noise {est.sigma:.0f} tok/s: plans for {base + margin:.0f} over {lead_s:.0f}s")
    return base + margin, why


@dataclass(frozen=True)
class Need:
    """The replicas a model needs, for scaling up (`up`) and for lending (`down`)."""

    up: int
    down: int | None  # None: the window evidence is missing, so nothing may be lent
    reason: str


def sustained_queue(load: ModelLoad, policy: PolicyConfig) -> float | None:
    """The queue that has lasted policy.queue_sustain_s (its minimum over that span), None if
    unknown. A request waiting for a moment is what a busy engine looks like between two
    scheduler steps; reclaiming for it would preempt a job for nothing."""
    if policy.queue_sustain_s == 0:
        return load.waiting
    return load.waiting_min_recent


def pressure_now(load: ModelLoad, policy: PolicyConfig) -> list[str]:
    """Signals that the replicas serving now are not enough, whatever the token count says."""
    signals = []
    threshold = policy.queue_waiting_threshold
    recent = sustained_queue(load, policy)
    if load.waiting_min_window is not None and load.waiting_min_window > threshold:
        signals.append(f"queue sustained (>= {load.waiting_min_window:g} waiting over the window)")
    elif recent is not None and recent > threshold:
        signals.append(
            f"queue for {policy.queue_sustain_s}s (>= {recent:g} waiting, {load.waiting:g} now)"
        )
    if load.kv_cache_usage_max > policy.kv_cache_high:
        signals.append(f"KV cache {load.kv_cache_usage_max:.0%} > {policy.kv_cache_high:.0%}")
    if (
        policy.ttft_p95_slo_s is not None
        and load.ttft_p95_s is not None
        and load.ttft_p95_s > policy.ttft_p95_slo_s
    ):
        signals.append(f"TTFT p95 {load.ttft_p95_s:.2f}s > SLO {policy.ttft_p95_slo_s:g}s")
    return signals


def queue_replicas(load: ModelLoad, policy: PolicyConfig, serving: int) -> int:
    """Extra replicas a queue asks for: enough to run every waiting request as concurrently as
    the serving replicas run theirs now. Saturated replicas report their capacity, not the
    demand, as throughput; the queue is where the rest of the demand shows, so a surge
    reclaims every replica it needs in one tick instead of one per tick. Only called once a
    pressure signal has fired: today's queue sizes a scale-up, it does not start one."""
    if serving <= 0 or load.running <= 0 or load.waiting <= policy.queue_waiting_threshold:
        return 0
    per_replica = load.running / serving
    return math.ceil(load.waiting / max(per_replica, 1.0))


def assess_need(
    model: ModelConfig,
    policy: PolicyConfig,
    load: ModelLoad,
    replicas: Sequence[ReplicaLoad],
    serving: int,
    total: int,
    lead_s: float = 0.0,
) -> Need:
    """What `load` needs, clamped to [floor, total]. `serving` counts replicas taking traffic now;
    `lead_s`: how long a reclaim takes to serve (default_forecast_lead_s)."""
    capacity, learned = replica_capacity(model, policy, replicas)
    util = policy.target_utilisation
    weight = policy.prompt_token_weight
    demand = demand_tokens_per_s(load.generation_tokens_per_s, load.prompt_tokens_per_s, weight)
    need = replicas_for(demand, capacity, util)
    parts = [f"demand {demand:.0f} tok/s needs {need} (capacity {capacity:.0f} tok/s at {util:.0%})"]
    if learned:
        parts.append(learned)
    seasonal = load.forecast_demand_tokens_per_s if policy.forecast else None
    adapted = adaptive_demand(load, policy, seasonal, lead_s, demand)
    if seasonal is not None and adapted is None:
        ahead = replicas_for(seasonal, capacity, util)
        if ahead > need:
            parts.append(f"forecast {seasonal:.0f} tok/s needs {ahead}")
            need = ahead
    if adapted is not None:
        ahead = replicas_for(adapted[0], capacity, util)
        if ahead > need:
            parts.append(f"{adapted[1]}: needs {ahead}")
            need = ahead
    signals = pressure_now(load, policy)
    if signals:
        need = max(need + 1, serving + 1, serving + queue_replicas(load, policy, serving))
        parts.append(f"{', '.join(signals)}: needs {need}")

    down: int | None
    window = policy.scale_down_window_s
    if window == 0:
        down = need
    elif load.demand_tokens_per_s_max_window is None or load.waiting_max_window is None:
        # The source's history does not cover the window (new deployment, Prometheus restart):
        # "load stayed low for the whole window" is not known yet.
        down = None
        parts.append("no window maximum: nothing lent")
    else:
        peak = max(load.demand_tokens_per_s_max_window, demand)
        down = max(need, replicas_for(peak, capacity, util))
        if down > need:
            parts.append(f"window max {peak:.0f} tok/s over {window}s needs {down}")
        if load.waiting_max_window > policy.queue_waiting_threshold:
            down = max(down, serving)
        coming = load.forecast_demand_tokens_per_s_max_window if policy.forecast else None
        held = adaptive_demand(load, policy, coming, lead_s + window, demand)
        if held is not None:
            later = replicas_for(held[0], capacity, util)
            if later > down:
                down = later
                parts.append(f"to hold over the window: {held[1]}: needs {later}")
        elif coming is not None:
            later = replicas_for(coming, capacity, util)
            if later > down:
                down = later
                parts.append(f"forecast over the window {coming:.0f} tok/s needs {later}")

    floor = floor_of(model, total)

    def clamp(n: int) -> int:
        return min(max(n + policy.headroom_replicas, floor), total)

    up = clamp(need)
    if policy.headroom_replicas:
        parts.append(f"+{policy.headroom_replicas} headroom")
    if up == floor and need + policy.headroom_replicas < floor:
        parts.append(f"floor {floor}")
    return Need(up=up, down=None if down is None else max(up, clamp(down)), reason="; ".join(parts))


def forecast_demand(
    demand_now: float,
    history: Sequence[tuple[float, float]],
    trend_per_s: float | None = None,
    lead_s: float = 0.0,
) -> float | None:
    """Demand expected over the next lead time, from the same moments 1 day / 1 week ago.

    `history` holds, per offset with data, (demand at now-offset, max demand over
    [now-offset, now-offset+lead]), both read as window means centred on each moment (one
    noisy minute back then is no ramp). The forecast is today's demand plus the largest rise seen
    over the lead time back then: the *shape* of yesterday's ramp, on today's level, so that a
    quiet Saturday after a busy Friday does not keep Friday's replicas serving. A rising trend
    (`trend_per_s`, tokens/s per second, e.g. Prometheus `deriv(...[15m])`) extrapolated over
    `lead_s` counts too, so a ramp is met before history exists. The metrics adapter computes
    the inputs from Prometheus (`avg_over_time(...[window] offset ...)` and its
    `max_over_time` over the lead: metrics/promql.py `forecast`), the simulator from the
    trace (sim/series.py `centred_means`); both call this one function. None without any evidence.
    """
    rises = [max(0.0, ahead - then) for then, ahead in history]
    if trend_per_s is not None:
        rises.append(max(0.0, trend_per_s) * lead_s)
    if not rises:
        return None
    return demand_now + max(rises)


def default_forecast_lead_s(config: Config, model: str) -> float:
    """How far ahead the forecast must look for `model`: policy.forecast_lead_s, or else the
    time a reclaim takes: the lent jobs' grace (slurm.requeue_grace_s), for `placement: jobs`
    Slurm's start of the replica job (job.expected_queue_s), the engine's start or wake
    (engine.expected_start_s of the model's engine) and one tick."""
    if config.policy.forecast_lead_s is not None:
        return config.policy.forecast_lead_s
    job = config.model(model).job
    queue = job.expected_queue_s if job is not None else 0.0
    return (config.slurm.requeue_grace_s + queue + config.engine_for(model).expected_start_s
            + TICK_S)
