"""What a simulation run writes besides its score: the per-minute timeline CSV and a plot.

matplotlib is an optional extra (`pip install slurm-idle[plot]`), imported only when a plot
is asked for, with a clear error when it is missing.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_idle.errors import ConfigError
from slurm_idle.safefiles import open_output
from slurm_idle.sim.engine import FleetModel, SimParams, SimResult
from slurm_idle.traces import Trace, iso_minute

TIMELINE_HEADER = ("timestamp", "model", "serving", "starting", "lent", "reclaiming")


def write_timeline(path: str | Path, trace: Trace, result: SimResult) -> None:
    """One row per step (a minute, or the simulation's step) and model; the four counts sum
    to the model's replicas."""
    try:
        # Never through a user's symlink or directory (root running --timeline in /tmp).
        with os.fdopen(open_output(path, "--timeline"), "w", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(TIMELINE_HEADER)
            for step in range(result.steps):
                stamp = iso_minute(trace.start + result.step_s * step)
                for model, rows in result.timeline.items():
                    writer.writerow([stamp, model, *rows[step]])
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the timeline: {exc.strerror}") from None


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or ConfigError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'slurm-idle[plot]' (or pip install matplotlib)"
        ) from None
    return plt


def plot_run(
    path: str | Path,
    trace: Trace,
    fleet: Sequence[FleetModel],
    params: SimParams,
    result: SimResult,
    policy: str,
) -> None:
    """Load, needed and serving replicas, and lent GPUs over time, one panel per model."""
    plt = pyplot()
    from slurm_idle.sim.engine import Simulation

    sim = Simulation(trace, fleet, params)
    need, trace = sim.need, sim.trace  # at the simulation's step
    hours = [i * trace.step_s / 3600.0 for i in range(trace.steps)]
    fig, axes = plt.subplots(2 * len(fleet), 1, figsize=(14, 6 * len(fleet)), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": [1, 2] * len(fleet)})
    for i, f in enumerate(fleet):
        load_ax, ax = axes[2 * i, 0], axes[2 * i + 1, 0]
        series = trace.series[f.name]
        load_ax.plot(hours, series.rps, color="tab:gray", linewidth=0.7, label="load (requests/s)")
        load_ax.set_ylabel("requests/s")
        load_ax.set_title(f"{f.name} under {policy}")
        load_ax.legend(loc="upper left")
        rows = result.timeline[f.name]
        ax.plot(hours, need[f.name], label="needed replicas", color="tab:red", linewidth=0.8)
        ax.plot(hours, [r[0] for r in rows], label="serving replicas", color="tab:blue", linewidth=0.8)
        ax.set_ylabel("replicas")
        ax.set_xlabel(f"hours since {iso_minute(trace.start)}")
        lent = ax.twinx()
        lent.fill_between(hours, [r[2] * f.gpus_per_replica for r in rows], color="tab:green",
                          alpha=0.25, label="lent GPUs")
        lent.set_ylabel("lent GPUs")
        ax.legend(loc="upper left", framealpha=0.9)
        lent.legend(loc="upper right", framealpha=0.9)
    fig.tight_layout()
    try:
        with os.fdopen(open_output(path, "--plot"), "wb") as handle:
            fig.savefig(handle, dpi=100, format=Path(path).suffix.lstrip(".").lower() or "png")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the plot: {exc.strerror}") from None
    finally:
        plt.close(fig)
