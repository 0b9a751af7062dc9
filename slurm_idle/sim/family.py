"""A seeded family of traces with wide ranges: the benchmark a planner cannot be tuned to.

Every member is drawn from its seed alone (`member(seed)`): 1 to 14 days, 1 to 3 models in
different time zones, each with its own diurnal shape (night level, a morning ramp of about x3
within 1-2 hours, a plateau, a lunch dip, an evening peak), weekends (and now and then a
weekday holiday), a slow drift of the daily level (+-20% over a week), minute noise from 1% to
10% (white plus a persistent part), unannounced bursts, and on some members rates held in
10-minute steps (as some production exports are). Fleets are sized so that the weekday peak
needs 55-90% of the replicas.

The family is **wide** (`twists.py`, drawn from a second stream of the same seed, so the shapes
above stay as they were): flash crowds (x2-x4 within minutes, decaying), weekday-by-weekday
levels, a trend over the whole trace (-30%..+50%), permanent level shifts, heavy-tailed
(Student-t) minute noise, users of one model in two time zones, a fourth model now and then,
and cold starts from 30 s to 15 min with 30-300 s grace.

The family is split by seed, fixed before any result is looked at: odd seeds are the
**held-out** set (`HELD_OUT`), even seeds the **tuning** set. Knobs may be chosen by looking at
the tuning set only; the held-out numbers are reported as they come.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime

from slurm_idle.sim.engine import FleetModel, SimParams
from slurm_idle.sim.twists import Twists, apply_twists, draw_latencies, draw_twists, heavy_factor
from slurm_idle.traces import Series, Trace

TUNING = "tuning"
HELD_OUT = "held-out"

#: The family's first minute: a Monday, 00:00 UTC (members start on a random weekday from it).
_EPOCH = datetime(2025, 1, 6, tzinfo=UTC).timestamp()

#: Time zones (hours from UTC) a model's users may live in.
_ZONES = (-8.0, -5.0, 0.0, 1.0, 5.5, 8.0, 9.0)


def split_of(seed: int) -> str:
    """The set a seed belongs to: odd seeds are held out (decided before any run)."""
    return HELD_OUT if seed % 2 else TUNING


@dataclass(frozen=True)
class Shape:
    """One model's traffic shape, every number drawn from the member's seed."""

    name: str
    zone_h: float  # users' offset from UTC
    peak_rps: float
    night: float  # night level, share of the weekday plateau (a ramp of >= x3 to the plateau)
    ramp_at_h: float  # local hour the morning ramp is half done
    ramp_h: float  # the ramp's length: night to plateau within 1-2 h
    lunch_dip: float  # share lost at lunch
    evening_peak: float  # share added around evening_at_h
    evening_at_h: float
    close_at_h: float  # local hour the evening decline is half done
    weekend: float  # weekend daytime level, share of a weekday's
    drift: float  # weekly level drift amplitude (+-)
    drift_phase: float
    noise: float  # minute noise sigma (log-normal)
    bursts_per_week: float
    prompt_tokens: float
    output_tokens: float
    twists: Twists = field(default_factory=Twists)


@dataclass(frozen=True)
class Member:
    """One generated trace with its fleet and latencies."""

    seed: int
    split: str
    days: int
    steps_10min: bool
    shapes: tuple[Shape, ...]
    fleet: tuple[FleetModel, ...]
    params: SimParams
    start: float

    @property
    def name(self) -> str:
        return f"f{self.seed:03d}"

    @property
    def max_noise(self) -> float:
        return max(s.noise for s in self.shapes)

    @property
    def latencies(self) -> str:
        """Cold start / grace, e.g. `300/60`."""
        return f"{self.params.engine_start_s:.0f}/{self.params.grace_s:.0f}"

    def describe(self) -> str:
        steps = ", 10-min steps" if self.steps_10min else ""
        models = "; ".join(
            f"{s.name} {f.replicas}x{f.gpus_per_replica} UTC{s.zone_h:+g} noise {s.noise:.0%}"
            f" bursts/wk {s.bursts_per_week:.1f}{s.twists.describe()}"
            for s, f in zip(self.shapes, self.fleet, strict=True)
        )
        return f"{self.days} d{steps}, start/grace {self.latencies} s: {models}"


_NAMES = ("chat", "code", "embed", "rerank")


def _shape(rng: random.Random, name: str) -> Shape:
    return Shape(
        name=name,
        zone_h=rng.choice(_ZONES),
        peak_rps=0.0,  # set from the fleet below
        night=rng.uniform(0.08, 0.33),
        ramp_at_h=rng.uniform(7.0, 10.0),
        ramp_h=rng.uniform(1.0, 2.0),
        lunch_dip=rng.choice((0.0, rng.uniform(0.05, 0.25))),
        evening_peak=rng.choice((0.0, rng.uniform(0.05, 0.3))),
        evening_at_h=rng.uniform(18.0, 21.0),
        close_at_h=rng.uniform(19.0, 23.5),
        weekend=rng.uniform(0.3, 1.0),
        drift=rng.uniform(0.0, 0.2),
        drift_phase=rng.uniform(0.0, 2 * math.pi),
        noise=math.exp(rng.uniform(math.log(0.01), math.log(0.10))),
        bursts_per_week=rng.choice((0.0, rng.uniform(0.5, 3.0))),
        prompt_tokens=rng.uniform(300.0, 3000.0),
        output_tokens=rng.uniform(100.0, 600.0),
    )


def _logistic(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, x))))


def _diurnal(s: Shape, hour: float) -> float:
    """Level at a local hour, weekday, as a share of the plateau (night .. ~1 + evening peak)."""
    # 4.4 logistic widths take 10% -> 90%: the ramp spans ramp_h hours
    up = _logistic((hour - s.ramp_at_h) / (s.ramp_h / 4.4))
    down = _logistic((s.close_at_h - hour) / 0.9)
    lunch = 1.0 - s.lunch_dip * math.exp(-(((hour - 12.75) / 0.7) ** 2))
    evening = 1.0 + s.evening_peak * math.exp(-(((hour - s.evening_at_h) / 1.2) ** 2))
    return s.night + (1.0 - s.night) * up * down * lunch * evening


def _series(rng: random.Random, s: Shape, start: float, minutes: int, steps: bool,
            tail: random.Random) -> Series:
    holiday = rng.randrange(minutes // 1440) if minutes >= 3 * 1440 and rng.random() < 0.3 else -1
    bursts: list[tuple[int, int, float]] = []
    expected = s.bursts_per_week * minutes / (7 * 1440)
    count = int(expected) + (1 if rng.random() < expected - int(expected) else 0)
    for _ in range(count):
        at = rng.randrange(minutes)
        bursts.append((at, at + rng.randint(10, 90), rng.uniform(1.3, 2.0)))
    persistent = 0.0
    held = 1.0
    rps: list[float] = []
    for m in range(minutes):
        local = start + 60.0 * m + s.zone_h * 3600.0
        moment = datetime.fromtimestamp(local, UTC)
        hour = moment.hour + moment.minute / 60.0
        level = _diurnal(s, hour)
        if s.twists.second_zone_h is not None:
            other = datetime.fromtimestamp(local + (s.twists.second_zone_h - s.zone_h) * 3600.0, UTC)
            w = s.twists.second_share
            level = (1 - w) * level + w * _diurnal(s, other.hour + other.minute / 60.0)
        off = moment.weekday() >= 5 or (m // 1440 == holiday and moment.weekday() < 5)
        if off:
            level = s.night + (level - s.night) * s.weekend
        elif s.twists.weekdays:
            level *= s.twists.weekdays[moment.weekday()]
        week = (local - _EPOCH) / (7 * 86400.0)
        level *= 1.0 + s.drift * math.sin(2 * math.pi * week + s.drift_phase)
        persistent = 0.9 * persistent + rng.gauss(0.0, 0.5 * s.noise * math.sqrt(1 - 0.81))
        white = rng.gauss(0.0, s.noise)
        if s.twists.heavy_tail:
            white *= heavy_factor(tail)
        noise = math.exp(persistent + white)
        if steps:
            # the rate is held for 10 minutes: one draw per step, taken at its first minute
            if m % 10 == 0:
                held = level * noise * apply_twists(s.twists, m, minutes)
            value = held
        else:
            value = level * noise * apply_twists(s.twists, m, minutes)
        for begin, end, factor in bursts:
            if begin <= m < end:
                value *= factor
        rps.append(round(s.peak_rps * value, 4))
    return Series(tuple(rps), (s.prompt_tokens,) * minutes, (s.output_tokens,) * minutes)


def member(seed: int, params: SimParams | None = None) -> Member:
    """The family's member `seed` (its trace from `trace(member)`)."""
    rng = random.Random(10_007 * seed + 17)
    # The wide family's twists come from a second stream: the base shapes stay as they were.
    wide = random.Random(104_729 * seed + 29)
    days = rng.randint(1, 14)
    steps = rng.random() < 0.3
    count = rng.choice((1, 1, 2, 2, 3))
    count += 1 if count == 3 and wide.random() < 0.5 else 0
    shapes, fleet = [], []
    for i in range(count):
        r = rng if i < 3 else wide
        shape = _shape(r, _NAMES[i])
        shape = Shape(**{**shape.__dict__, "twists": draw_twists(wide, days * 1440, _ZONES, shape.zone_h)})
        replicas = r.randint(4, 24)
        gpus = r.choice((1, 2, 4, 8))
        tokens_per_s = r.choice((1500.0, 2500.0, 4000.0, 6000.0))
        per_request = shape.output_tokens + 0.1 * shape.prompt_tokens
        # the weekday plateau (before its evening peak and noise) needs this share of the fleet
        share = r.uniform(0.55, 0.9) / (1.0 + shape.evening_peak)
        peak = share * replicas * tokens_per_s * 0.8 / per_request
        shapes.append(Shape(**{**shape.__dict__, "peak_rps": peak}))
        fleet.append(FleetModel(shape.name, replicas, gpus, tokens_per_s))
    start = _EPOCH + 86400.0 * rng.randrange(7)
    return Member(seed, split_of(seed), days, steps, tuple(shapes), tuple(fleet),
                  params or draw_latencies(wide), start)


def trace(m: Member) -> Trace:
    """The member's per-minute trace (deterministic in its seed)."""
    rng = random.Random(7_919 * m.seed + 3)
    tail = random.Random(7_927 * m.seed + 5)
    minutes = m.days * 1440
    series = {s.name: _series(rng, s, m.start, minutes, m.steps_10min, tail) for s in m.shapes}
    return Trace(start=m.start, steps=minutes, series=series)


def members(count: int, first_seed: int = 1) -> list[Member]:
    """`count` consecutive seeds from first_seed: half tuning, half held out."""
    return [member(seed) for seed in range(first_seed, first_seed + count)]
