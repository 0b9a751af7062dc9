"""What the idle pool gave: harvested GPU-hours, preemptions, lost work, reclaim latency, savings.

Pure aggregation over two record streams, so every number is unit-testable:

- accounting runs (`AcctJob`, one per *run* of a job: `sacct --json --duplicates` lists a requeued
  job once per run, the interrupted runs in state PREEMPTED or REQUEUED);
- the agent's journal (slurm_idle/journal.py): `transition` records give lends, reclaims, the
  reclaim latency and each node's phase timeline.

Conventions (documented in `--help` and the README):
- GPU-hours are allocated GPUs (TRES `gres/gpu`) x wall time, clipped to the period and split
  per day at local midnight of the report's timezone. A run still going counts up to `now`.
- A preemption is a run that ended PREEMPTED (Slurm preempted it) or REQUEUED* (the agent's
  reclaim or an admin requeued it); it is counted on the day the run ended. Accounting cannot
  tell the agent's `scontrol requeue` from a job requeueing itself at its time limit (the
  runner's SIGUSR1 checkpoint, `--signal=USR1@warn_s`), so the journal decides first: a
  requeued run on a node the agent was reclaiming (a step into or out of `reclaiming` from the
  run's start to RECLAIM_SLACK_S after its end) is a preemption, whatever its length. Only
  otherwise is a requeued run that lasted its time limit minus TIME_LIMIT_WINDOW_S (the
  default warning plus Slurm's up-to-60-s-early signal) a time-limit requeue: not a
  preemption, and no work lost.
- Work lost to a preemption is the GPU-hours since the job's last checkpoint. Slurm does not know
  checkpoints, so with `checkpoint_interval_s` set the loss is the run's tail, at most one
  interval long (`min(run, interval)` x GPUs); without it the whole interrupted run is counted as
  lost: an upper bound.
- A lend is a successful `lending -> lent` step (a retirement that was called off, or a lend
  that failed, lent nothing). Reclaim latency runs from the start of a node's successful
  `lent -> reclaiming` step to the end of its next successful `starting -> serving` step, with
  only `reclaiming -> starting` in between (any other step of that node abandons the pending
  reclaim); a latency belongs to the period its reclaim ended in. Percentiles interpolate
  linearly between ranks.
- A node's phase timeline starts at the journal's first record, in the `from` phase of the
  node's first journaled transition; a phase is entered when a step ends with outcome `ok`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from slurm_idle.journal import StepOutcome, TickRecord, TransitionRecord, iso, typed_records
from slurm_idle.model import Phase
from slurm_idle.slurm.protocol import AcctJob

#: Run end states that mean "interrupted and requeued": a preemption for this report.
INTERRUPTED_STATES = frozenset({"PREEMPTED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"})
#: `slurm-idle submit`'s default SIGUSR1 warning before the time limit (jobs.JobSpec.warn_s).
DEFAULT_WARN_S = 120.0
#: Slurm may send `--signal` up to 60 s before it is due (sbatch(1), --signal).
SIGNAL_EARLY_S = 60.0
#: A requeued run this close to its time limit requeued itself there (see time_limit_requeue).
TIME_LIMIT_WINDOW_S = DEFAULT_WARN_S + SIGNAL_EARLY_S
#: A reclaim step journaled this long after a run's end still explains its requeue (clocks of
#: slurmdbd and the agent's host differ a little; the run ends after the requeue was asked).
RECLAIM_SLACK_S = 60.0
#: Steps of the reclaim chain: the agent requeues the lent jobs in them (transitions.py).
RECLAIM_STEPS = frozenset({
    (Phase.LENT.value, Phase.RECLAIMING.value),
    (Phase.UNKNOWN.value, Phase.RECLAIMING.value),
    (Phase.RECLAIMING.value, Phase.STARTING.value),
})
#: Journal outcomes of steps that did nothing (a reclaim step with any other outcome may have
#: requeued jobs before it failed or waited). "dry-run" is no StepOutcome (a dry run journals
#: nothing) but was documented as one: a journal written by hand or by another tool may hold it.
NO_EFFECT_OUTCOMES: frozenset[str] = frozenset({StepOutcome.SKIPPED, "dry-run"})
#: The phase whose GPUs count as lent (schedulable in the idle partition).
LENT_PHASES = frozenset({Phase.LENT.value})

HOUR = 3600.0


@dataclass(frozen=True)
class PhaseInterval:
    """A node was in `phase` from `start` to `end` (unix seconds)."""

    node: str
    phase: str
    start: float
    end: float


@dataclass(frozen=True)
class JournalFacts:
    """What the journal says about the period."""

    lends: int = 0
    reclaims: int = 0
    reclaim_latencies_s: tuple[float, ...] = ()
    intervals: tuple[PhaseInterval, ...] = ()
    ticks: int = 0
    tick_errors: int = 0
    # node -> (start, end) of every reclaim-chain step, any period: who requeued a run.
    reclaim_spans: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class DayRow:
    """One local day of the period."""

    day: date
    gpu_hours: float
    lent_gpu_hours: float
    jobs: int
    preemptions: int
    lost_gpu_hours: float
    savings: float

    def to_json(self) -> dict[str, Any]:
        return {
            "date": self.day.isoformat(),
            "gpu_hours": _r(self.gpu_hours),
            "lent_gpu_hours": _r(self.lent_gpu_hours),
            "jobs": self.jobs,
            "preemptions": self.preemptions,
            "lost_gpu_hours": _r(self.lost_gpu_hours),
            "savings": round(self.savings, 2),
        }


@dataclass(frozen=True)
class JobRow:
    """One job's share of the period."""

    job_id: int
    name: str
    state: str  # state of its latest run
    runs: int
    preemptions: int
    gpus: int
    gpu_hours: float
    lost_gpu_hours: float

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "name": self.name,
            "state": self.state,
            "runs": self.runs,
            "preemptions": self.preemptions,
            "gpus": self.gpus,
            "gpu_hours": _r(self.gpu_hours),
            "lost_gpu_hours": _r(self.lost_gpu_hours),
        }


