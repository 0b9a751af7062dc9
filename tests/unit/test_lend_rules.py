"""The safety rules of a lend (policy/rules.py) hold in both placements, and in the fast check
where they start a scale-up; taking a rule out at its one definition breaks every scenario of it.

A SCENARIO builds one pool of model m0 in either placement (`pool`: the same phases, pins,
blind replicas and load as node views or as replica jobs) and says what its rule guarantees of
the tick's actions (`holds`). REMOVALS takes each rule out where it is written (as in
test_gpu_rules.py: a function imported by name is replaced wherever it is bound). Per rule,
scenario, placement and planner, one test sees the rule hold and another sees its removal
break it: a removal that leaves a placement's scenario holding would be a rule not applied there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from slurm_idle.config import Config, parse_config
from slurm_idle.lifecycle import Edge, job_lent_phases, lent_phases, takes_traffic
from slurm_idle.model import Action, ActionKind, JobReplica, Observation, Phase, ReplicaLoad
from slurm_idle.policy import fast_plan, planner, rules
from slurm_idle.policy.jobs import plan_jobs
from slurm_idle.policy.planner import plan

from . import test_policy_helpers as ph
from .test_gpu_rules import _everywhere

Planner = Callable[[Observation, Config, float], list[Action]]
Removal = Callable[[pytest.MonkeyPatch], None]
Pool = tuple[Observation, Config]

PLANNERS: dict[str, Planner] = {"plan": plan, "fast_plan": fast_plan}
#: One policy for both placements: a lend after a minute of low load, no forecast, 4 lends a tick.
POLICY: dict[str, Any] = {"scale_down_window_s": 60, "forecast": False, "max_transitions_per_tick": 4}
#: A queue that lasted queue_sustain_s: pressure now (capacity.pressure_now), one replica more.
QUEUE: dict[str, Any] = {"waiting": 1.0, "running": 1.0, "waiting_min_recent": 1.0}
S, R, L = Phase.SERVING, Phase.RETIRING, Phase.LENT
UP, BACK = Phase.STARTING, Phase.RECLAIMING


# --- the pool, in either placement ---------------------------------------------------------------


def _parsed(models: list[dict[str, Any]], policy: dict[str, Any]) -> Config:
    """A config parsed as the agent reads it (JSON is YAML)."""
    return parse_config(json.dumps({
        "engine": {"kind": "command", "start_command": "true", "stop_command": "true"},
        "slurm": {"serve_partition": "serve"}, "models": models, "policy": policy}))


def _jobs_model(name: str, replicas: int, floor: int) -> dict[str, Any]:
    return {"name": name, "placement": "jobs", "tokens_per_s_per_replica": ph.CAP,
            "min_serving_replicas": floor,
            "job": {"replicas": replicas, "gpus_per_replica": 4, "port_base": 9100,
                    "command": "vllm serve {model} --port {port}", "url": "http://{node}:{port}"}}


def _job(model: str, i: int, phase: Phase, since: float, *, pinned: bool = False,
         known: bool = True) -> JobReplica:
    """Replica `i` of a jobs model on gpu8 (no job when LENT; PENDING while RECLAIMING)."""
    port, has_job = 9100 + i, phase is not L
    url = f"http://gpu8:{port}"
    load = ReplicaLoad(model=model, node="gpu8", url=url, known=known) if takes_traffic(phase) else None
    return JobReplica(model=model, index=i, port=port, phase=phase, phase_since=since,
                      job_id=100 + i if has_job else None,
                      job_state=("PENDING" if phase is BACK else "RUNNING") if has_job else "",
                      nodes=("gpu8",) if has_job and phase is not BACK else (),
                      url=url, gpus=4, load=load, pinned=pinned)


def pool(placement: str, phases: Sequence[Phase], demand: float = 0.0, floor: int = 1,
         pinned: Sequence[int] = (), blind: Sequence[int] = (), stuck: Sequence[int] = (),
         queue: bool = False, **policy: Any) -> Pool:
    """Model m0's replica i in phases[i] for ten minutes (`stuck`: a reclaim just past
    timeouts.reclaim_s), idle; `blind`: metrics unknown; `queue`: under pressure."""
    knobs = {**POLICY, **policy}
    if placement == "nodes":
        cfg = ph.config(replicas=len(phases), floor=floor, **knobs)
    else:
        cfg = _parsed([_jobs_model("m0", len(phases), floor)], knobs)
    since = [ph.NOW - (cfg.timeouts.reclaim_s + 1 if i in stuck else 600) for i in range(len(phases))]
    load = ph.load(demand, **(QUEUE if queue else {}))
    if placement == "nodes":
        views = [ph.node(f"m0-n{i}", p, pinned=i in pinned, known=i not in blind) for i, p in enumerate(phases)]
        return ph.observation(*(replace(v, phase_since=t) for v, t in zip(views, since, strict=True)),
                              loads=(load,)), cfg
    jobs = tuple(_job("m0", i, p, since[i], pinned=i in pinned, known=i not in blind)
                 for i, p in enumerate(phases))
    return Observation(now=ph.NOW, nodes=(), models=(load,), replica_jobs=jobs), cfg


def mixed_pool(placement: str) -> Pool:
    """One nodes model (m0) and one jobs model (j0), two idle serving replicas each, floor 1,
    max_transitions_per_tick 1: both could lend one."""
    cfg = _parsed([{"name": "m0", "nodes": "m0-n[0-1]", "url": "http://{node}:8000",
                    "tokens_per_s_per_replica": ph.CAP}, _jobs_model("j0", 2, 1)],
                  {**POLICY, "max_transitions_per_tick": 1})
    jobs = tuple(_job("j0", i, S, ph.NOW - 600) for i in range(2))
    return Observation(now=ph.NOW, nodes=(ph.node("m0-n0"), ph.node("m0-n1")),
                       models=(ph.load(0.0), ph.load(0.0, "j0")), replica_jobs=jobs), cfg


# --- what the actions show -----------------------------------------------------------------------


def _did(actions: Sequence[Action], kind: ActionKind) -> set[int]:
    """The replica indexes `kind` was decided for ("m0-n3" and "m0#3" are both 3)."""
    return {int(re.split(r"-n|#", a.node)[-1]) for a in actions if a.kind is kind}


def _out_after(obs: Observation, actions: Sequence[Action]) -> int:
    """Replicas on the lent side (RETIRING, LENDING, LENT) once the tick's actions are done."""
    phases = {v.name: v.phase for v in obs.nodes} | {r.name: r.phase for r in obs.replica_jobs}
    phases |= {a.node: a.to_phase for a in actions}
    return sum(1 for p in phases.values() if p in lent_phases() | job_lent_phases())


