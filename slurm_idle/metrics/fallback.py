"""Prometheus first, the replicas' own /metrics when Prometheus does not answer.

A Prometheus outage must not freeze the pool: with `reclaim_on_unknown_metrics: false` nothing
lent came back while requests queued. So when a Prometheus query fails, the same tick scrapes
the serving replicas directly (metrics.scrape) and plans on that: the present's demand, queue,
KV cache and latency (enough to reclaim); without its kept history the scale-down window reads
as unknown, so nothing new is lent until Prometheus is back. Only when neither source answers
does the model read as unknown (the planner holds); `source` says which one answered, for the
journal and the agent's textfile (`slurm_idle_metrics_source`), which the alert rules read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

from slurm_idle.config import ModelConfig, ReplicaConfig
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.logs import get_logger
from slurm_idle.metrics import MetricsSource
from slurm_idle.model import ModelLoad, ReplicaLoad

log = get_logger(__name__)
T = TypeVar("T")

#: Values of `FallbackSource.source` (and of the textfile's label).
PRIMARY, FALLBACK, NONE = "prometheus", "scrape", "none"


class FallbackSource:
    """MetricsSource trying `primary` (Prometheus), then `fallback` (direct scrapes) per tick."""

    def __init__(self, primary: MetricsSource, fallback: MetricsSource) -> None:
        self.primary = primary
        self.fallback = fallback
        self.source = PRIMARY  # which one answered the last call
        self.primary_error: str | None = None

    @property
    def queries(self) -> int:
        return int(getattr(self.primary, "queries", 0))

    def replica_loads(
        self,
        replicas: Sequence[tuple[str, ReplicaConfig]],
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ReplicaLoad]:
        self.source, self.primary_error = PRIMARY, None
        try:
            return self.primary.replica_loads(replicas, budget_s=budget_s, serving=serving)
        except MetricsUnavailable as exc:
            return self._fall_back(exc, lambda: self.fallback.replica_loads(
                replicas, budget_s=budget_s, serving=serving))

    def model_loads(
        self,
        models: Sequence[ModelConfig],
        now: float,
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ModelLoad]:
        if self.source == PRIMARY:
            try:
                return self.primary.model_loads(models, now, budget_s=budget_s, serving=serving)
            except MetricsUnavailable as exc:
                return self._fall_back(exc, lambda: self.fallback.model_loads(
                    models, now, budget_s=budget_s, serving=serving))
        try:
            return self.fallback.model_loads(models, now, budget_s=budget_s, serving=serving)
        except MetricsUnavailable:
            self.source = NONE
            raise

    def _fall_back(self, exc: MetricsUnavailable, call: Callable[[], T]) -> T:
        self.primary_error = str(exc)
        log.warning("%s; scraping the serving replicas directly instead", exc)
        self.source = FALLBACK
        try:
            return call()
        except MetricsUnavailable as second:
            self.source = NONE
            raise MetricsUnavailable(f"{exc}; and the direct scrape failed too: {second}") from None

