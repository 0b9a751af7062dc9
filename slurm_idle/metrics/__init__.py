"""Engine load signals for the planner: vLLM metrics through Prometheus or by direct scrape.

Both sources implement `MetricsSource`; the agent asks for every pool replica's load and for
each model's fleet-wide demand once per tick. `make_source(config)` picks the configured one.
Missing or stale series come back as `known=False`, never as zeros, so the planner cannot
mistake an unreachable replica for an idle one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from slurm_idle.config import Config, ModelConfig, ReplicaConfig
from slurm_idle.model import ModelLoad, ReplicaLoad

# The planner's unit of load (generated + weighted prompt tokens/s): one definition, the policy's.
from slurm_idle.policy.capacity import demand_tokens_per_s


@runtime_checkable
class MetricsSource(Protocol):
    """Where the agent reads engine load from."""

    def replica_loads(self, replicas: Sequence[tuple[str, ReplicaConfig]]) -> list[ReplicaLoad]:
        """One ReplicaLoad per (model name, replica), in the same order."""
        ...

    def model_loads(self, models: Sequence[ModelConfig], now: float) -> list[ModelLoad]:
        """One fleet-wide ModelLoad per model, in the same order."""
        ...


def make_source(config: Config, read_only: bool = False) -> MetricsSource:
    """The metrics source the config asks for (metrics.source). `read_only`: for commands that
    only look (status, tick --dry-run): the scrape source then keeps its state file as it is."""
    if config.metrics.source == "scrape":
        from slurm_idle.metrics.scrape import ScrapeSource

        return ScrapeSource(config, read_only=read_only)
    from slurm_idle.metrics.prometheus import PrometheusSource

    return PrometheusSource(config)


__all__ = ["MetricsSource", "demand_tokens_per_s", "make_source"]
