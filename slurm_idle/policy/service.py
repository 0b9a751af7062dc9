"""What counts as a serving replica's capacity: one rule for the node planner, the jobs
placement's policy and the fast check. Pure.

A replica in a serving phase serves only while its engine is live and ours. Out of service, so
no capacity whatever its phase says: asleep (even on stale metrics: then it may still be), seen
failing the tick's probe (/health not 200, or an engine that sleeps whose sleep state is
unknown), or its endpoint proved not to be the expected engine. Counting such a replica would
hold a model short while a lent node (or replica job) that could serve stays lent. And a
replica's load is fit to count (`usable`) only when read, ours and finite.
"""

from __future__ import annotations

import math

from slurm_idle.model import ReplicaLoad


def failing(load: ReplicaLoad | None) -> bool:
    """Seen failing the tick's probe (model.ReplicaLoad.healthy False)."""
    return load is not None and load.healthy is False


def out_of_service(load: ReplicaLoad | None) -> bool:
    """Asleep, failing the tick's probe, or proved not the expected engine (`foreign`)."""
    return load is not None and (load.sleeping or load.foreign or failing(load))


def finite_non_negative(value: float) -> bool:
    """A figure fit to count: a job squatting a freed port may serve NaN, inf or negatives."""
    return 0 <= value < math.inf


def usable(load: ReplicaLoad | None) -> bool:
    """A replica load fit to count: known, ours, and every figure finite and non-negative."""
    if load is None or not load.known or load.foreign:
        return False
    figures = (load.running, load.waiting, load.kv_cache_usage, load.prompt_tokens_per_s,
               load.generation_tokens_per_s)
    return all(finite_non_negative(v) for v in figures)
