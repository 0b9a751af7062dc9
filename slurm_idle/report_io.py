"""The report's inputs and outputs: `sacct` and the journal in, CSV and PNG out.

Kept apart from report.py so the aggregation stays pure. Accounting is read through the Slurm
adapter (`SlurmBackend.accounting`: one `sacct --json --duplicates --allocations` call;
`--duplicates` makes every run of a requeued job a record of its own, which is how preemptions
and lost work are seen at all).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from slurm_idle import safefiles
from slurm_idle.config import Config
from slurm_idle.errors import ConfigError, SlurmIdleError
from slurm_idle.journal import Journal, PhasesRecord, StepOutcome, TransitionRecord, parse_record
from slurm_idle.journal_files import quoted
from slurm_idle.replicajobs import job_name
from slurm_idle.report import build_report, inference_gpu_hours
from slurm_idle.report_model import CSV_COLUMNS, Period, Report, ReportSettings, csv_rows
from slurm_idle.slurm import make_backend
from slurm_idle.slurm.protocol import AcctJob, SlurmBackend


def fetch_runs(
    config: Config, since: float, until: float, slurm: SlurmBackend | None = None,
    partition: str | None = None,
) -> list[AcctJob]:
    """Every run of a lend-partition (or `partition`) job that may overlap [since, until),
    from accounting, through the Slurm adapter (`accounting`: one sacct call; disabled
    accounting says what to configure)."""
    slurm = slurm or make_backend(config)
    return slurm.accounting(since, until, partition or config.slurm.lend_partition)


def fetch_inference_runs(
    config: Config, since: float, until: float, slurm: SlurmBackend | None = None
) -> list[AcctJob]:
    """Runs in the serve partitions of `placement: jobs` models (none without such a model)."""
    from slurm_idle.replicajobs import partition_of

    parts = sorted({partition_of(config, m) for m in config.models if m.job is not None})
    if not parts:
        return []
    slurm = slurm or make_backend(config)
    runs: list[AcctJob] = []
    for part in parts:
        runs += fetch_runs(config, since, until, slurm, partition=part)
    return runs


def make_report(
    config: Config,
    since: float,
    until: float,
    now: float,
    runs: Sequence[AcctJob],
    journal_path: str | None = None,
    slurm_gpus: Mapping[str, int] | None = None,
    inference_runs: Sequence[AcctJob] | None = None,
) -> Report:
    """The report of [since, until) from accounting runs and the configured journal.

    A lent node's GPU-hours count the GPUs Slurm says it has (`slurm_gpus`, its gres: a lent
    8-GPU node with two 4-GPU replicas lends 8), else what the config's replicas use on it; a
    lend group (journaled under its key node) counts the GPUs of all its nodes.

    A missing journal (report run on another host than the tick) is no error, but the report
    then knows no lends, reclaims or lent GPU-hours: its `journal` is None so callers can say so.
    """
    path = Path(journal_path or config.paths.journal)
    journal = Journal(path)
    from slurm_idle.topology import config_node_gpus, lend_groups

    per_node = config_node_gpus(config)
    per_node.update({n: g for n, g in (slurm_gpus or {}).items() if g > 0 and n in per_node})
    # The journal names a lend group by its key node: its GPUs are those of all its nodes.
    node_gpus = {g.name: sum(per_node[n] for n in g.nodes) for g in lend_groups(config)}
    # `placement: jobs`: the journal names a replica job `model#index`, lent with its GPUs.
    jobs_models = [m for m in config.models if m.job is not None]
    node_gpus.update({f"{m.name}#{i}": m.job_gpus_per_replica
                      for m in jobs_models if m.job is not None for i in range(m.job.replicas)})
    settings = ReportSettings(
        partition=config.slurm.lend_partition,
        price_per_gpu_hour=config.report.price_per_gpu_hour,
        currency=config.report.currency,
        node_gpus=node_gpus,
        checkpoint_interval_s=config.report.checkpoint_interval_s,
    )
    period = Period(since, until, now, config.policy.timezone)
    records, before = window_records(journal, since, node_gpus)
    report = build_report(runs, records, period, settings, phases_before=before,
                          journal_path=str(path) if path.exists() else None)
    if not jobs_models:
        return report
    names = {job_name(config.slurm.tag, m.name, i)
             for m in jobs_models if m.job is not None for i in range(m.job.replicas)}
    return replace(report, inference_gpu_hours=inference_gpu_hours(
        inference_runs or (), names, since, min(until, now)))


def window_records(journal: Journal, since: float, nodes: Iterable[str]
                   ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """What report.journal_facts needs of a period from `since` on, without the history
    before it: the records from about a day before `since` (journal_files.forward seeks
    there across rotated files), and for each of `nodes` with no completed step in them, the
    phase its last completed step or the newest day's phases record (journal_snapshots.py)
    gives (read from the end until each is found)."""
    records = list(journal.records(since=since))
    stepped = {r.get("node") for r in records
               if r.get("event") == TransitionRecord.EVENT and r.get("outcome") == StepOutcome.OK}
    missing = set(nodes) - stepped
    before: dict[str, str] = {}
    if missing:
        # Only lines naming a missing node are parsed, and a block naming none is skipped:
        # a node never lent costs one pass of `in` over the history, not a parse of it.
        for rec in journal.newest_first(quoted(missing)):
            parsed = parse_record(rec)
            if isinstance(parsed, PhasesRecord):  # the day's phases (journal_snapshots.py)
                for node in missing & parsed.nodes.keys():
                    before[node] = parsed.nodes[node]
                missing -= parsed.nodes.keys()
            elif (isinstance(parsed, TransitionRecord) and parsed.outcome == StepOutcome.OK
                  and parsed.node in missing):
                before[parsed.node] = parsed.to_phase
                missing.discard(parsed.node)
            if not missing:
                break
    return records, before


#: Formats `--plot` writes (matplotlib's Agg backend), chosen by the file name.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_output_path(path: str, option: str, suffixes: Sequence[str] = ()) -> None:
    """Refuse an output file that cannot be written, before any work is done or any other
    output is written (ConfigError: exit 2)."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{option} {path}: is a directory; give a file name")
    if suffixes and target.suffix.lower() not in suffixes:
        raise ConfigError(f"{option} {path}: the file name must end in {' or '.join(suffixes)}")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: the directory {parent} is not writable")
    safefiles.check_output(path, option)  # no symlink, no other user's directory on the way


