"""The pool's last 24 hours and its next hours, from the journal and the demand history. Pure.

- `timeline`: serving and lent GPUs sampled over a window, from the journal's phase intervals
  (report.journal_facts, the same intervals `report` counts lent GPU-hours from).
- `outlook`: GPUs expected lendable in each of the next hours. It reads the same history the
  planner's forecast reads (policy.forecast_demand): the demand at the same moment 1 day and
  1 week ago. Per model the larger of the two is the demand expected; the replicas it needs
  (capacity.replicas_for at policy.target_utilisation, never below min_serving_replicas) stay
  serving, every other GPU of the pool may be lent. Unknown history gives None, not a guess.
- `unknown_note`, `best_time_note`: one line each saying why an hour is "unknown" or the best
  time "-" (a person reading the page cannot see Prometheus), or what the best time offers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slurm_idle.config import Config
from slurm_idle.policy.capacity import replicas_for
from slurm_idle.report import PhaseInterval

DAY_S = 86400.0
HISTORY_OFFSETS_S = (DAY_S, 7 * DAY_S)  # the forecast's "same moment yesterday / last week"


def timeline(
    intervals: Sequence[PhaseInterval],
    node_gpus: Mapping[str, int],
    since: float,
    until: float,
    step_s: float = 600.0,
) -> dict[str, list[Any]]:
    """{"t": [...], "serving_gpus": [...], "lent_gpus": [...]} at every step_s of the window."""
    ts = [since + i * step_s for i in range(int((until - since) // step_s) + 1)]
    serving, lent = [], []
    for t in ts:
        s = n = 0
        for iv in intervals:
            if iv.start <= t < iv.end or (t == until and iv.start <= t <= iv.end):
                gpus = node_gpus.get(iv.node, 0)
                if iv.phase == "serving":
                    s += gpus
                elif iv.phase == "lent":
                    n += gpus
        serving.append(s)
        lent.append(n)
    return {"t": ts, "serving_gpus": serving, "lent_gpus": lent}


def outlook(
    config: Config,
    now: float,
    demand_at: Callable[[float], Mapping[str, float] | None],
    hours: int = 6,
) -> list[dict[str, Any]]:
    """[{"t", "lendable_gpus", "demand_tokens_per_s"}] for now and each of the next hours.

    `demand_at(t)` is the demand per model at time t (tokens/s), None when unknown.
    """
    total = sum(m.gpus_per_replica * len(m.replicas) for m in config.models)
    util = config.policy.target_utilisation
    out: list[dict[str, Any]] = []
    for h in range(hours + 1):
        t = now + h * 3600.0
        seen = [d for off in HISTORY_OFFSETS_S if (d := demand_at(t - off)) is not None]
        if not seen:
            out.append({"t": t, "lendable_gpus": None, "demand_tokens_per_s": None})
            continue
        demand = {m.name: max((d.get(m.name, 0.0) for d in seen), default=0.0)
                  for m in config.models}
        keep = 0
        for m in config.models:
            need = max(replicas_for(demand[m.name], m.tokens_per_s_per_replica, util),
                       m.min_serving_replicas)
            keep += min(need, len(m.replicas)) * m.gpus_per_replica
        out.append({"t": t, "lendable_gpus": max(total - keep, 0),
                    "demand_tokens_per_s": {k: round(v, 2) for k, v in demand.items()}})
    return out


def best_time(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The first hour with the most lendable GPUs (None when nothing is known)."""
    known = [r for r in rows if r.get("lendable_gpus") is not None]
    if not known:
        return None
    most = max(r["lendable_gpus"] for r in known)
    return float(next(r["t"] for r in known if r["lendable_gpus"] == most))


# Why an hour is unknown when Prometheus answered: it has no demand at either moment.
NO_HISTORY = ("Prometheus has no demand recorded at the same hour 1 day or 1 week earlier: the "
              "outlook needs 24 hours of demand history (it fills in a day after the replicas "
              "are first scraped)")


def unknown_note(rows: Sequence[Mapping[str, Any]], cause: str | None = None) -> str | None:
    """Why some hours are unknown, in one line (None when every hour is known). `cause`: why
    no history could be read at all (metrics.source, Prometheus down); else too little of it."""
    unknown = sum(1 for r in rows if r.get("lendable_gpus") is None)
    if not unknown:
        return None
    which = "every hour" if unknown == len(rows) else f"{unknown} of {len(rows)} hours"
    return f"unknown ({which}): {cause or NO_HISTORY}"


def best_time_note(rows: Sequence[Mapping[str, Any]], cause: str | None = None) -> str:
    """What the best time offers, or why there is none ("-"), in one line."""
    known = [int(r["lendable_gpus"]) for r in rows if r.get("lendable_gpus") is not None]
    ahead = max(len(rows) - 1, 0)
    span = "the next hour" if ahead == 1 else f"the next {ahead} hours"
    if not known:
        return f"no forecast for {span}: " + (cause or "less than 24 hours of demand history")
    most = max(known)
    if most == 0:
        return (f"no GPU expected lendable in {span}: the demand then a day or a week ago, "
                "or the serving floors, keep every GPU serving")
    return f"{most} GPU{'s' if most != 1 else ''} expected lendable then"


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