@dataclass(frozen=True)
class Report:
    """The whole report; `to_json()` is the stable `report --json` shape."""

    since: float
    until: float
    partition: str
    timezone: str
    price_per_gpu_hour: float
    currency: str
    gpu_hours: float
    lent_gpu_hours: float
    jobs: int
    jobs_completed: int
    jobs_requeued: int
    job_runs: int
    preemptions: int
    lost_gpu_hours: float
    lost_work_method: str
    lends: int
    reclaims: int
    reclaim_latency_s_p50: float | None
    reclaim_latency_s_p95: float | None
    reclaim_latencies: int
    phase_hours: Mapping[str, float]
    days: tuple[DayRow, ...]
    per_job: tuple[JobRow, ...]
    hours: tuple[float, ...] = ()  # start of each hour bucket (for the plot)
    used_gpus_per_hour: tuple[float, ...] = ()  # mean GPUs in use by idle jobs in the hour
    lent_gpus_per_hour: tuple[float, ...] = ()  # mean GPUs lent in the hour
    ticks: int = 0
    tick_errors: int = 0
    journal: str | None = None  # the journal read; None when there was none (no lends known)

    @property
    def savings(self) -> float:
        return self.gpu_hours * self.price_per_gpu_hour

    def to_json(self) -> dict[str, Any]:
        return {
            "since": iso(self.since),
            "until": iso(self.until),
            "partition": self.partition,
            "timezone": self.timezone,
            "gpu_hours": _r(self.gpu_hours),
            "lent_gpu_hours": _r(self.lent_gpu_hours),
            "utilisation": _r(self.gpu_hours / self.lent_gpu_hours) if self.lent_gpu_hours else None,
            "jobs": self.jobs,
            "jobs_completed": self.jobs_completed,
            "jobs_requeued": self.jobs_requeued,
            "job_runs": self.job_runs,
            "preemptions": self.preemptions,
            "lost_gpu_hours": _r(self.lost_gpu_hours),
            "lost_work_method": self.lost_work_method,
            "lends": self.lends,
            "reclaims": self.reclaims,
            "reclaim_latency_s_p50": _r(self.reclaim_latency_s_p50),
            "reclaim_latency_s_p95": _r(self.reclaim_latency_s_p95),
            "reclaim_latencies": self.reclaim_latencies,
            "phase_hours": {k: _r(v) for k, v in self.phase_hours.items()},
            "ticks": self.ticks,
            "tick_errors": self.tick_errors,
            "journal": self.journal,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "savings": round(self.savings, 2),
            "currency": self.currency,
            "days": [d.to_json() for d in self.days],
            "per_job": [j.to_json() for j in self.per_job],
        }


