"""What the idle pool gave: harvested GPU-hours, preemptions, lost work, reclaim latency, savings.

Pure aggregation over two record streams, so every number is unit-testable:

- accounting runs (`AcctJob`, one per *run* of a job: `sacct --json --duplicates` lists a requeued
  job once per run, the interrupted runs in state PREEMPTED or REQUEUED);
- the agent's journal (slurm_idle/journal.py): `transition` records give lends, reclaims, the
  reclaim latency and each node's phase timeline.

Conventions (documented in `--help` and docs/admin.md):
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
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from slurm_idle.journal import StepOutcome, TickRecord, TransitionRecord, typed_records
from slurm_idle.lifecycle import arriving_phases
from slurm_idle.model import Phase
from slurm_idle.report_model import DayRow, JobRow, Period, Report, ReportSettings
from slurm_idle.slurm.protocol import AcctJob
from slurm_idle.timebuckets import HOUR, bucket_of, day_bounds, hour_bounds, overlaps

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


# --- the aggregation --------------------------------------------------------------------------


@dataclass
class _Day:
    """One local day's sums, in GPU-seconds."""

    start: float
    gpu_s: float = 0.0
    lent_gpu_s: float = 0.0
    jobs: set[int] = field(default_factory=set)
    preemptions: int = 0
    lost_gpu_s: float = 0.0


@dataclass
class _Hour:
    """One hour's sums, in GPU-seconds (for the plot)."""

    start: float
    used_gpu_s: float = 0.0
    lent_gpu_s: float = 0.0


@dataclass
class _Job:
    """One job's sums over its runs in the period."""

    name: str
    state: str
    runs: int = 0
    preemptions: int = 0
    gpus: int = 0
    gpu_s: float = 0.0
    lost_gpu_s: float = 0.0

    def row(self, job_id: int) -> JobRow:
        return JobRow(job_id=job_id, name=self.name, state=self.state, runs=self.runs,
                      preemptions=self.preemptions, gpus=self.gpus, gpu_hours=self.gpu_s / HOUR,
                      lost_gpu_hours=self.lost_gpu_s / HOUR)


class _Tally:
    """The sums build_report fills: per day, per hour, per job, and what only counts once."""

    def __init__(self, period: Period, settings: ReportSettings, facts: JournalFacts) -> None:
        self.period, self.settings, self.facts = period, settings, facts
        self.tz = ZoneInfo(period.timezone)
        self.day_bounds = day_bounds(period.since, period.until, self.tz)
        self.hour_bounds = hour_bounds(period.since, period.until)
        self.days = [_Day(lo) for lo, _ in self.day_bounds]
        self.hours = [_Hour(lo) for lo, _ in self.hour_bounds]
        self.jobs: dict[int, _Job] = {}
        self.completed: set[int] = set()
        self.requeued: set[int] = set()
        self.runs = self.preemptions = 0

    def add_run(self, run: AcctJob) -> None:
        """A run's GPU time where it falls; if it ended in the period, how it ended."""
        start = float(run.start or 0.0)
        end = float(run.end) if run.end is not None else self.period.horizon
        lo, hi = max(start, self.period.since), min(end, self.period.horizon)
        ended_here = run.end is not None and self.period.since <= run.end < self.period.until
        if hi <= lo and not ended_here:
            return
        self.runs += 1
        job = self.jobs.setdefault(run.job_id, _Job(run.name, run.state))
        job.runs += 1
        job.state = run.state
        job.gpus = max(job.gpus, run.gpus)
        for i, seconds in overlaps(lo, hi, self.day_bounds):
            self.days[i].gpu_s += seconds * run.gpus
            self.days[i].jobs.add(run.job_id)
        for i, seconds in overlaps(lo, hi, self.hour_bounds):
            self.hours[i].used_gpu_s += seconds * run.gpus
        job.gpu_s += max(0.0, hi - lo) * run.gpus
        if run.end is None or not ended_here:
            return
        if run.state == "COMPLETED":
            self.completed.add(run.job_id)
        if is_preemption(run, self.facts.reclaim_spans):
            lost = lost_seconds(run.end - start, self.settings.checkpoint_interval_s) * run.gpus
            self.preemptions += 1
            self.requeued.add(run.job_id)
            job.preemptions += 1
            job.lost_gpu_s += lost
            day = bucket_of(run.end, self.day_bounds)
            if day is not None:
                self.days[day].preemptions += 1
                self.days[day].lost_gpu_s += lost

    def add_lent(self, iv: PhaseInterval) -> None:
        """A lent interval's GPUs (the node's, or its lend group's) where it falls."""
        gpus = self.settings.node_gpus.get(iv.node, 0)
        for i, seconds in overlaps(iv.start, iv.end, self.day_bounds):
            self.days[i].lent_gpu_s += seconds * gpus
        for i, seconds in overlaps(iv.start, iv.end, self.hour_bounds):
            self.hours[i].lent_gpu_s += seconds * gpus

    def day_rows(self) -> tuple[DayRow, ...]:
        price = self.settings.price_per_gpu_hour
        return tuple(
            DayRow(day=datetime.fromtimestamp(d.start, self.tz).date(), gpu_hours=d.gpu_s / HOUR,
                   lent_gpu_hours=d.lent_gpu_s / HOUR, jobs=len(d.jobs), preemptions=d.preemptions,
                   lost_gpu_hours=d.lost_gpu_s / HOUR, savings=d.gpu_s / HOUR * price)
            for d in self.days
        )


