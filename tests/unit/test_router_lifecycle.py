"""The router in the lifecycle (issue 14): out before RETIRING, in only after health, awake and
a warm-up; a failed call keeps the replica where it is; each tick reconciles the router with
the phases in Slurm, so a tick killed between a router call and a phase write heals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_idle.agent import Agent
from slurm_idle.agent_metrics import Counters, parse_counters, render
from slurm_idle.config import Config, parse_config
from slurm_idle.journal import Journal
from slurm_idle.lifecycle import format_lent_comment, format_reason
from slurm_idle.model import Action, ActionKind, ModelLoad, Phase
from slurm_idle.router import IN, OUT
from slurm_idle.router.sync import RouterSet
from slurm_idle.testing.fake_router import FakeRouter
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm
from tests.unit.test_agent import T0, Clock, continue_all, phases

TAG = "slurm-idle"


def config(tmp_path: Path, warmup: bool = True) -> Config:
    prompt = '\n  warmup_prompt: "hi"' if warmup else ""
    return parse_config(f"""
engine: {{kind: command, start_command: "true", stop_command: "true", drain_timeout_s: 5}}
router:
  kind: haproxy
  admin_socket: /nonexistent.sock{prompt}
models:
  - name: m
    nodes: gpu[1-3]
    url: "http://127.0.0.1:1/{{node}}"
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
timeouts:
  tick_budget_s: 10
""")


class Post:
    """The warm-up request's HTTP POST: answers `status`, records the URLs."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.urls: list[str] = []

    def __call__(self, url: str, body: bytes, timeout_s: float) -> int:
        self.urls.append(url)
        return self.status


def setup(tmp_path: Path, warmup: bool = True, planner: Any = None) -> tuple[Agent, FakeSlurm, FakeRouter, Post]:
    cfg = config(tmp_path, warmup)
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3"])
    router = FakeRouter(log=slurm.log)  # one log: the order of router calls and Slurm writes
    post = Post()
    clock = Clock()
    agent = Agent(config=cfg, slurm=slurm, metrics=FakeMetrics(models={"m": ModelLoad(model="m")}),
                  engine_for=lambda model: FakeEngine(up={"gpu1": True, "gpu2": True, "gpu3": True}),
                  planner=planner or (lambda obs, cfg, now: []), assessor=lambda obs, cfg, now: [],
                  clock=clock, sleep=clock.sleep)
    assert agent.journal is not None
    agent.router = RouterSet(cfg, journal=agent.journal.append, make=lambda c: router,
                             clock=clock, post=post)
    return agent, slurm, router, post


def set_phase(slurm: FakeSlurm, node: str, phase: Phase) -> None:
    if phase is Phase.LENT:
        slurm.node_map[node] = replace(slurm.node_map[node], comment=format_lent_comment(TAG, 0.0))
        return
    slurm.node_map[node] = replace(slurm.node_map[node], flags=frozenset({"DRAIN"}),
                                   reason=format_reason(TAG, phase, T0))


def view(agent: Agent, node: str) -> Any:
    return next(v for v in agent.observe().nodes if v.name == node)


def first(log: list[tuple[str, ...]], pred: Any) -> int:
    return next(i for i, entry in enumerate(log) if pred(entry))


def test_a_replica_leaves_the_router_before_it_is_marked_retiring(tmp_path: Path) -> None:
    """SERVING -> RETIRING: the router's remove comes before the RETIRING drain reason."""
    agent, slurm, router, _ = setup(tmp_path)
    for n in ("gpu1", "gpu2", "gpu3"):
        set_phase(slurm, n, Phase.SERVING)
    v = view(agent, "gpu1")
    steps = agent.run_actions([Action(ActionKind.LEND, "gpu1", "m", Phase.SERVING, Phase.RETIRING,
                                      "load low")], agent.observe())
    assert steps[0].outcome == "ok" and v.phase is Phase.SERVING
    removed = first(slurm.log, lambda e: e == ("router_remove", "gpu1"))
    retiring = first(slurm.log, lambda e: e[0] == "drain" and ":retiring" in e[2])
    assert removed < retiring
    assert router.members["gpu1"] == OUT