# --- the aggregation --------------------------------------------------------------------------


def build_report(
    runs: Iterable[AcctJob],
    journal: Iterable[Mapping[str, Any]],
    *,
    since: float,
    until: float,
    now: float,
    partition: str,
    price_per_gpu_hour: float,
    currency: str,
    timezone: str = "UTC",
    node_gpus: Mapping[str, int] | None = None,
    checkpoint_interval_s: float | None = None,
    journal_path: str | None = None,
) -> Report:
    """Aggregate accounting runs and journal records over [since, until) (pure).

    `now` caps runs and phases still open (a report never counts the future); `node_gpus` gives
    each pool node's GPU count, for the lent GPU-hours; `journal_path` is only reported.
    """
    if until <= since:
        raise ValueError("the report period is empty: --until must be after --since")
    tz = ZoneInfo(timezone)
    horizon = min(until, now)
    mine = [r for r in runs if _in_partition(r, partition) and r.start is not None]
    facts = journal_facts(journal, since=since, until=until, now=now)
    gpus_of = dict(node_gpus or {})

    days = _day_bounds(since, until, tz)
    hours = _hour_bounds(since, until)
    day_gpu_s = [0.0] * len(days)
    day_lent_s = [0.0] * len(days)
    day_jobs: list[set[int]] = [set() for _ in days]
    day_preempt = [0] * len(days)
    day_lost_s = [0.0] * len(days)
    hour_used_s = [0.0] * len(hours)
    hour_lent_s = [0.0] * len(hours)

    jobs_seen: set[int] = set()
    completed: set[int] = set()
    requeued: set[int] = set()
    job_runs = 0
    preemptions = 0
    lost_gpu_s = 0.0
    per_job: dict[int, dict[str, Any]] = {}

    for run in sorted(mine, key=lambda r: (r.job_id, r.start or 0.0)):
        start = float(run.start or 0.0)
        end = float(run.end) if run.end is not None else horizon
        lo, hi = max(start, since), min(end, horizon)
        ended_here = run.end is not None and since <= run.end < until
        if hi <= lo and not ended_here:
            continue
        job_runs += 1
        jobs_seen.add(run.job_id)
        row = per_job.setdefault(
            run.job_id,
            {"name": run.name, "state": run.state, "runs": 0, "preemptions": 0, "gpus": 0,
             "gpu_s": 0.0, "lost_s": 0.0},
        )
        row["runs"] += 1
        row["state"] = run.state
        row["gpus"] = max(row["gpus"], run.gpus)
        for i in _spread(lo, hi, run.gpus, days, day_gpu_s):
            day_jobs[i].add(run.job_id)
        _spread(lo, hi, run.gpus, hours, hour_used_s)
        row["gpu_s"] += max(0.0, hi - lo) * run.gpus
        if not ended_here:
            continue
        assert run.end is not None
        day_index = _bucket(run.end, days)
        if run.state == "COMPLETED":
            completed.add(run.job_id)
        if is_preemption(run, facts.reclaim_spans):
            preemptions += 1
            requeued.add(run.job_id)
            row["preemptions"] += 1
            lost = lost_seconds(run.end - start, checkpoint_interval_s) * run.gpus
            lost_gpu_s += lost
            row["lost_s"] += lost
            if day_index is not None:
                day_preempt[day_index] += 1
                day_lost_s[day_index] += lost

    phase_s: dict[str, float] = {p.value: 0.0 for p in Phase}
    for iv in facts.intervals:
        phase_s[iv.phase] = phase_s.get(iv.phase, 0.0) + (iv.end - iv.start)
        if iv.phase in LENT_PHASES:
            gpus = gpus_of.get(iv.node, 0)
            _spread(iv.start, iv.end, gpus, days, day_lent_s)
            _spread(iv.start, iv.end, gpus, hours, hour_lent_s)

    gpu_hours = sum(day_gpu_s) / HOUR
    day_rows = tuple(
        DayRow(
            day=datetime.fromtimestamp(d0, tz).date(),
            gpu_hours=day_gpu_s[i] / HOUR,
            lent_gpu_hours=day_lent_s[i] / HOUR,
            jobs=len(day_jobs[i]),
            preemptions=day_preempt[i],
            lost_gpu_hours=day_lost_s[i] / HOUR,
            savings=day_gpu_s[i] / HOUR * price_per_gpu_hour,
        )
        for i, (d0, _d1) in enumerate(days)
    )
    job_rows = tuple(
        JobRow(
            job_id=job_id,
            name=row["name"],
            state=row["state"],
            runs=row["runs"],
            preemptions=row["preemptions"],
            gpus=row["gpus"],
            gpu_hours=row["gpu_s"] / HOUR,
            lost_gpu_hours=row["lost_s"] / HOUR,
        )
        for job_id, row in sorted(per_job.items())
    )
    latencies = facts.reclaim_latencies_s
    return Report(
        since=since,
        until=until,
        partition=partition,
        timezone=timezone,
        price_per_gpu_hour=price_per_gpu_hour,
        currency=currency,
        gpu_hours=gpu_hours,
        lent_gpu_hours=sum(day_lent_s) / HOUR,
        jobs=len(jobs_seen),
        jobs_completed=len(completed),
        jobs_requeued=len(requeued),
        job_runs=job_runs,
        preemptions=preemptions,
        lost_gpu_hours=lost_gpu_s / HOUR,
        lost_work_method=(
            f"tail of at most {checkpoint_interval_s:g} s per preempted run"
            if checkpoint_interval_s
            else "whole preempted run (no checkpoint interval configured: upper bound)"
        ),
        lends=facts.lends,
        reclaims=facts.reclaims,
        reclaim_latency_s_p50=percentile(latencies, 50),
        reclaim_latency_s_p95=percentile(latencies, 95),
        reclaim_latencies=len(latencies),
        phase_hours={k: v / HOUR for k, v in phase_s.items()},
        days=day_rows,
        per_job=job_rows,
        hours=tuple(h0 for h0, _ in hours),
        used_gpus_per_hour=tuple(s / HOUR for s in hour_used_s),
        lent_gpus_per_hour=tuple(s / HOUR for s in hour_lent_s),
        ticks=facts.ticks,
        tick_errors=facts.tick_errors,
        journal=journal_path,
    )