def build_report(
    runs: Iterable[AcctJob],
    journal: Iterable[Mapping[str, Any]],
    period: Period,
    settings: ReportSettings,
    journal_path: str | None = None,
    phases_before: Mapping[str, str] | None = None,
) -> Report:
    """Aggregate accounting runs and journal records over the period (pure); `journal_path`
    is only reported, `phases_before` as in journal_facts."""
    facts = journal_facts(journal, since=period.since, until=period.until, now=period.now,
                          phases_before=phases_before)
    tally = _Tally(period, settings, facts)
    mine = [r for r in runs if _in_partition(r, settings.partition) and r.start is not None]
    for run in sorted(mine, key=lambda r: (r.job_id, r.start or 0.0)):
        tally.add_run(run)
    phase_s: dict[str, float] = {p.value: 0.0 for p in Phase}
    for iv in facts.intervals:
        phase_s[iv.phase] = phase_s.get(iv.phase, 0.0) + (iv.end - iv.start)
        if iv.phase in LENT_PHASES:
            tally.add_lent(iv)
    latencies = facts.reclaim_latencies_s
    return Report(
        since=period.since, until=period.until, partition=settings.partition,
        timezone=period.timezone, price_per_gpu_hour=settings.price_per_gpu_hour,
        currency=settings.currency,
        gpu_hours=sum(d.gpu_s for d in tally.days) / HOUR,
        lent_gpu_hours=sum(d.lent_gpu_s for d in tally.days) / HOUR,
        jobs=len(tally.jobs), jobs_completed=len(tally.completed),
        jobs_requeued=len(tally.requeued), job_runs=tally.runs, preemptions=tally.preemptions,
        lost_gpu_hours=sum(j.lost_gpu_s for j in tally.jobs.values()) / HOUR,
        lost_work_method=settings.lost_work_method,
        lends=facts.lends, reclaims=facts.reclaims,
        reclaim_latency_s_p50=percentile(latencies, 50),
        reclaim_latency_s_p95=percentile(latencies, 95),
        reclaim_latencies=len(latencies),
        phase_hours={k: v / HOUR for k, v in phase_s.items()},
        days=tally.day_rows(),
        per_job=tuple(job.row(job_id) for job_id, job in sorted(tally.jobs.items())),
        hours=tuple(h.start for h in tally.hours),
        used_gpus_per_hour=tuple(h.used_gpu_s / HOUR for h in tally.hours),
        lent_gpus_per_hour=tuple(h.lent_gpu_s / HOUR for h in tally.hours),
        ticks=facts.ticks, tick_errors=facts.tick_errors, journal=journal_path,
    )


def inference_gpu_hours(runs: Iterable[AcctJob], names: Collection[str], since: float,
                        horizon: float) -> float:
    """GPU-hours in [since, horizon) of the runs named as our replica jobs (`names`:
    replicajobs.job_name of every replica; sacct keeps a job's name, its Comment only with
    AccountingStoreFlags=job_comment)."""
    total = 0.0
    for run in runs:
        if run.name in names and run.start is not None:
            end = run.end if run.end is not None else horizon
            total += max(0.0, min(end, horizon) - max(run.start, since)) * run.gpus
    return total / HOUR


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
    records: Iterable[Mapping[str, Any]], *, since: float, until: float, now: float,
    phases_before: Mapping[str, str] | None = None,
) -> JournalFacts:
    """Lends, reclaims, reclaim latencies and phase intervals of [since, until) (pure).

    `records` may begin anywhere before `since` (report_io.window_records reads from a day
    before it): a node's phase before its first step there is that step's source, and
    `phases_before` gives the phase of a node with no step in `records` at all (where its last
    step before them left it). A reclaim begun more than that day before the period and
    completed inside it has no latency counted."""
    horizon = min(until, now)
    first_ts: float | None = None
    steps: list[tuple[float, float, str, str, str]] = []  # (started, ended, node, from, to)
    spans: dict[str, list[tuple[float, float]]] = {}
    ticks = tick_errors = 0
    for rec in typed_records(records):
        ts = rec.ts
        first_ts = ts if first_ts is None else min(first_ts, ts)
        if isinstance(rec, TickRecord):
            ticks += rec.ticks_in(since, until)  # a run of idle ticks counts each of them
            tick_errors += 1 if rec.failed and since <= ts < until else 0
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
    arriving = {p.value for p in arriving_phases()}
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
        elif src in arriving and dst in arriving:
            pass  # on the way (reclaiming, held, starting): the pending reclaim stands
        elif src == Phase.STARTING and dst == Phase.SERVING and node in reclaim_started:
            began = reclaim_started.pop(node)
            if since <= ended < until:
                latencies.append(ended - began)
        else:
            reclaim_started.pop(node, None)  # left the reclaim chain: that reclaim never completed
    for node, (phase, entered) in current.items():
        close(node, phase, entered, horizon)
    for node, phase in (phases_before or {}).items():
        if node not in current:
            close(node, phase, since, horizon)
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


# --- small helpers ------------------------------------------------------------------------------


def _in_partition(run: AcctJob, partition: str) -> bool:
    return partition in run.partition.split(",")
