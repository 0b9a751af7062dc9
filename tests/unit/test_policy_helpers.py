"""Builders of configs and observations for the planner tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from slurm_idle.config import Config, EngineConfig, ModelConfig, PolicyConfig, ReplicaConfig
from slurm_idle.model import (
    ModelLoad,
    NodeView,
    Observation,
    Phase,
    ReplicaLoad,
    SlurmJob,
    SlurmNode,
)
from slurm_idle.policy import apply_actions

NOW = 1_767_000_000.0  # a fixed clock; 2025-12-29 09:20 UTC, a Monday
CAP = 1000.0  # tokens/s per replica in these tests: 800 tok/s per replica at 80%

__all__ = ["CAP", "NOW", "apply_actions", "config", "load", "node", "observation"]


def config(replicas: int = 4, floor: int = 1, models: int = 1, **policy: Any) -> Config:
    names = [f"m{i}" for i in range(models)]
    return Config(
        engine=EngineConfig(kind="command", start_command="start", stop_command="stop"),
        models=tuple(
            ModelConfig(
                name=name,
                tokens_per_s_per_replica=CAP,
                min_serving_replicas=floor,
                replicas=tuple(
                    ReplicaConfig(node=f"{name}-n{j}", url=f"http://{name}-n{j}:8000")
                    for j in range(replicas)
                ),
            )
            for name in names
        ),
        policy=PolicyConfig(**policy),
    )


def node(
    name: str,
    phase: Phase = Phase.SERVING,
    model: str = "m0",
    *,
    pinned: bool = False,
    jobs: tuple[SlurmJob, ...] = (),
    known: bool = True,
    running: float = 0.0,
    drained: bool | None = None,
    down: bool = False,
    sleeping: bool = False,
) -> NodeView:
    if drained is None:
        drained = phase not in (Phase.LENT, Phase.UNKNOWN)
    flags = frozenset({"DRAIN"} if drained else set()) | frozenset({"NOT_RESPONDING"} if down else set())
    taking = phase in (Phase.SERVING, Phase.RETIRING)
    return NodeView(
        node=SlurmNode(name=name, state="down" if down else "idle", flags=flags, gpus_total=4),
        model=model,
        phase=phase,
        phase_since=NOW - 600,
        pinned=pinned,
        jobs=jobs,
        replica=(
            ReplicaLoad(model=model, node=name, known=known, running=running, sleeping=sleeping)
            if taking else None
        ),
    )


def load(demand: float, model: str = "m0", window: float | None = None, **fields: Any) -> ModelLoad:
    """A model load whose token demand (generation only) is `demand` now and over the window."""
    values: dict[str, Any] = {
        "waiting_max_window": 0.0, "waiting_min_window": 0.0, "waiting_min_recent": 0.0, **fields
    }
    return ModelLoad(
        model=model,
        generation_tokens_per_s=demand,
        demand_tokens_per_s_max_window=demand if window is None else window,
        **values,
    )


def observation(*nodes: NodeView, loads: tuple[ModelLoad, ...] = ()) -> Observation:
    return Observation(now=NOW, nodes=tuple(nodes), models=loads)


def with_phase(view: NodeView, phase: Phase) -> NodeView:
    return replace(view, phase=phase)