def check_plot_ready(path: str) -> None:
    """`--plot` up front: a writable file with a known suffix, and matplotlib installed."""
    check_output_path(path, "--plot", PLOT_SUFFIXES)
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SlurmIdleError(
            "--plot needs matplotlib: pip install 'slurm-idle[plot]' (or apt install python3-matplotlib)"
        ) from None
    return plt


def write_csv(report: Report, path: str) -> None:
    """The per-day table (and a total row) as CSV."""
    try:
        # Never through a symlink or into someone else's file (root running --csv in /tmp).
        with os.fdopen(safefiles.open_output(path, "--csv"), "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(CSV_COLUMNS))
            writer.writeheader()
            for row in csv_rows(report):
                writer.writerow(row)
    except OSError as exc:
        raise SlurmIdleError(f"cannot write {path}: {exc.strerror}") from None


def write_plot(report: Report, path: str) -> None:
    """Lent GPUs and GPUs used by idle jobs, per hour, as a PNG (needs the `plot` extra)."""
    plt = _pyplot()
    import matplotlib.dates as mdates

    tz = ZoneInfo(report.timezone)
    # One more edge than buckets, so the last hour is drawn as a step too.
    edges = [*report.hours, report.hours[-1] + 3600.0] if report.hours else []
    x: list[Any] = [datetime.fromtimestamp(h, tz) for h in edges]
    lent = [*report.lent_gpus_per_hour, *report.lent_gpus_per_hour[-1:]]
    used = [*report.used_gpus_per_hour, *report.used_gpus_per_hour[-1:]]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.fill_between(x, lent, step="post", alpha=0.25, label="lent GPUs")
    ax.step(x, used, where="post", color="C1", label="GPUs used by idle jobs")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("GPUs (hourly mean)")
    ax.set_title(  # rounded as the text report (render_text): 0.03, not 0.0
        f"slurm-idle: {report.gpu_hours:.2f} GPU-h used, "
        f"{report.savings:.2f} {report.currency} saved"
    )
    formatter = mdates.DateFormatter("%m-%d %H:%M", tz=tz)  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_formatter(formatter)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    try:
        fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
        if fmt not in fig.canvas.get_supported_filetypes():
            raise ValueError(f"Format {fmt!r} is not supported")
        with os.fdopen(safefiles.open_output(path, "--plot"), "wb") as fh:
            fig.savefig(fh, dpi=100, format=fmt)
    except OSError as exc:
        raise SlurmIdleError(f"cannot write {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a format matplotlib does not know
        raise ConfigError(f"--plot {path}: {exc}") from None
    finally:
        plt.close(fig)