def is_preemption(
    run: AcctJob, reclaim_spans: Mapping[str, Sequence[tuple[float, float]]] | None = None
) -> bool:
    """Was this ended run interrupted (see the module docstring): PREEMPTED, or requeued by a
    reclaim the journal shows on its node, or requeued and not at its time limit."""
    if run.state not in INTERRUPTED_STATES:
        return False
    if run.state == "PREEMPTED" or reclaimed_during(run, reclaim_spans or {}):
        return True
    return not time_limit_requeue(run)


def reclaimed_during(run: AcctJob, reclaim_spans: Mapping[str, Sequence[tuple[float, float]]]) -> bool:
    """A reclaim step on one of the run's nodes overlaps the run (up to RECLAIM_SLACK_S after)."""
    if run.start is None or run.end is None:
        return False
    lo, hi = run.start, run.end + RECLAIM_SLACK_S
    return any(s0 <= hi and s1 >= lo for node in run.nodes for s0, s1 in reclaim_spans.get(node, ()))


def time_limit_requeue(run: AcctJob, warn_s: float = DEFAULT_WARN_S) -> bool:
    """A run that requeued itself at its time limit (the runner's SIGUSR1 checkpoint): requeued,
    and it lasted at least its limit minus the warning and Slurm's early-signal slack.

    Only consulted when the journal shows no reclaim of the run's node (is_preemption): an
    admin's `scontrol requeue` in the last TIME_LIMIT_WINDOW_S of a job counts as this.
    """
    if run.state not in INTERRUPTED_STATES or run.state == "PREEMPTED" or not run.time_limit_s:
        return False
    if run.start is None or run.end is None:
        return False
    return run.end - run.start >= run.time_limit_s - (warn_s + SIGNAL_EARLY_S)


