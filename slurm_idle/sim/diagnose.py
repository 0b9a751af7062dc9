"""Where a policy's violation minutes and lost harvest come from, per trace (bench-sim-diagnose).

Read from a run's timeline only (serving / starting / lent / reclaiming per model and minute)
against the trace's need, so any policy can be diagnosed and nothing of the planner is copied.

Violations are counted per *run* (consecutive short minutes of one model) and put in one class
by what the fleet was doing when the run began:
- `step`: the need jumped at a 10-minute boundary of a stepped trace (rates held in steps);
- `reclaim late`: a reclaim was already under way (the rise was seen, too late to be met);
- `blip`: no reclaim under way and the run lasted at most 2 minutes (noise around a replica
  boundary: the margin was too thin for one minute);
- `unseen rise`: no reclaim under way and a longer run (a rise no estimate saw coming);
and tagged `after lend` when a replica of that model was lent within the scale-down window
before (the lend itself was wrong).

Harvest lost: the replica-minutes held back from lending (serving + starting + reclaiming
beyond the need) are split per minute into `ahead` (the need within the reclaim lead: what the
oracle holds too), `hysteresis` (the need within the last scale-down window, above both) and
`margin` (the rest: headroom for noise no need ever used); shares of the oracle bound's GPU-h.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurm_idle.sim.engine import SimResult, Simulation

#: Run classes, in the order the table prints them.
CLASSES = ("step", "reclaim late", "blip", "unseen rise")


@dataclass
class Breakdown:
    """One trace's violation runs by class and its held-back GPU-hours by cause."""

    minutes_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    runs_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    after_lend_minutes: int = 0
    held_gpu_h: dict[str, float] = field(
        default_factory=lambda: {"ahead": 0.0, "hysteresis": 0.0, "margin": 0.0})


def breakdown(sim: Simulation, result: SimResult, steps_10min: bool, window_min: int = 15) -> Breakdown:
    """The Breakdown of `result` (a run of `sim`)."""
    out = Breakdown()
    lead = sim.params.reclaim_steps + 1
    for model, rows in result.timeline.items():
        need = sim.need[model]
        gpus = sim.fleet[model].gpus_per_replica
        last_lend = -10**9
        m = 0
        n = len(rows)
        while m < n:
            serving, starting, lent, reclaiming = rows[m]
            if m > 0 and lent > rows[m - 1][2]:
                last_lend = m
            held = serving + starting + reclaiming - need[m]
            if held > 0:
                ahead = max(0, max(need[m: m + lead + 1]) - need[m])
                hyst = max(0, max(need[max(0, m - window_min): m + 1]) - need[m] - ahead)
                a = min(held, ahead)
                h = min(held - a, hyst)
                out.held_gpu_h["ahead"] += a * gpus / 60
                out.held_gpu_h["hysteresis"] += h * gpus / 60
                out.held_gpu_h["margin"] += (held - a - h) * gpus / 60
            if serving >= need[m]:
                m += 1
                continue
            start = m
            while m < n and rows[m][0] < need[m]:
                m += 1
            length = m - start
            jumped = start > 0 and need[start] > need[start - 1]
            if steps_10min and jumped and start % 10 == 0:
                kind = "step"
            elif starting + reclaiming > 0:
                kind = "reclaim late"
            elif length <= 2:
                kind = "blip"
            else:
                kind = "unseen rise"
            out.minutes_by_class[kind] += length
            out.runs_by_class[kind] += 1
            if start - last_lend <= window_min:
                out.after_lend_minutes += length
    return out