def test_a_failed_remove_keeps_the_replica_serving(tmp_path: Path) -> None:
    """The router could not be told: the step fails, the node stays SERVING (still in the
    router, taking requests) and the failure is journaled and counted."""
    agent, slurm, router, _ = setup(tmp_path)
    set_phase(slurm, "gpu1", Phase.SERVING)
    router.fail_on.add("remove")
    steps = agent.run_actions([Action(ActionKind.LEND, "gpu1", "m", Phase.SERVING, Phase.RETIRING,
                                      "load low")], agent.observe())
    assert steps[-1].outcome == "error" and "router remove failed" in (steps[-1].error or "")
    assert phases(agent)["gpu1"] is Phase.SERVING
    assert not any(e[0] == "drain" and ":retiring" in e[2] for e in slurm.log)
    assert agent.router is not None and agent.router.take_errors() == 1
    records = [r for r in Journal(tmp_path / "journal.jsonl").records() if r["event"] == "router"]
    assert records[-1]["outcome"] == "error" and records[-1]["call"] == "remove"
    assert records[-1]["reason"] == "load low"  # the decision's own why, for `explain`


def test_a_replica_joins_only_after_warm_up_then_is_marked_serving(tmp_path: Path) -> None:
    """STARTING -> SERVING: health, then the warm-up completion, then add, then the mark."""
    agent, slurm, router, post = setup(tmp_path, planner=continue_all)
    for n in ("gpu2", "gpu3"):
        set_phase(slurm, n, Phase.SERVING)
        router.members[n] = IN
    set_phase(slurm, "gpu1", Phase.STARTING)
    agent.tick()
    assert post.urls == ["http://127.0.0.1:1/gpu1/v1/completions"]
    added = first(slurm.log, lambda e: e == ("router_add", "gpu1"))
    serving = first(slurm.log, lambda e: e[0] == "drain" and e[1] == "gpu1" and ":serving" in e[2])
    assert added < serving
    assert phases(agent)["gpu1"] is Phase.SERVING


def test_a_failed_warm_up_keeps_the_replica_out_and_starting(tmp_path: Path) -> None:
    """A replica that fails its warm-up request (a sleeping engine answers 503) is neither
    added to the router nor marked SERVING; the next tick tries again."""
    agent, slurm, router, post = setup(tmp_path, planner=continue_all)
    set_phase(slurm, "gpu1", Phase.STARTING)
    router.members["gpu1"] = OUT
    post.status = 503
    result = agent.tick()
    [step] = [s for s in result.steps if s.node == "gpu1"]
    assert step.outcome == "waiting" and "warm-up" in (step.detail or "")
    assert ("router_add", "gpu1") not in slurm.log
    assert phases(agent)["gpu1"] is Phase.STARTING
    post.status = 200
    agent.tick()
    assert phases(agent)["gpu1"] is Phase.SERVING and router.members["gpu1"] == IN


def test_reconcile_makes_the_router_match_slurm(tmp_path: Path) -> None:
    """A tick killed after the router call but before the phase write (gpu1 out but SERVING)
    or an external change (lent gpu2 back in) is put right by the next tick's reconcile;
    an admin's node is left as the router has it."""
    agent, slurm, router, _ = setup(tmp_path)
    set_phase(slurm, "gpu1", Phase.SERVING)
    set_phase(slurm, "gpu2", Phase.LENT)
    slurm.node_map["gpu3"] = replace(slurm.node_map["gpu3"], flags=frozenset({"DRAIN"}),
                                     reason="disk broken")
    router.members.update({"gpu1": OUT, "gpu2": IN, "gpu3": OUT})
    result = agent.tick()
    assert router.members == {"gpu1": IN, "gpu2": OUT, "gpu3": OUT}
    assert {(c["node"], c["call"]) for c in result.router_changes} == {("gpu1", "add"), ("gpu2", "remove")}
    assert agent.tick().router_changes == []  # consistent now: nothing more to do


def test_an_unreadable_router_is_counted_not_fatal(tmp_path: Path) -> None:
    """The router's state cannot be read: nothing is changed, the tick goes on, one error."""
    agent, slurm, router, _ = setup(tmp_path)
    set_phase(slurm, "gpu1", Phase.SERVING)
    router.fail_on.add("state")
    result = agent.tick()
    assert result.error is None and result.router_changes == [] and result.router_errors == 1


def test_router_errors_are_a_counter_in_the_textfile() -> None:
    """slurm_idle_router_errors_total carries over from the previous file and adds the tick's."""
    text = render(phases=None, needed={}, serving={}, tick_duration_s=1.0, tick_ts=0.0,
                  transitions=[], tick_error=False, floors={}, previous=Counters(router_errors=2),
                  router_errors=3)
    assert "slurm_idle_router_errors_total 5" in text
    assert parse_counters(text).router_errors == 5
