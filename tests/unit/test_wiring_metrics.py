"""The tick's textfile writer (slurm_idle.wiring): gauges describe the pool after the steps."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from slurm_idle.agent import TickResult
from slurm_idle.config import Config, EngineConfig, ModelConfig, PathsConfig, ReplicaConfig
from slurm_idle.model import ModelPlan, Observation, Phase
from slurm_idle.transitions import StepResult
from slurm_idle.wiring import _textfile_writer, serving_after

from .test_policy_helpers import NOW, node


def step(name: str, frm: Phase, to: Phase, outcome: str = "ok") -> StepResult:
    return StepResult(name, "m0", "x", frm, to, "r", outcome, NOW, 0.1)


def result() -> TickResult:
    """Before the steps one replica serves (n0, and n4 asleep); after them four do."""
    obs = Observation(now=NOW, nodes=(
        node("m0-n0"),
        node("m0-n1", Phase.RECLAIMING),  # reclaimed and started this tick
        node("m0-n2", Phase.SERVING),  # lend begun this tick: retiring still takes traffic
        node("m0-n3", Phase.LENT),  # reclaim still waiting: not serving yet
        node("m0-n4", Phase.SERVING, sleeping=True),  # asleep, untouched: not capacity
        node("m0-n5", Phase.STARTING, sleeping=True),  # woken this tick: serving now
        node("m0-n6", Phase.RETIRING),  # lent this tick
    ))
    steps = [
        step("m0-n1", Phase.RECLAIMING, Phase.STARTING),
        step("m0-n1", Phase.STARTING, Phase.SERVING),
        step("m0-n2", Phase.SERVING, Phase.RETIRING),
        step("m0-n3", Phase.LENT, Phase.RECLAIMING, outcome="waiting"),
        step("m0-n5", Phase.STARTING, Phase.SERVING),
        step("m0-n6", Phase.RETIRING, Phase.LENDING),
    ]
    plans = [ModelPlan("m0", 4, 3, "why"), ModelPlan("m1", 1, 1, "why")]
    return TickResult(obs, steps=steps, plans=plans, started=NOW)


def test_serving_replicas_are_counted_after_the_steps() -> None:
    """serving_after counts the phases the steps left, not the plans' count before them."""
    assert serving_after(result()) == {"m0": 4, "m1": 0}


def test_serving_falls_back_to_the_plans_without_an_observation() -> None:
    """A tick that could not observe the pool reports what the plans say (nothing, usually)."""
    assert serving_after(TickResult(None, plans=[ModelPlan("m0", 2, 1, "x")])) == {"m0": 1}


def test_textfile_serving_gauge_matches_the_node_gauge(tmp_path: Path) -> None:
    """The textfile's slurm_idle_serving_replicas is the post-step count, in step with
    slurm_idle_nodes (which counts phases after the steps too)."""
    path = tmp_path / "slurm_idle.prom"
    config = Config(
        engine=EngineConfig(kind="command", start_command="s", stop_command="t"),
        models=(ModelConfig(name="m0", replicas=(ReplicaConfig(node="m0-n0", url="http://m0-n0:8000"),)),),
        paths=PathsConfig(textfile=str(path)),
    )
    _textfile_writer(config)(result())
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }
    assert got[("slurm_idle_serving_replicas", (("model", "m0"),))] == 4
    # serving n0, n1, n4 (asleep), n5; retiring n2: five nodes, four replicas taking traffic
    assert got[("slurm_idle_nodes", (("phase", "serving"),))] == 4
    assert got[("slurm_idle_nodes", (("phase", "retiring"),))] == 1