def lost_seconds(run_s: float, checkpoint_interval_s: float | None) -> float:
    """Wall time of an interrupted run that must be redone (see the module docstring)."""
    run_s = max(0.0, run_s)
    return min(run_s, checkpoint_interval_s) if checkpoint_interval_s else run_s


def journal_facts(
    records: Iterable[Mapping[str, Any]], *, since: float, until: float, now: float
) -> JournalFacts:
    """Lends, reclaims, reclaim latencies and phase intervals of [since, until) (pure)."""
    horizon = min(until, now)
    first_ts: float | None = None
    steps: list[tuple[float, float, str, str, str]] = []  # (started, ended, node, from, to)
    spans: dict[str, list[tuple[float, float]]] = {}
    ticks = tick_errors = 0
    for rec in typed_records(records):
        ts = rec.ts
        first_ts = ts if first_ts is None else min(first_ts, ts)
        if isinstance(rec, TickRecord) and since <= ts < until:
            ticks += 1
            tick_errors += 1 if rec.failed else 0
        if not isinstance(rec, TransitionRecord):
            continue
        node, src, dst = rec.node, rec.from_phase, rec.to_phase
        ended = ts + rec.duration_s
        if (src, dst) in RECLAIM_STEPS and rec.outcome not in NO_EFFECT_OUTCOMES:
            spans.setdefault(node, []).append((ts, ended))
        if rec.outcome == StepOutcome.OK:
            steps.append((ts, ended, node, src, dst))
    steps.sort(key=lambda s: s[1])

    lends = reclaims = 0
    latencies: list[float] = []
    reclaim_started: dict[str, float] = {}
    current: dict[str, tuple[str, float]] = {}  # node -> (phase, since)
    intervals: list[PhaseInterval] = []

    def close(node: str, phase: str, start: float, end: float) -> None:
        lo, hi = max(start, since), min(end, horizon)
        if hi > lo:
            intervals.append(PhaseInterval(node, phase, lo, hi))

    for started, ended, node, src, dst in steps:
        if node in current:
            phase, entered = current[node]
            close(node, phase, entered, ended)
        else:
            close(node, src, first_ts if first_ts is not None else started, ended)
        current[node] = (dst, ended)
        in_period = since <= started < until
        if src == Phase.LENDING and dst == Phase.LENT and in_period:
            lends += 1
        if src == Phase.LENT and dst == Phase.RECLAIMING:
            reclaims += 1 if in_period else 0
            reclaim_started[node] = started  # a newer reclaim replaces an abandoned one
        elif src == Phase.RECLAIMING and dst == Phase.STARTING:
            pass  # on the way: the pending reclaim stands
        elif src == Phase.STARTING and dst == Phase.SERVING and node in reclaim_started:
            began = reclaim_started.pop(node)
            if since <= ended < until:
                latencies.append(ended - began)
        else:
            reclaim_started.pop(node, None)  # left the reclaim chain: that reclaim never completed
    for node, (phase, entered) in current.items():
        close(node, phase, entered, horizon)
    return JournalFacts(
        lends=lends,
        reclaims=reclaims,
        reclaim_latencies_s=tuple(latencies),
        intervals=tuple(intervals),
        ticks=ticks,
        tick_errors=tick_errors,
        reclaim_spans={node: tuple(v) for node, v in spans.items()},
    )


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile, linear between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# --- presentation helpers (pure) --------------------------------------------------------------


CSV_COLUMNS = ("date", "gpu_hours", "lent_gpu_hours", "jobs", "preemptions", "lost_gpu_hours",
               "savings")


def csv_rows(report: Report) -> list[dict[str, Any]]:
    """The per-day table as CSV rows (plus a `total` row)."""
    rows = [d.to_json() for d in report.days]
    rows.append(
        {
            "date": "total",
            "gpu_hours": _r(report.gpu_hours),
            "lent_gpu_hours": _r(report.lent_gpu_hours),
            "jobs": report.jobs,
            "preemptions": report.preemptions,
            "lost_gpu_hours": _r(report.lost_gpu_hours),
            "savings": round(report.savings, 2),
        }
    )
    return rows