# --- the scenarios -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """A pool (`build`, per placement) on which `rule` guarantees `holds` of the tick's actions."""

    rule: str
    build: Callable[[str], Pool]
    holds: Callable[[Observation, list[Action]], bool]
    placements: tuple[str, ...] = ("nodes", "jobs")
    planners: tuple[str, ...] = ("plan",)


LEND, ABORT, RECLAIM = ActionKind.LEND, ActionKind.ABORT_LEND, ActionKind.RECLAIM
#: Two serving, a lend under way (2), two starting: the queue's need is met without index 2.
UNDER_WAY = (S, S, R, UP, UP)

SCENARIOS: dict[str, Scenario] = {
    "floor 2 of 4 idle: 2 lent": Scenario(
        "floor", lambda p: pool(p, [S] * 4, floor=2),
        lambda o, a: len(_did(a, LEND)) == 2),
    "lent fraction 0.5 of 4 idle: 2 lent side": Scenario(
        "lent_cap", lambda p: pool(p, [S] * 4, max_lent_fraction=0.5),
        lambda o, a: _out_after(o, a) == 2),
    "lent fraction 0.5, one LENT: 1 more": Scenario(
        "lent_cap", lambda p: pool(p, [S, S, S, L], max_lent_fraction=0.5),
        lambda o, a: len(_did(a, LEND)) == 1 and _out_after(o, a) == 2),
    "lent fraction 0: nothing lent": Scenario(
        "lent_cap", lambda p: pool(p, [S] * 4, max_lent_fraction=0.0),
        lambda o, a: not _did(a, LEND)),
    "one serving replica blind: nothing lent": Scenario(
        "lend_evidence", lambda p: pool(p, [S] * 4, blind=(1,)),
        lambda o, a: not _did(a, LEND)),
    "lend under way, a serving replica blind: stopped": Scenario(
        "stop_lend", lambda p: pool(p, UNDER_WAY, blind=(1,), queue=True),
        lambda o, a: 2 in _did(a, ABORT), planners=("plan", "fast_plan")),
    "lend under way, pinned: stopped": Scenario(
        "stop_lend", lambda p: pool(p, UNDER_WAY, pinned=(2,), queue=True),
        lambda o, a: 2 in _did(a, ABORT), planners=("plan", "fast_plan")),
    "pinned idle replicas never lent, the unpinned one is": Scenario(
        "stop_lend", lambda p: pool(p, [S] * 3, pinned=(0, 2)),
        lambda o, a: _did(a, LEND) == {1}),
    "reclaim stuck past reclaim_s: another reclaimed": Scenario(
        "stuck_reclaim", lambda p: pool(p, [S, BACK, L], stuck=(1,), queue=True),
        lambda o, a: _did(a, RECLAIM) == {2}, planners=("plan", "fast_plan")),
    "one budget for the pool: one lend in all": Scenario(
        "budget", mixed_pool, lambda o, a: sum(1 for x in a if x.kind is LEND) == 1,
        placements=("nodes+jobs",)),
}

