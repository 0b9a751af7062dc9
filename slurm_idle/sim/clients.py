"""The SLO as clients feel it: how much demand went unserved, how short the short minutes
were, how long requests queued, and how often a lend was undone for nothing.

A violation minute says only that a model served fewer replicas than its demand needed: a
minute 0.03% short counts like one 74% short, and neither says what requests went through.
These figures, computed from a run's timeline (pure functions of per-step series), say it.
Demand beyond what the whole fleet serves is left out of the shortfalls and the queue (as the
violation count caps the need at the fleet): no policy could have served it, and it would
hide the policies' differences.

- `unserved_share`: demand above the SLO capacity (serving replicas x tokens/s x the SLO
  utilisation) over all demand.
- `minutes_short_5pct`: model-minutes in which that shortfall exceeded 5% of the demand.
- `queue_delay_p99_s`, `queue_delay_max_s`: a fluid FIFO queue in front of each model's full
  capacity (utilisation 1): the backlog grows while demand exceeds it and drains when it does
  not; a request waits until everything that arrived before it is served. The delay of a
  step's last arrival (the most any of its requests waits) is weighted by the step's demand
  for the percentile.
- `flaps`: lends undone (aborted, or reclaimed) within the scale-down window of the lend
  while the demand moved less than the noise margin (`headroom_sigmas` x the noise of the
  hour before the lend, as the planner measures it): capacity moved back and forth at a
  level the load did not leave.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: A shortfall above this share of the demand is a short minute that clients feel.
SHORT_SHARE = 0.05


@dataclass(frozen=True)
class Reversal:
    """A lend undone: when it was decided, and when it was reversed (unix seconds)."""

    model: str
    lent_at: float
    undone_at: float


def unserved(demand: Sequence[float], capacity: Sequence[float]) -> tuple[float, int]:
    """(demand above `capacity`, summed over the steps; steps short by more than SHORT_SHARE
    of their demand)."""
    total = 0.0
    short = 0
    for d, c in zip(demand, capacity, strict=True):
        gap = d - c
        if gap > 0:
            total += gap
            if gap > SHORT_SHARE * d:
                short += 1
    return total, short


def queue_delays(demand: Sequence[float], capacity: Sequence[float], step_s: float
                 ) -> list[float]:
    """Per step, the time its last arrival waits in a fluid FIFO queue (seconds).

    Per step k of `step_s` seconds, arrivals a_k = demand x step_s, capacity c_k likewise; the
    backlog carries over: B' = max(0, B + a - c). A request arriving at the end of step k is
    served when the cumulative service reaches the cumulative arrivals up to it. It is still
    queued at the start of a later step j, behind nothing but backlog, which the replicas
    work off at their full rate: it is served (level - served by j's start) / rate into j.
    A request still queued when the trace ends waits until then (a lower bound). Linear: one
    pointer walks forward through the service."""
    n = len(demand)
    arrived = [0.0]  # cumulative arrivals at each step's end
    served = [0.0]  # cumulative service at each step's end
    backlog = 0.0
    for d, c in zip(demand, capacity, strict=True):
        a, cap = d * step_s, c * step_s
        after = max(0.0, backlog + a - cap)
        served.append(served[-1] + backlog + a - after)
        arrived.append(arrived[-1] + a)
        backlog = after
    delays = []
    j = 0
    for k in range(n):
        level = arrived[k + 1]
        slack = 1e-9 * max(1.0, level)
        if served[k + 1] >= level - slack:
            delays.append(0.0)
            continue
        j = max(j, k + 1)
        while j < n and served[j + 1] < level - slack:
            j += 1
        if j >= n:  # not served by the end of the trace
            delays.append((n - k - 1) * step_s)
            continue
        # served during step j, so its capacity is > 0
        into = (level - served[j]) / capacity[j]
        delays.append(j * step_s + into - (k + 1) * step_s)
    return delays


def weighted_quantile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """The q-quantile of `values` with `weights` (the smallest value whose cumulative weight
    reaches q of the total); 0 with no weight."""
    pairs = sorted((v, w) for v, w in zip(values, weights, strict=True) if w > 0)
    total = sum(w for _, w in pairs)
    if total <= 0:
        return 0.0
    reach = q * total
    run = 0.0
    for v, w in pairs:
        run += w
        if run >= reach - 1e-12 * total:
            return v
    return pairs[-1][0]


def flaps(reversals: Sequence[Reversal], demand: Mapping[str, Sequence[float]],
          noise: Mapping[str, Sequence[float | None]], start: float, step_s: float,
          window_s: float, sigmas: float) -> int:
    """Reversals within `window_s` of their lend while the demand moved (lend step to undo
    step) by less than `sigmas` x the noise figure at the lend (a lend before the noise is on
    record is judged on a move of zero: never a flap unless the demand stood still)."""
    count = 0
    for r in reversals:
        if r.undone_at - r.lent_at > window_s:
            continue
        series = demand[r.model]
        last = len(series) - 1
        i = min(last, max(0, round((r.lent_at - start) / step_s)))
        j = min(last, max(0, round((r.undone_at - start) / step_s)))
        sigma = noise[r.model][i]
        if abs(series[j] - series[i]) <= sigmas * (sigma or 0.0):
            count += 1
    return count
