"""`slurm-idle agent`: the tick as a long-running loop, with fast checks in between.

cron starts `tick` once a minute, so a queue that builds at 10:00:05 is acted on at 10:01 at
best. The loop runs the same full tick (same lock, same state in Slurm, same journal) every
`policy.tick_interval_s`, and between two ticks a fast check every `policy.fast_interval_s`:
the same observe and planner, keeping only the reclaims that queue / KV-cache / TTFT pressure,
or a serving replica gone out of service, asks for (policy/fast.py). Each pass takes the lock on
its own, so cron ticks, admin commands and a second agent interleave with it as they do with
each other.

Stopping: `stop` (set by SIGTERM/SIGINT in the CLI) is checked between passes and ends every
wait at once. A pass in flight finishes its current steps, bounded by timeouts.tick_budget_s;
whatever transition it leaves is written in Slurm and carried on by the next tick or agent.
A pass that fails is journaled like a failed tick and the loop goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from slurm_idle.agent import Agent, TickResult
from slurm_idle.logs import get_logger
from slurm_idle.policy.fast import fast_plan

log = get_logger(__name__)


@dataclass
class LoopStats:
    """What the loop did, for its exit line and the tests."""

    ticks: int = 0
    fast_checks: int = 0
    fast_actions: int = 0
    errors: int = 0


def run_loop(
    agent: Agent,
    stop: threading.Event,
    clock: Callable[[], float] = time.monotonic,
    on_pass: Callable[[str, TickResult], None] | None = None,
    max_passes: int | None = None,
    wait: Callable[[float], object] | None = None,
) -> LoopStats:
    """Full ticks every tick_interval_s, fast checks every fast_interval_s, until `stop`.

    `clock` only schedules the passes (monotonic: a wall-clock step does not bunch them up);
    the agent keeps its own clock for what it records. `on_pass(kind, result)` sees every pass
    ("tick" or "fast"); `max_passes` bounds the loop and `wait` (default `stop.wait`) replaces
    the pause between passes, for tests.
    """
    pause = wait or stop.wait
    policy = agent.config.policy
    tick_s, fast_s = float(policy.tick_interval_s), float(policy.fast_interval_s)
    # fast checks journal only when they act, and leave the textfile to the full ticks
    fast_agent = replace(agent, planner=fast_plan, journal_empty=False, on_tick=None)
    stats = LoopStats()
    args = (agent, fast_agent, stop, clock, on_pass, max_passes, pause, stats, tick_s, fast_s)
    if agent.leadership is None:
        _passes(*args)
        return stats
    with agent.leadership.renewing():
        _passes(*args)
    return stats


def _passes(agent: Agent, fast_agent: Agent, stop: threading.Event, clock: Callable[[], float],
            on_pass: Callable[[str, TickResult], None] | None, max_passes: int | None,
            pause: Callable[[float], object], stats: LoopStats, tick_s: float,
            fast_s: float) -> None:
    next_tick = clock()
    passes = 0
    while not stop.is_set() and (max_passes is None or passes < max_passes):
        now = clock()
        if now >= next_tick:
            kind, result = "tick", agent.tick()
            stats.ticks += 1
            # the next tick a whole interval after this one began; missed ones are not replayed
            next_tick = max(next_tick + tick_s, now)
            while next_tick <= now:
                next_tick += tick_s
        else:
            kind, result = "fast", fast_agent.tick()
            stats.fast_checks += 1
            stats.fast_actions += len(result.actions)
        passes += 1
        stats.errors += bool(result.error)
        if result.actions or result.error:
            log.info("%s: %d action(s)%s", kind, len(result.actions),
                     f", error: {result.error}" if result.error else "")
        if on_pass is not None:
            on_pass(kind, result)
        now = clock()
        delay = next_tick - now
        if 0 < fast_s < delay:
            delay = fast_s
        if delay > 0 and not stop.is_set():
            pause(delay)
