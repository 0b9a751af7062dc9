"""Engine load signals for the planner: vLLM metrics through Prometheus or by direct scrape.

Both sources implement `MetricsSource`; the agent asks for every pool replica's load and for
each model's fleet-wide demand once per tick. `make_source(config)` picks the configured one.
Missing or stale series come back as `known=False`, never as zeros, so the planner cannot
mistake an unreachable replica for an idle one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from slurm_idle.config import Config, ModelConfig, ReplicaConfig
from slurm_idle.model import ModelLoad, ReplicaLoad

# The planner's unit of load (generated + weighted prompt tokens/s): one definition, the policy's.
from slurm_idle.policy.capacity import demand_tokens_per_s


@runtime_checkable
class MetricsSource(Protocol):
    """Where the agent reads engine load from."""

    def replica_loads(
        self,
        replicas: Sequence[tuple[str, ReplicaConfig]],
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ReplicaLoad]:
        """One ReplicaLoad per (model name, replica), in the same order. `budget_s`: the whole
        call ends within it (MetricsUnavailable otherwise); `serving`: the names
        (ReplicaConfig.name) of the replicas that are ours and serving, one by one, never by
        node (a source may read only those; the others may come back unknown)."""
        ...

    def model_loads(
        self,
        models: Sequence[ModelConfig],
        now: float,
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ModelLoad]:
        """One fleet-wide ModelLoad per model, in the same order (same keywords)."""
        ...


def make_source(config: Config, read_only: bool = False) -> MetricsSource:
    """The metrics source the config asks for (metrics.source). `read_only`: for commands that
    only look (status, tick --dry-run): the scrape source then keeps its state file as it is."""
    from slurm_idle.metrics.scrape import ScrapeSource

    if config.metrics.source == "scrape":
        return ScrapeSource(config, read_only=read_only)
    from slurm_idle.metrics.prometheus import PrometheusSource

    prometheus = PrometheusSource(config)
    if not config.metrics.fallback_scrape:
        return prometheus
    from slurm_idle.metrics.fallback import FallbackSource

    return FallbackSource(prometheus, ScrapeSource(config, read_only=read_only))


__all__ = ["MetricsSource", "demand_tokens_per_s", "make_source"]
