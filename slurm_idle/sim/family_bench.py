"""Run every policy over the trace family and score it per set (tuning / held out).

One row per (member, policy); per set and policy the median and the worst case of the harvest
ratio (against the reclaim-latency-aware oracle bound) and of the violation share (model-minutes
short of capacity over all model-minutes). `goals()` checks issue 15's targets on the held-out
set only: those are the numbers a site can expect on traffic the planner was never tuned on.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_idle.errors import ConfigError
from slurm_idle.safefiles import open_output
from slurm_idle.sim import POLICIES, simulate
from slurm_idle.sim.family import HELD_OUT, TUNING, Member, members, trace

#: Held-out targets (issue 15), with 300 s cold start and 60 s grace.
MAX_SHARE = 0.001  # violation share on a trace without 10-minute steps
MAX_SHARE_STEPS = 0.005  # ... and with them
MIN_HARVEST_MEDIAN = 0.95
MIN_HARVEST_WORST = 0.90

Row = dict[str, Any]


def run(count: int, policies: Sequence[str] = POLICIES, first_seed: int = 1) -> list[Row]:
    """One row per member and policy (`count` members from `first_seed`)."""
    rows: list[Row] = []
    for m in members(count, first_seed):
        load = trace(m)
        for policy in policies:
            started = time.process_time()
            result = simulate(load, m.fleet, m.params, policy)
            rows.append({
                "trace": m.name, "seed": m.seed, "set": m.split, "days": m.days,
                "models": len(m.fleet), "steps_10min": m.steps_10min, "latencies": m.latencies,
                "max_noise": round(m.max_noise, 4), "policy": policy,
                **result.summary(), "cpu_s": round(time.process_time() - started, 2),
            })
    return rows


def stats(rows: Sequence[Row]) -> list[Row]:
    """Per set and policy: median / worst harvest ratio and violation share, over its traces."""
    out: list[Row] = []
    for split in (TUNING, HELD_OUT):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["set"] == split and r["policy"] == policy]
            if not mine:
                continue
            harvest = [float(r["harvest_ratio"]) for r in mine]
            share = [float(r["slo_violation_share"]) for r in mine]
            unserved = [float(r["unserved_share"]) for r in mine]
            flaps = [int(r["flaps"]) for r in mine]
            out.append({
                "set": split, "policy": policy, "traces": len(mine),
                "harvest_median": round(statistics.median(harvest), 4),
                "harvest_worst": round(min(harvest), 4),
                "share_median": round(statistics.median(share), 6),
                "share_worst": round(max(share), 6),
                "violation_model_minutes": sum(r["slo_violation_minutes"] for r in mine),
                "model_minutes": sum(r["model_minutes"] for r in mine),
                "unserved_median": round(statistics.median(unserved), 7),
                "unserved_worst": round(max(unserved), 7),
                "queue_delay_p99_worst_s": max(float(r["queue_delay_p99_s"]) for r in mine),
                "flaps_median": statistics.median(flaps), "flaps_worst": max(flaps),
            })
    return out


def goals(rows: Sequence[Row], policy: str = "slurm-idle") -> list[str]:
    """Issue 15's targets on the held-out set; one line per failure."""
    failures: list[str] = []
    by = {(r["trace"], r["policy"]): r for r in rows}
    held = [r for r in rows if r["set"] == HELD_OUT and r["policy"] == policy]
    for r in held:
        limit = MAX_SHARE_STEPS if r["steps_10min"] else MAX_SHARE
        if r["slo_violation_share"] > limit:
            failures.append(f"{r['trace']}: violation share {r['slo_violation_share']:.3%} > {limit:.1%}")
        reactive = by.get((r["trace"], "reactive"))
        if reactive is not None and r["slo_violation_minutes"] >= max(1, reactive["slo_violation_minutes"]):
            failures.append(f"{r['trace']}: {r['slo_violation_minutes']} violation model-minutes, "
                            f"reactive {reactive['slo_violation_minutes']}")
    if held:
        harvest = [float(r["harvest_ratio"]) for r in held]
        if statistics.median(harvest) < MIN_HARVEST_MEDIAN:
            failures.append(f"held-out median harvest {statistics.median(harvest):.1%} < 95%")
        if min(harvest) < MIN_HARVEST_WORST:
            failures.append(f"held-out worst harvest {min(harvest):.1%} < 90%")
    return failures