CASES = [(name, placement, how) for name, s in SCENARIOS.items()
         for placement in s.placements for how in s.planners]


def _decide(name: str, placement: str, how: str) -> tuple[Observation, list[Action]]:
    observation, config = SCENARIOS[name].build(placement)
    return observation, PLANNERS[how](observation, config, ph.NOW)


# --- the rules, each taken out at its one definition ---------------------------------------------


def no_floor(mp: pytest.MonkeyPatch) -> None:
    """rules.floor(): no replica kept serving whatever the load."""
    _everywhere(mp, rules.floor, lambda model, total: 0)


def no_lent_cap(mp: pytest.MonkeyPatch) -> None:
    """rules.lent_cap(): every replica may be on the lent side."""
    _everywhere(mp, rules.lent_cap, lambda policy, total: 10**9)


def no_evidence(mp: pytest.MonkeyPatch) -> None:
    """rules.lend_evidence(): any evidence is good enough to lend on."""
    _everywhere(mp, rules.lend_evidence, lambda load, serving: (True, ""))


def no_stop_lend(mp: pytest.MonkeyPatch) -> None:
    """rules.stop_lend(): a pinned replica may be lent, and a lend under way goes on."""
    _everywhere(mp, rules.stop_lend, lambda pinned, known, why_unknown: None)


def budget_per_placement(mp: pytest.MonkeyPatch) -> None:
    """planner.plan(): the jobs models get the whole max_transitions_per_tick again."""
    mp.setattr(planner, "plan_jobs", lambda observation, config, now, budget=None:
               plan_jobs(observation, config, now))


def stuck_reclaim_counts(mp: pytest.MonkeyPatch) -> None:
    """Edge.timeout_s(): timeouts.reclaim_s bounds nothing (a reclaim is never overdue)."""
    orig = Edge.timeout_s
    mp.setattr(Edge, "timeout_s", lambda self, config: None if self.timeout == "reclaim_s"
               else orig(self, config))


REMOVALS: dict[str, Removal] = {
    "floor": no_floor,
    "lent_cap": no_lent_cap,
    "lend_evidence": no_evidence,
    "stop_lend": no_stop_lend,
    "budget": budget_per_placement,
    "stuck_reclaim": stuck_reclaim_counts,
}
#: The rules that start a scale-up, so the fast check applies them too.
SCALE_UP_RULES = {"stop_lend", "stuck_reclaim"}


# --- the tests -----------------------------------------------------------------------------------


def test_every_rule_has_scenarios_in_both_placements() -> None:
    """Every rule taken out has a scenario in each placement (and the fast check for a scale-up),
    and every scenario is of a rule taken out."""
    assert {s.rule for s in SCENARIOS.values()} == set(REMOVALS)
    for rule in REMOVALS:
        mine = [s for s in SCENARIOS.values() if s.rule == rule]
        assert {q for s in mine for p in s.placements for q in p.split("+")} == {"nodes", "jobs"}, rule
        if rule in SCALE_UP_RULES:
            assert {"nodes", "jobs"} <= {p for s in mine if "fast_plan" in s.planners for p in s.placements}


@pytest.mark.parametrize(("name", "placement", "how"), CASES)
def test_the_rule_holds_in_every_placement(name: str, placement: str, how: str) -> None:
    """The scenario's rule holds of what the planner decides, in this placement."""
    observation, actions = _decide(name, placement, how)
    assert SCENARIOS[name].holds(observation, actions), [(a.kind.value, a.node) for a in actions]


@pytest.mark.parametrize(("name", "placement", "how"), CASES)
def test_removing_the_rule_breaks_it_in_every_placement(name: str, placement: str, how: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the scenario's rule taken out at its definition, the scenario no longer holds."""
    REMOVALS[SCENARIOS[name].rule](monkeypatch)
    observation, actions = _decide(name, placement, how)
    assert not SCENARIOS[name].holds(observation, actions), [(a.kind.value, a.node) for a in actions]
