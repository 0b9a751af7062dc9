"""Pure reading of vLLM /metrics pages and the arithmetic on them (no I/O, no clock).

`parse_page` turns one exposition-format page into one `EngineSnapshot` per (model, engine)
pair. Rates and latency percentiles need two snapshots: `counter_increase` and
`Histogram.since` handle counter resets the way Prometheus' `increase()` does (a counter that
went down restarted from zero), and `histogram_quantile` is Prometheus' own algorithm, so the
direct-scrape path and the Prometheus path report the same numbers for the same traffic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from slurm_idle.metrics import names

DEFAULT_ENGINE = "0"  # servers without the `engine` label (v0 engine) have a single engine


class NotAMetricsPage(ValueError):
    """The text is not a Prometheus exposition page, or has no vLLM metrics in it."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts of one histogram: ((upper_bound, count), ...) by bound, +Inf last."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def since(self, earlier: Histogram | None) -> Histogram:
        """Observations made after `earlier`; a histogram whose count went down was reset."""
        if earlier is None or self.count < earlier.count:
            return self
        before = dict(earlier.buckets)
        return Histogram(tuple((le, max(0.0, n - before.get(le, 0.0))) for le, n in self.buckets))

    def plus(self, other: Histogram) -> Histogram:
        """Bucket-wise sum (data-parallel engines of one server share their bucket bounds)."""
        total: dict[float, float] = dict(self.buckets)
        for le, n in other.buckets:
            total[le] = total.get(le, 0.0) + n
        return Histogram(tuple(sorted(total.items())))

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets; None when there is no data.

    Linear interpolation inside the bucket holding the rank; a rank in the +Inf bucket
    returns the highest finite bound (as Prometheus does).
    """
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    # Buckets scraped at slightly different moments may be non-monotonic; Prometheus fixes that.
    fixed: list[tuple[float, float]] = []
    running_max = 0.0
    for le, n in ordered:
        running_max = max(running_max, n)
        fixed.append((le, running_max))
    observations = fixed[-1][1]
    if observations <= 0:
        return None
    rank = q * observations
    b = next(i for i, (_, n) in enumerate(fixed) if n >= rank)
    if b == len(fixed) - 1:
        return fixed[-2][0]
    if b == 0 and fixed[0][0] <= 0:
        return fixed[0][0]
    start = 0.0 if b == 0 else fixed[b - 1][0]
    end, count = fixed[b]
    if b > 0:
        count -= fixed[b - 1][1]
        rank -= fixed[b - 1][1]
    if count <= 0:
        return end
    return start + (end - start) * (rank / count)


def counter_increase(earlier: float | None, later: float | None) -> float | None:
    """How much a counter grew; a counter that went down restarted from zero."""
    if later is None or earlier is None:
        return None
    if later < earlier:
        return later
    return later - earlier


@dataclass(frozen=True)
class EngineSnapshot:
    """What one scrape says about one engine (one `model_name`/`engine` label pair)."""

    model: str
    engine: str
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    sleep_state: str | None = None  # awake | weights_offloaded | discard_all; None: not exported
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    ttft: Histogram | None = None
    queue_time: Histogram | None = None

    @property
    def sleeping(self) -> bool:
        return self.sleep_state is not None and self.sleep_state != names.SLEEP_AWAKE

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.engine)


@dataclass
class _Acc:
    gauges: dict[str, float] = field(default_factory=dict)
    sleep: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)


def parse_page(text: str) -> list[EngineSnapshot]:
    """Every (model, engine) pair on a vLLM /metrics page, sorted; raises NotAMetricsPage."""
    accs: dict[tuple[str, str], _Acc] = {}
    seen_any = False
    try:
        for family in text_string_to_metric_families(text):
            seen_any = True
            for sample in family.samples:
                if not sample.name.startswith("vllm:"):
                    continue
                _take(accs, sample.name, sample.labels, sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise NotAMetricsPage(f"not a Prometheus metrics page ({exc})") from None
    if not accs:
        if seen_any:
            raise NotAMetricsPage("a metrics page, but with no vllm:* metrics (is this a vLLM server?)")
        raise NotAMetricsPage("not a Prometheus metrics page (no metrics in it)")
    return [_snapshot(key, acc) for key, acc in sorted(accs.items())]


def _take(accs: dict[tuple[str, str], _Acc], name: str, labels: dict[str, str], value: float) -> None:
    key = (labels.get(names.MODEL_LABEL, ""), labels.get(names.ENGINE_LABEL) or DEFAULT_ENGINE)
    if name == names.SLEEP_STATE:
        accs.setdefault(key, _Acc()).sleep[labels.get(names.SLEEP_STATE_LABEL, "")] = value
    elif name in names.GAUGES or name in names.COUNTERS:
        accs.setdefault(key, _Acc()).gauges[name] = value
    elif name.endswith("_bucket") and name[: -len("_bucket")] in names.HISTOGRAMS:
        le = labels.get("le")
        if le is not None:
            hist = accs.setdefault(key, _Acc()).buckets.setdefault(name[: -len("_bucket")], {})
            hist[float(le)] = value


def _snapshot(key: tuple[str, str], acc: _Acc) -> EngineSnapshot:
    g = acc.gauges
    kv = g.get(names.KV_CACHE_USAGE, g.get(names.KV_CACHE_USAGE_LEGACY))
    return EngineSnapshot(
        model=key[0],
        engine=key[1],
        running=g.get(names.RUNNING),
        waiting=g.get(names.WAITING),
        kv_cache_usage=kv,
        sleep_state=sleep_state_of(acc.sleep),
        prompt_tokens_total=g.get(names.PROMPT_TOKENS),
        generation_tokens_total=g.get(names.GENERATION_TOKENS),
        ttft=_hist(acc.buckets.get(names.TTFT)),
        queue_time=_hist(acc.buckets.get(names.QUEUE_TIME)),
    )


def sleep_state_of(values: dict[str, float]) -> str | None:
    """The state whose gauge is 1 (the deepest one if several are); None when not exported."""
    if not values:
        return None
    active = [s for s in names.SLEEP_STATES if values.get(s, 0.0) >= 0.5]
    if not active:
        return None
    return active[-1]


def _hist(buckets: dict[float, float] | None) -> Histogram | None:
    return Histogram(tuple(sorted(buckets.items()))) if buckets else None


@dataclass(frozen=True)
class EngineReading:
    """One engine between two scrapes: the later gauges plus rates and p95s over the interval.

    Rates and percentiles are None when there was no earlier scrape to compare with.
    """

    snapshot: EngineSnapshot
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    ttft: Histogram | None  # observations made during the interval
    queue_time: Histogram | None

    @property
    def ttft_p95_s(self) -> float | None:
        return self.ttft.quantile(0.95) if self.ttft else None

    @property
    def queue_time_p95_s(self) -> float | None:
        return self.queue_time.quantile(0.95) if self.queue_time else None


def read_engines(
    earlier: Iterable[EngineSnapshot] | None, later: Iterable[EngineSnapshot], interval_s: float
) -> list[EngineReading]:
    """Pair each engine of `later` with its earlier self and compute rates over `interval_s`."""
    before = {s.key: s for s in earlier} if earlier is not None else None
    readings = []
    for snap in later:
        prev = before.get(snap.key) if before is not None and interval_s > 0 else None
        if prev is None:  # nothing to compare with: gauges only
            readings.append(EngineReading(snap, None, None, None, None))
            continue
        readings.append(
            EngineReading(
                snapshot=snap,
                prompt_tokens_per_s=_rate(prev.prompt_tokens_total, snap.prompt_tokens_total, interval_s),
                generation_tokens_per_s=_rate(
                    prev.generation_tokens_total, snap.generation_tokens_total, interval_s
                ),
                ttft=snap.ttft.since(prev.ttft) if snap.ttft else None,
                queue_time=snap.queue_time.since(prev.queue_time) if snap.queue_time else None,
            )
        )
    return readings


def _rate(earlier: float | None, later: float | None, interval_s: float) -> float | None:
    inc = counter_increase(earlier, later)
    return None if inc is None else inc / interval_s


@dataclass(frozen=True)
class ServerReading:
    """All engines of one server summed, as the planner sees one replica."""

    model: str
    engines: tuple[str, ...]
    running: float
    waiting: float
    kv_cache_usage: float  # the hottest engine's KV cache
    sleeping: bool  # every engine asleep
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    ttft: Histogram | None  # observations during the interval, all engines
    queue_time: Histogram | None
    complete: bool  # running, waiting and both token rates were all present

    @property
    def ttft_p95_s(self) -> float | None:
        return self.ttft.quantile(0.95) if self.ttft else None

    @property
    def queue_time_p95_s(self) -> float | None:
        return self.queue_time.quantile(0.95) if self.queue_time else None


def sum_engines(readings: Sequence[EngineReading]) -> ServerReading | None:
    """Data-parallel engines of one server summed (gauges, rates and histograms); None if empty."""
    if not readings:
        return None
    snaps = [r.snapshot for r in readings]
    models = sorted({s.model for s in snaps})
    ttft = _sum_hist(r.ttft for r in readings)
    queue = _sum_hist(r.queue_time for r in readings)
    prompt = _sum_opt(r.prompt_tokens_per_s for r in readings)
    gen = _sum_opt(r.generation_tokens_per_s for r in readings)
    running = _sum_opt(s.running for s in snaps)
    waiting = _sum_opt(s.waiting for s in snaps)
    return ServerReading(
        model=",".join(models),
        engines=tuple(s.engine for s in snaps),
        running=running or 0.0,
        waiting=waiting or 0.0,
        kv_cache_usage=max((s.kv_cache_usage or 0.0) for s in snaps),
        sleeping=all(s.sleeping for s in snaps),
        prompt_tokens_per_s=prompt,
        generation_tokens_per_s=gen,
        ttft=ttft,
        queue_time=queue,
        complete=None not in (running, waiting, prompt, gen),
    )


def _sum_opt(values: Iterable[float | None]) -> float | None:
    """Sum, or None if any part is missing (a partial sum would under-report load)."""
    total = 0.0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def sum_histograms(hists: Iterable[Histogram | None]) -> Histogram | None:
    """Bucket-wise sum of the histograms present; None if there are none."""
    return _sum_hist(hists)


def _sum_hist(hists: Iterable[Histogram | None]) -> Histogram | None:
    total: Histogram | None = None
    for h in hists:
        if h is not None:
            total = h if total is None else total.plus(h)
    return total
