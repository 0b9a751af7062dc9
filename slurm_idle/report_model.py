"""The report as values: its inputs (`Period`, `ReportSettings`), the result (`Report`, one
`DayRow` per local day, one `JobRow` per job) and its presentations: the stable `report --json`
shape, the CSV rows and the text. report.py builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from slurm_idle.journal import iso


@dataclass(frozen=True)
class Period:
    """The report's period [since, until), its days in `timezone`, seen at `now`: runs and
    phases still open count up to `now` (a report never counts the future)."""

    since: float
    until: float
    now: float
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        if self.until <= self.since:
            raise ValueError("the report period is empty: --until must be after --since")

    @property
    def horizon(self) -> float:
        return min(self.until, self.now)


@dataclass(frozen=True)
class ReportSettings:
    """What the site says: the lend partition, the price, each lent node's GPUs (the journal
    names a lend group by its key node) and the checkpoint interval (lost work)."""

    partition: str
    price_per_gpu_hour: float
    currency: str
    node_gpus: Mapping[str, int] = field(default_factory=dict)
    checkpoint_interval_s: float | None = None

    @property
    def lost_work_method(self) -> str:
        if self.checkpoint_interval_s:
            return f"tail of at most {self.checkpoint_interval_s:g} s per preempted run"
        return "whole preempted run (no checkpoint interval configured: upper bound)"


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
    # GPU-hours of the replica jobs of `placement: jobs` models (sacct, serve partition);
    # None without such a model.
    inference_gpu_hours: float | None = None

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
            "inference_gpu_hours": _r(self.inference_gpu_hours),
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "savings": round(self.savings, 2),
            "currency": self.currency,
            "days": [d.to_json() for d in self.days],
            "per_job": [j.to_json() for j in self.per_job],
        }


# --- presentations (pure) --------------------------------------------------------------------


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
        *([(f"  GPU-hours of replica jobs    {report.inference_gpu_hours:12.2f}   (inference, "
            "placement: jobs)")] if report.inference_gpu_hours is not None else []),
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


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
