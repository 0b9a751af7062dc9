"""Running figures over a per-step series, each linear in its length: what Prometheus'
`max_over_time`, `avg_over_time`, `deriv` and the forecast's noise estimate would say at every
step (the planner driver feeds them to the policy; baselines and the client metrics reuse
them)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence


def sliding_max(values: Sequence[float], width: int) -> list[float]:
    """out[i] = max(values[i-width+1 .. i])."""
    out: list[float] = []
    window: deque[int] = deque()
    for i, v in enumerate(values):
        while window and values[window[-1]] <= v:
            window.pop()
        window.append(i)
        if window[0] <= i - width:
            window.popleft()
        out.append(values[window[0]])
    return out


def ahead_max(values: Sequence[float], width: int) -> list[float]:
    """out[i] = max(values[i+1 .. i+width]) (clipped at the end)."""
    past = sliding_max(values, width)  # past[j] = max(values[j-width+1 .. j])
    last = len(values) - 1
    return [past[min(last, i + width)] if i < last else values[last] for i in range(len(values))]


def means(values: Sequence[float], width: int) -> list[float]:
    """Mean of values[i-width+1 .. i] (Prometheus `avg_over_time`), by a running sum."""
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def centred_means(values: Sequence[float], width: int) -> list[float]:
    """Mean of the `width` steps around i (values[i+h-width+1 .. i+h], h = width // 2; clipped
    at the end): the demand at a past moment as the forecast reads it (metrics/promql.py
    `forecast`: `avg_over_time` over the scale-down window, offset to centre it), so one noisy
    step back then neither lifts nor lowers a ramp read from it."""
    trailing = means(values, width)
    half, last = width // 2, len(values) - 1
    return [trailing[min(last, i + half)] for i in range(len(values))]


def noises(values: Sequence[float], lag: int, span: int) -> list[float | None]:
    """out[i]: metrics.forecast.noise_from_changes of the `lag`-step changes ending in
    i-span+1 .. i (None until the trace has run lag + span steps), by running sums."""
    out: list[float | None] = []
    total = squares = 0.0
    changes: list[float] = []
    for i in range(len(values)):
        if i >= lag:
            c = values[i] - values[i - lag]
            changes.append(c)
            total += c
            squares += c * c
            if len(changes) > span:
                old = changes[-span - 1]
                total -= old
                squares -= old * old
        n = min(len(changes), span)
        if n < span:
            out.append(None)
            continue
        mean = total / n
        out.append(math.sqrt(max(0.0, squares / n - mean * mean) / 2.0))
    return out


def slopes(values: Sequence[float], width: int, step_s: float = 60.0) -> list[float]:
    """Least-squares slope per second of values[i-width+1 .. i] (Prometheus `deriv`), points
    `step_s` apart; by running sums (linear in the trace, whatever the width)."""
    out = []
    total = weighted = 0.0  # sum of y, and of k * y with k the absolute index, in the window
    for i, v in enumerate(values):
        total += v
        weighted += i * v
        if i >= width:
            old = values[i - width]
            total -= old
            weighted -= (i - width) * old
        n = min(i + 1, width)
        if n < 2:
            out.append(0.0)
            continue
        first = i - n + 1
        # x = k - first runs 0 .. n-1: sum((x - mean_x) * y) = sum(x * y) - mean_x * sum(y)
        num = (weighted - first * total) - (n - 1) / 2 * total
        den = n * (n * n - 1) / 12.0
        out.append(num / den / step_s)
    return out
