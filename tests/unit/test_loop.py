"""`slurm-idle agent`'s loop and its fast check: cadence, what a fast check may do, stopping."""

from __future__ import annotations

import threading
from pathlib import Path

from slurm_idle.journal import Journal
from slurm_idle.loop import run_loop
from slurm_idle.model import ActionKind, ModelLoad, Phase
from slurm_idle.policy import fast_plan

from .test_agent import make_agent
from .test_policy_helpers import NOW, config, load, node, observation


def test_fast_check_keeps_only_reclaims_of_models_under_pressure() -> None:
    """A sustained queue: the fast check reclaims like the full plan; demand alone (no
    pressure): the full plan reclaims, the fast check waits for the tick; it never lends."""
    nodes = [node("m0-n0", running=16.0), node("m0-n1", Phase.LENT), node("m0-n2", Phase.LENT)]
    cfg = config(replicas=3, queue_sustain_s=0)
    queued = observation(*nodes, loads=(load(100.0, waiting=40.0, running=16.0),))
    reclaims = [a for a in fast_plan(queued, cfg, NOW) if a.kind is ActionKind.RECLAIM]
    assert reclaims and all(a.model == "m0" for a in reclaims)
    busy = observation(*nodes, loads=(load(2000.0),))  # needs 3 by tokens, no queue
    assert fast_plan(busy, cfg, NOW) == []
    idle = observation(node("m0-n0"), node("m0-n1"), node("m0-n2"),
                       loads=(load(0.0, kv_cache_usage_max=0.95),))  # hot KV cache, nothing lent: no lend either
    assert all(a.kind is not ActionKind.LEND for a in fast_plan(idle, cfg, NOW))


def test_fast_check_carries_reclaims_on_but_never_lends() -> None:
    """A node starting is carried on by the fast check; a retiring one (a lend) is not."""
    nodes = [node("m0-n0"), node("m0-n1", Phase.STARTING), node("m0-n2", Phase.RETIRING)]
    obs = observation(*nodes, loads=(load(100.0),))
    moved = {(a.node, a.kind) for a in fast_plan(obs, config(replicas=3), NOW)}
    assert moved == {("m0-n1", ActionKind.CONTINUE)}


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def wait(self, s: float) -> bool:
        self.t += s
        return False


def test_loop_runs_ticks_on_their_interval_and_fast_checks_between(tmp_path: Path) -> None:
    """tick_interval 60 / fast 10: one full tick then five fast checks, again and again; only
    the full ticks are journaled when nothing happens."""
    agent, *_ = make_agent(tmp_path)
    agent.metrics.models = {"m": ModelLoad(model="m")}
    t = FakeTime()
    kinds: list[tuple[str, float]] = []
    stats = run_loop(agent, threading.Event(), clock=t, max_passes=12, wait=t.wait,
                on_pass=lambda kind, result: kinds.append((kind, t())))
    assert [k for k, _ in kinds] == (["tick"] + ["fast"] * 5) * 2
    assert [at for k, at in kinds if k == "tick"] == [0.0, 60.0]
    assert (stats.ticks, stats.fast_checks) == (2, 10)
    records = [r for r in Journal(Path(agent.config.paths.journal)).records()
               if r.get("event") == "tick"]
    # Two identical idle ticks: one record that counts both (idle_runs.py), fast checks none.
    assert [r.get("count", 1) for r in records] == [2]


def test_stop_ends_the_loop_between_passes(tmp_path: Path) -> None:
    """A stop set during a pass ends the loop after that pass: no further pass, no wait."""
    agent, *_ = make_agent(tmp_path)
    stop = threading.Event()
    t = FakeTime()
    seen: list[str] = []

    def on_pass(kind: str, result: object) -> None:
        seen.append(kind)
        stop.set()

    stats = run_loop(agent, stop, clock=t, on_pass=on_pass, wait=t.wait)
    assert seen == ["tick"] and stats.ticks == 1
    assert t() == 0.0  # no wait after the stop
