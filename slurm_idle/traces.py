"""Load traces for the simulator: reading, writing, and a seeded synthetic generator.

A trace is demand per model and step (a minute, or a few seconds): mean requests/s and mean
prompt/output tokens per request. Two input formats are read:
- the slurm-idle CSV `timestamp,model,rps,prompt_tokens,output_tokens` (one row per step and
  model, ISO timestamps; the step is what the timestamps fall on, e.g. 60 or 10 s);
- the public Azure LLM inference trace `TIMESTAMP,ContextTokens,GeneratedTokens` (one row per
  request), aggregated per minute (or per the simulation's finer step).
Steps without a row have no traffic; `resample` changes a trace's step. The synthetic generator draws weekday/weekend diurnal
curves with day-to-day level changes, minute noise and optional unannounced bursts, from a seed.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from slurm_idle.errors import ConfigError

CSV_HEADER = ("timestamp", "model", "rps", "prompt_tokens", "output_tokens")
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class Series:
    """One model's demand per step, aligned on the trace's steps."""

    rps: tuple[float, ...]
    prompt_tokens: tuple[float, ...]
    output_tokens: tuple[float, ...]


@dataclass(frozen=True)
class Trace:
    """Demand of every model, step by step: `steps` steps of `step_s` seconds from `start`
    (unix seconds, on a step). The formats read and written here are per minute (step 60);
    `resample` makes a finer trace for a simulation in seconds."""

    start: float
    steps: int
    series: dict[str, Series] = field(default_factory=dict)
    step_s: float = 60.0

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self.series)

    @property
    def minutes(self) -> float:
        """The trace's length in minutes (a whole number for per-minute traces)."""
        return self.steps * self.step_s / 60.0

    def timestamp(self, step: int) -> float:
        return self.start + self.step_s * step


#: How a trace is made finer (`resample`): each step's value held through it, or drawn
#: linearly between the steps' centres.
RESAMPLE_HOW = ("hold", "linear")


def resample(trace: Trace, step_s: float, how: str = "hold") -> Trace:
    """`trace` at another step, stated by `how` for a finer one.

    Finer (`trace.step_s` a multiple of `step_s`): each step split in equal steps. `hold`
    keeps a step's mean (requests/s, tokens per request) through it, a staircase; `linear`
    draws each series linearly between the centres of the trace's steps (held before the
    first centre and after the last), which keeps a ramp a ramp instead of a staircase.
    Coarser (`step_s` a multiple of `trace.step_s`, a trace recorded every 10 s simulated by
    the minute): the mean request rate of the steps merged, their tokens per request weighed
    by their requests. The same trace back when the step does not change."""
    if how not in RESAMPLE_HOW:
        raise ConfigError(f"resampling {how!r}: one of {', '.join(RESAMPLE_HOW)}")
    if step_s == trace.step_s:
        return trace
    if step_s > 0 and step_s > trace.step_s:
        return _coarser(trace, step_s)
    ratio = trace.step_s / step_s if step_s > 0 else 0.0
    if abs(ratio - round(ratio)) > 1e-9 or round(ratio) < 1:
        raise ConfigError(f"a step of {step_s:g} s does not divide the trace's {trace.step_s:g} s "
                          "steps (a divisor of 60: 1, 2, 5, 10, 15, 20, 30 or 60)")
    k = round(ratio)

    def finer(values: tuple[float, ...]) -> tuple[float, ...]:
        if how == "hold":
            return tuple(v for v in values for _ in range(k))
        out = []
        last = len(values) - 1
        for i in range(len(values) * k):
            x = (i + 0.5) / k - 0.5  # this fine step's centre, in the trace's steps
            lo = min(last, max(0, math.floor(x)))
            hi = min(last, lo + 1)
            frac = min(1.0, max(0.0, x - lo))
            out.append(values[lo] + (values[hi] - values[lo]) * frac)
        return tuple(out)

    series = {m: Series(finer(s.rps), finer(s.prompt_tokens), finer(s.output_tokens))
              for m, s in trace.series.items()}
    return Trace(start=trace.start, steps=trace.steps * k, series=series, step_s=step_s)


#: How requests arrive within a step (`with_arrivals`): at the trace's mean rate, or as a
#: Poisson process around it (what an engine's counters show over a short window).
ARRIVALS = ("mean", "poisson")


def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw: Knuth's product of uniforms for small means, the normal beyond."""
    if lam <= 0:
        return 0
    if lam > 60:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, product = math.exp(-lam), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


def with_arrivals(trace: Trace, arrivals: str, seed: int = 1) -> Trace:
    """`trace` with each step's request rate drawn as a Poisson count over the step (seeded):
    at 0.2 requests/s a 10 s step sees 0, 1, 2 or more requests, never 2 exactly, and a
    planner must not lend and reclaim on that noise. `mean` leaves the trace as it is."""
    if arrivals not in ARRIVALS:
        raise ConfigError(f"arrivals {arrivals!r}: one of {', '.join(ARRIVALS)}")
    if arrivals == "mean":
        return trace
    rng = random.Random(seed)
    series = {}
    for model, one in trace.series.items():
        rps = tuple(_poisson(rng, r * trace.step_s) / trace.step_s for r in one.rps)
        series[model] = Series(rps, one.prompt_tokens, one.output_tokens)
    return Trace(start=trace.start, steps=trace.steps, series=series, step_s=trace.step_s)


