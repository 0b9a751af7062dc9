"""What makes the trace family wide: shapes a planner tuned on smooth days has not seen.

The planner is re-measured independently on production load shapes and on synthetic families
this repository does not have, so the family it is tuned on must already hold the kinds of
surprise those contain. Per model (drawn from the member's second random stream, see
family.member, so the base shapes do not change):

- **flash crowds**: 0 or 0.5-4 a week, rising to x2-x4 within 1-5 minutes and decaying over
  10-40 minutes (a launch, a link on a front page): unforeseeable by any history;
- **weekday levels**: each weekday its own level (+-10%), on half the models;
- **a trend over the whole trace**: the level ends -30%..+50% from where it began (growth, a
  slow migration away), on half the models;
- **level shifts**: 0-2 permanent steps x0.6-1.5 (a customer onboarded, a model deprecated):
  yesterday's level is wrong from then on;
- **heavy-tailed noise**: on a third of the models the white minute noise is Student-t with
  3 degrees of freedom (the same scale, single minutes of 4-6 sigma);
- **two time zones**: on three models in ten, 20-50% of the users live in another zone;
- **cold starts** per member: half keep 300 s start / 60 s grace (the goals' setting), the
  rest draw 30 s (a sleep-mode wake) to 15 min starts and 30-300 s grace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_idle.sim.engine import SimParams


@dataclass(frozen=True)
class Twists:
    """One model's twists; the default is none (the narrow family's shape)."""

    flashes: tuple[tuple[int, float, float, float], ...] = ()  # (minute, peak, rise_min, decay_min)
    weekdays: tuple[float, ...] = ()  # Monday..Friday level factors (empty: all 1)
    growth: float = 0.0  # relative change of the level from the first to the last minute
    shifts: tuple[tuple[int, float], ...] = ()  # (minute, factor) from then on
    heavy_tail: bool = False
    second_zone_h: float | None = None
    second_share: float = 0.0

    def describe(self) -> str:
        parts = []
        if self.flashes:
            parts.append(f"{len(self.flashes)} flash crowd(s)")
        if self.weekdays:
            parts.append("weekday levels")
        if self.growth:
            parts.append(f"trend {self.growth:+.0%}")
        if self.shifts:
            parts.append("shift(s) " + " ".join(f"x{f:.2f}" for _, f in self.shifts))
        if self.heavy_tail:
            parts.append("heavy-tailed noise")
        if self.second_zone_h is not None:
            parts.append(f"{self.second_share:.0%} of users at UTC{self.second_zone_h:+g}")
        return (" [" + ", ".join(parts) + "]") if parts else ""


def draw_twists(rng: random.Random, minutes: int, zones: Sequence[float], own_zone_h: float) -> Twists:
    """One model's twists over a trace of `minutes` (a fixed number of draws per model); a
    second zone is one of `zones` other than the model's own."""
    per_week = rng.choice((0.0, 0.0, rng.uniform(0.5, 4.0)))
    expected = per_week * minutes / (7 * 1440)
    count = int(expected) + (1 if rng.random() < expected - int(expected) else 0)
    flashes = tuple(
        (rng.randrange(minutes), rng.uniform(2.0, 4.0), rng.uniform(1.0, 5.0), rng.uniform(10.0, 40.0))
        for _ in range(count)
    )
    weekdays = tuple(rng.uniform(0.9, 1.1) for _ in range(5))
    growth = rng.uniform(-0.3, 0.5)
    shifts = tuple(
        (rng.randrange(minutes), math.exp(rng.uniform(math.log(0.6), math.log(1.5))))
        for _ in range(rng.choice((0, 0, 1, 2)))
    )
    heavy = rng.random() < 0.33
    zone = rng.choice(tuple(z for z in zones if z != own_zone_h))
    share = rng.uniform(0.2, 0.5)
    mixed = rng.random() < 0.3
    return Twists(
        flashes=flashes,
        weekdays=weekdays if rng.random() < 0.5 else (),
        growth=growth if rng.random() < 0.5 else 0.0,
        shifts=shifts,
        heavy_tail=heavy,
        second_zone_h=zone if mixed else None,
        second_share=share if mixed else 0.0,
    )


def apply_twists(t: Twists, minute: int, minutes: int) -> float:
    """The factor the twists put on the level at `minute` (weekdays and noise aside)."""
    factor = 1.0 + t.growth * minute / max(1, minutes - 1)
    for at, f in t.shifts:
        if minute >= at:
            factor *= f
    for at, peak, rise, decay in t.flashes:
        if minute < at:
            continue
        dt = minute - at
        shape = dt / rise if dt < rise else math.exp(-(dt - rise) / decay)
        if shape > 1e-3:
            factor *= 1.0 + (peak - 1.0) * shape
    return factor


#: Student-t with 3 degrees of freedom has variance 3: scaled by 1/sqrt(3) its spread is the
#: Gaussian's, its tails far heavier.
_T3_SCALE = 1.0 / math.sqrt(3.0)


def heavy_factor(rng: random.Random) -> float:
    """Multiplies a standard normal draw into a Student-t(3) one of the same variance."""
    chi2 = rng.gammavariate(1.5, 2.0)  # chi-square with 3 degrees of freedom
    return _T3_SCALE / math.sqrt(max(chi2, 1e-9) / 3.0)


def draw_latencies(rng: random.Random) -> SimParams:
    """A member's cold start and grace: the goals' 300 s / 60 s on half the members."""
    if rng.random() < 0.5:
        return SimParams()
    start = rng.choice((30.0, 60.0, 120.0, 300.0, 600.0, 900.0))
    grace = rng.choice((30.0, 60.0, 120.0, 300.0))
    return SimParams(start_s=start, grace_s=grace)