def markdown(rows: Sequence[Row], described: Sequence[Member] = ()) -> str:
    """The per-set summary table, then one line per held-out trace."""
    lines = [
        ("| set | policy | traces | harvest median | harvest worst | violation share median "
         "| violation share worst | unserved median | unserved worst | queue p99 worst "
         "| flaps median | flaps worst |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in stats(rows):
        lines.append(
            f"| {s['set']} | {s['policy']} | {s['traces']} | {s['harvest_median']:.1%} "
            f"| {s['harvest_worst']:.1%} | {s['share_median']:.3%} | {s['share_worst']:.3%} "
            f"| {s['unserved_median']:.4%} | {s['unserved_worst']:.4%} "
            f"| {s['queue_delay_p99_worst_s']:.0f} s | {s['flaps_median']:g} "
            f"| {s['flaps_worst']} |"
        )
    lines += ["", ("| trace | set | days | start/grace s | 10-min steps | max noise | slurm-idle harvest "
              "| slurm-idle violations (share) | reactive violations |"),
              "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    by = {(r["trace"], r["policy"]): r for r in rows}
    for (name, policy), r in by.items():
        if policy != "slurm-idle":
            continue
        reactive = by.get((name, "reactive"))
        lines.append(
            f"| {name} | {r['set']} | {r['days']} | {r.get('latencies', '300/60')} "
            f"| {'yes' if r['steps_10min'] else 'no'} "
            f"| {r['max_noise']:.1%} | {float(r['harvest_ratio']):.1%} "
            f"| {r['slo_violation_minutes']} ({float(r['slo_violation_share']):.3%}) "
            f"| {reactive['slo_violation_minutes'] if reactive else '-'} |"
        )
    if described:
        lines += ["", "Members:"] + [f"- `{m.name}` ({m.split}): {m.describe()}" for m in described]
    return "\n".join(lines)


def plot(path: str | Path, rows: Sequence[Row]) -> None:
    """Harvest ratio against violation share, one point per trace, a panel per set."""
    from slurm_idle.sim.output import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True, squeeze=False)
    colours = {"slurm-idle": "tab:blue", "reactive": "tab:red", "night-window": "tab:gray",
               "oracle": "tab:green"}
    for ax, split in zip(axes[0], (TUNING, HELD_OUT), strict=True):
        for policy, colour in colours.items():
            mine = [r for r in rows if r["set"] == split and r["policy"] == policy]
            if not mine:
                continue
            ax.scatter([100 * max(float(r["slo_violation_share"]), 1e-5) for r in mine],
                       [100 * float(r["harvest_ratio"]) for r in mine],
                       label=policy, color=colour, alpha=0.75,
                       marker="s" if policy == "slurm-idle" else "o")
        ax.set_xscale("log")
        ax.axvline(100 * MAX_SHARE, color="black", linestyle=":", linewidth=0.8)
        ax.axhline(100 * MIN_HARVEST_MEDIAN, color="black", linestyle=":", linewidth=0.8)
        ax.set_title(f"{split} set")
        ax.set_xlabel("violation share, % of model-minutes (log; 0 drawn at 0.001%)")
        ax.set_ylabel("harvest, % of the latency-aware oracle")
        ax.legend(loc="lower left")
    fig.tight_layout()
    try:
        with os.fdopen(open_output(path, "--plot"), "wb") as handle:
            fig.savefig(handle, dpi=100, format=Path(path).suffix.lstrip(".").lower() or "png")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the plot: {exc.strerror}") from None
    finally:
        plt.close(fig)