def _per_request(values: tuple[float, ...], rps: tuple[float, ...], part: range,
                 requests: float) -> float:
    """Tokens per request over the steps of `part`, weighed by their requests."""
    if requests > 0:
        return sum(values[j] * rps[j] for j in part) / requests
    return sum(values[j] for j in part) / len(part)


def _coarser(trace: Trace, step_s: float) -> Trace:
    ratio = step_s / trace.step_s
    if abs(ratio - round(ratio)) > 1e-9:
        raise ConfigError(f"a step of {step_s:g} s is not a whole number of the trace's "
                          f"{trace.step_s:g} s steps")
    k = round(ratio)
    steps = -(-trace.steps // k)  # a last, partial step is the mean of what it has
    series = {}
    for model, one in trace.series.items():
        rps, prompt, output = [], [], []
        for i in range(steps):
            part = range(i * k, min(trace.steps, (i + 1) * k))
            requests = sum(one.rps[j] for j in part)
            rps.append(requests / len(part))
            prompt.append(_per_request(one.prompt_tokens, one.rps, part, requests))
            output.append(_per_request(one.output_tokens, one.rps, part, requests))
        series[model] = Series(tuple(rps), tuple(prompt), tuple(output))
    return Trace(start=trace.start, steps=steps, series=series, step_s=step_s)


def iso_minute(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str, where: str) -> float:
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"{where}: timestamp {text!r} is not ISO 8601") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _number(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: {text!r} must be a finite number >= 0")
    return value


def _build(rows: dict[str, dict[int, tuple[float, float, float]]], source: str,
           step_s: int = 60) -> Trace:
    """A trace from rows keyed by step number (unix seconds // step_s); steps without a row
    have no traffic."""
    seen = [m for per in rows.values() for m in per]
    if not seen:
        raise ConfigError(f"{source}: the trace has no rows")
    first, last = min(seen), max(seen)
    count = last - first + 1
    series = {}
    for model, per in rows.items():
        values = [per.get(first + i, (0.0, 0.0, 0.0)) for i in range(count)]
        series[model] = Series(
            tuple(v[0] for v in values), tuple(v[1] for v in values), tuple(v[2] for v in values)
        )
    return Trace(start=first * float(step_s), steps=count, series=series, step_s=step_s)


#: The steps a CSV trace may be recorded at: a divisor of 60 s, or whole minutes (60).
TRACE_STEPS = (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60)


def trace_step(stamps: Iterable[float], source: str) -> int:
    """The step a trace was recorded at: the largest of TRACE_STEPS that every timestamp
    (whole seconds) falls on; 60 for a per-minute trace."""
    seconds = {round(t) for t in stamps}
    for step in reversed(TRACE_STEPS):
        if all(t % step == 0 for t in seconds):
            return step
    raise ConfigError(f"{source}: timestamps are not on a common step of whole seconds")


def parse_csv_trace(text: str, source: str = "<trace>") -> Trace:
    """The slurm-idle CSV format: a row per step and model, the step being whatever the
    timestamps fall on (a minute, or 10 s: trace_step); rates are the step's means."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != CSV_HEADER:
        raise ConfigError(f"{source}: header must be {','.join(CSV_HEADER)}")
    stamped: list[tuple[float, str, tuple[float, float, float]]] = []
    for lineno, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        where = f"{source}, line {lineno}"
        if len(row) != len(CSV_HEADER):
            raise ConfigError(f"{where}: expected {len(CSV_HEADER)} columns, got {len(row)}")
        ts = _parse_time(row[0], where)
        model = row[1].strip()
        if not model:
            raise ConfigError(f"{where}: empty model name")
        stamped.append((ts, model, (_number(row[2], where), _number(row[3], where),
                                    _number(row[4], where))))
    step = trace_step((ts for ts, _, _ in stamped), source) if stamped else 60
    rows: dict[str, dict[int, tuple[float, float, float]]] = {}
    for ts, model, values in stamped:
        rows.setdefault(model, {})[int(round(ts) // step)] = values
    return _build(rows, source, step)


def parse_azure_trace(lines: Iterable[str], model: str, source: str = "<trace>",
                      step_s: int = 60) -> Trace:
    """Per-request Azure LLM trace rows, aggregated into means per `step_s` (a minute by
    default; the simulation's step when it is finer) for `model`."""
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header[:3]) != AZURE_HEADER:
        raise ConfigError(f"{source}: header must start with {','.join(AZURE_HEADER)}")
    acc: dict[int, list[float]] = {}
    for lineno, row in enumerate(reader, start=2):
        if not row:
            continue
        where = f"{source}, line {lineno}"
        if len(row) < 3:
            raise ConfigError(f"{where}: expected {len(AZURE_HEADER)} columns, got {len(row)}")
        step = int(_parse_time(row[0], where) // step_s)
        slot = acc.setdefault(step, [0.0, 0.0, 0.0])
        slot[0] += 1
        slot[1] += _number(row[1], where)
        slot[2] += _number(row[2], where)
    per = {m: (n / step_s, p / n, o / n) for m, (n, p, o) in acc.items()}
    return _build({model: per}, source, step_s)


def read_trace(path: str | Path, azure_model: str = "azure", step_s: int = 60) -> Trace:
    """Read a trace file, telling the two formats apart by their header (`step_s`: what a
    per-request Azure trace is aggregated to)."""
    p = Path(path)
    try:
        with p.open(newline="") as handle:
            head = handle.readline()
            if head.startswith("TIMESTAMP"):
                handle.seek(0)
                return parse_azure_trace(handle, azure_model, source=str(p), step_s=step_s)
            handle.seek(0)
            return parse_csv_trace(handle.read(), source=str(p))
    except FileNotFoundError:
        raise ConfigError(f"{p}: trace file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read trace: {exc.strerror}") from None


def format_trace(trace: Trace) -> str:
    """The trace as slurm-idle CSV text, a row per step and model."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for minute in range(trace.steps):
        stamp = iso_minute(trace.timestamp(minute))  # to the second
        for model, s in trace.series.items():
            writer.writerow(
                [stamp, model, f"{s.rps[minute]:.4f}", f"{s.prompt_tokens[minute]:.1f}",
                 f"{s.output_tokens[minute]:.1f}"]
            )
    return out.getvalue()


# --- synthetic traces -------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticModel:
    """The shape of one model's traffic in a synthetic trace."""

    name: str = "llama-70b"
    peak_rps: float = 60.0  # weekday afternoon mean
    night_fraction: float = 0.18  # night level as a fraction of the weekday peak
    weekend_fraction: float = 0.55  # weekend daytime level as a fraction of the weekday one
    prompt_tokens: float = 1500.0
    output_tokens: float = 300.0
    day_sigma: float = 0.05  # day-to-day level change (log-normal)
    noise_sigma: float = 0.02  # minute-to-minute noise (log-normal, partly persistent)
    bursts_per_week: float = 0.0  # unannounced surges
    burst_factor: tuple[float, float] = (1.4, 2.2)
    burst_minutes: tuple[int, int] = (10, 60)


def _logistic(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _daily_shape(hour: float) -> float:
    """0 at night, 1 in the afternoon: a morning ramp ~07-10h, an evening decline ~18-23h."""
    up = _logistic((hour - 8.5) / 0.7)
    down = _logistic((20.5 - hour) / 1.1)
    lunch = 1.0 - 0.08 * math.exp(-(((hour - 12.75) / 0.6) ** 2))
    return up * down * lunch


def synthetic_trace(
    days: int = 14,
    models: Sequence[SyntheticModel] = (SyntheticModel(),),
    seed: int = 1,
    start: str = "2025-01-06T00:00:00Z",
) -> Trace:
    """A seeded per-minute trace (the default start is a Monday, 00:00 UTC)."""
    rng = random.Random(seed)
    t0 = _parse_time(start, "start")
    t0 -= t0 % 60
    minutes = days * 1440
    series = {}
    for spec in models:
        day_levels = [math.exp(rng.gauss(0.0, spec.day_sigma)) for _ in range(days + 1)]
        bursts: list[tuple[int, int, float]] = []
        expected = spec.bursts_per_week * days / 7.0
        count = int(expected) + (1 if rng.random() < expected - int(expected) else 0)
        for _ in range(count):
            at = rng.randrange(minutes)
            bursts.append((at, at + rng.randint(*spec.burst_minutes), rng.uniform(*spec.burst_factor)))
        persistent = 0.0
        rps, prompt, output = [], [], []
        for m in range(minutes):
            ts = t0 + 60 * m
            moment = datetime.fromtimestamp(ts, UTC)
            hour = moment.hour + moment.minute / 60.0
            day = m // 1440
            # the level drifts smoothly from one day's value to the next
            frac = (m % 1440) / 1440.0
            level = day_levels[day] * (1 - frac) + day_levels[day + 1] * frac
            weekday = moment.weekday() < 5
            daytime = (1.0 if weekday else spec.weekend_fraction) * (1 - spec.night_fraction)
            base = spec.peak_rps * (spec.night_fraction + daytime * _daily_shape(hour)) * level
            persistent = 0.9 * persistent + rng.gauss(0.0, spec.noise_sigma * math.sqrt(1 - 0.81))
            value = base * math.exp(persistent + rng.gauss(0.0, spec.noise_sigma * 0.5))
            for begin, end, factor in bursts:
                if begin <= m < end:
                    value *= factor
            rps.append(round(value, 4))
            prompt.append(round(spec.prompt_tokens * math.exp(rng.gauss(0.0, 0.01)), 1))
            output.append(round(spec.output_tokens * math.exp(rng.gauss(0.0, 0.01)), 1))
        series[spec.name] = Series(tuple(rps), tuple(prompt), tuple(output))
    return Trace(start=t0, steps=minutes, series=series)