def render_text(report: Report) -> str:
    """The human-readable report."""
    p50, p95 = report.reclaim_latency_s_p50, report.reclaim_latency_s_p95
    latency = f"{p50:.1f} s / {p95:.1f} s" if p50 is not None and p95 is not None else "n/a"
    phases = ", ".join(f"{k} {v:.1f}" for k, v in report.phase_hours.items() if v) or "n/a"
    cur = report.currency
    lines = [
        (f"slurm-idle report {iso(report.since)} .. {iso(report.until)} "
         f"(partition {report.partition}, days in {report.timezone})"),
        "",
        (f"  GPU-hours used by idle jobs  {report.gpu_hours:12.2f}"
         f"   (lent: {report.lent_gpu_hours:.2f} GPU-h)"),
        (f"  saved                        {report.savings:12.2f} {cur}"
         f"   (at {report.price_per_gpu_hour:g} {cur}/GPU-h)"),
        (f"  jobs                         {report.jobs:12d}   completed {report.jobs_completed},"
         f" requeued {report.jobs_requeued}, runs {report.job_runs}"),
        (f"  preemptions                  {report.preemptions:12d}"
         f"   work lost {report.lost_gpu_hours:.2f} GPU-h ({report.lost_work_method})"),
        f"  lends / reclaims             {report.lends:5d} / {report.reclaims:<5d}",
        (f"  reclaim latency p50 / p95    {latency}"
         f"   ({report.reclaim_latencies} reclaims completed)"),
        f"  node-hours per phase         {phases}",
        f"  journal                      {report.journal or 'none: lends, reclaims, lent GPU-h unknown'}",
        "",
        (f"  {'date':<12}{'GPU-h':>10}{'lent GPU-h':>12}{'jobs':>6}{'preempt':>9}"
         f"{'lost GPU-h':>12}{'saved':>12}"),
    ]
    for d in report.days:
        lines.append(
            f"  {d.day.isoformat():<12}{d.gpu_hours:>10.2f}{d.lent_gpu_hours:>12.2f}{d.jobs:>6d}"
            f"{d.preemptions:>9d}{d.lost_gpu_hours:>12.2f}{d.savings:>12.2f}"
        )
    return "\n".join(lines)


# --- small helpers ------------------------------------------------------------------------------


def _in_partition(run: AcctJob, partition: str) -> bool:
    return partition in run.partition.split(",")


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _bucket(ts: float, bounds: Sequence[tuple[float, float]]) -> int | None:
    """Index of the [start, end) bucket holding ts (buckets sorted, contiguous)."""
    i = bisect_right(bounds, (ts, math.inf)) - 1
    return i if 0 <= i < len(bounds) and bounds[i][0] <= ts < bounds[i][1] else None


def _spread(
    lo: float, hi: float, weight: float, bounds: Sequence[tuple[float, float]], acc: list[float]
) -> list[int]:
    """Add weight x overlap of [lo, hi) to each bucket it touches; return their indices."""
    touched: list[int] = []
    if hi <= lo:
        return touched
    i = max(0, bisect_right(bounds, (lo, math.inf)) - 1)
    while i < len(bounds) and bounds[i][0] < hi:
        overlap = _overlap(lo, hi, *bounds[i])
        if overlap > 0:
            acc[i] += overlap * weight
            touched.append(i)
        i += 1
    return touched


def _day_bounds(since: float, until: float, tz: ZoneInfo) -> list[tuple[float, float]]:
    """[start, end) of every local day touching the period, clipped to it (DST-safe)."""
    bounds: list[tuple[float, float]] = []
    day = datetime.fromtimestamp(since, tz).date()
    while True:
        d0 = datetime.combine(day, datetime.min.time(), tz).timestamp()
        d1 = datetime.combine(day + timedelta(days=1), datetime.min.time(), tz).timestamp()
        lo, hi = max(d0, since), min(d1, until)
        if lo >= until:
            break
        if hi > lo:
            bounds.append((lo, hi))
        day += timedelta(days=1)
    return bounds


def _hour_bounds(since: float, until: float) -> list[tuple[float, float]]:
    start = math.floor(since / HOUR) * HOUR
    bounds = []
    h = start
    while h < until:
        bounds.append((h, h + HOUR))
        h += HOUR
    return bounds


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)

