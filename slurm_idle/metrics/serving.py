"""A model's present demand from the replicas we know are ours and serving, nothing else.

A source's fleet-wide figures sum every series carrying the model's name: a job on a lent node
that binds the freed vLLM port and serves `NaN` (or huge or negative numbers) would be summed
into the model's load. So the agent rebuilds each model's present figures (token rates, running,
queue, KV cache, TTFT) from the per-replica loads of its nodes in a serving phase (SERVING,
RETIRING) whose endpoint did not prove foreign; a lent node's metrics never count. The window
and forecast fields stay the source's (Prometheus holds the history; each series there is
checked finite and non-negative first), raised to the present where they are its maxima. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from slurm_idle.config import ReplicaConfig
from slurm_idle.model import ModelLoad, ReplicaLoad
from slurm_idle.policy.capacity import demand_tokens_per_s
from slurm_idle.policy.service import finite_non_negative, usable


def serving_model_load(
    load: ModelLoad, replicas: Sequence[ReplicaLoad | None], prompt_token_weight: float
) -> ModelLoad:
    """`load` with its present figures summed over the serving replicas' loads.

    Without a single usable serving replica the source's own figures are all there is (the
    planner then already refuses to lend: a serving replica is unknown). The window fields
    keep the source's history, but never below the present (they are maxima over a span that
    ends now), and the queue's recent minimum never above it.
    """
    counted = [r for r in replicas if r is not None and usable(r)]
    if not counted:
        return load
    gen = sum(r.generation_tokens_per_s for r in counted)
    prompt = sum(r.prompt_tokens_per_s for r in counted)
    waiting = sum(r.waiting for r in counted)
    demand = demand_tokens_per_s(gen, prompt, prompt_token_weight)
    ttfts = [r.ttft_p95_s for r in counted if r.ttft_p95_s is not None and finite_non_negative(r.ttft_p95_s)]
    return replace(
        load,
        known=True,
        generation_tokens_per_s=gen,
        prompt_tokens_per_s=prompt,
        running=sum(r.running for r in counted),
        waiting=waiting,
        kv_cache_usage_max=max(r.kv_cache_usage for r in counted),
        # The worst replica's p95: a fleet-wide percentile cannot be rebuilt from per-replica
        # ones, and the worst errs on the service's side.
        ttft_p95_s=max(ttfts) if ttfts else load.ttft_p95_s,
        waiting_min_recent=(
            None if load.waiting_min_recent is None else min(load.waiting_min_recent, waiting)
        ),
        demand_tokens_per_s_max_window=(
            None if load.demand_tokens_per_s_max_window is None
            else max(load.demand_tokens_per_s_max_window, demand)
        ),
        waiting_max_window=(
            None if load.waiting_max_window is None else max(load.waiting_max_window, waiting)
        ),
    )


def loads_by_replica(
    replicas: Sequence[tuple[str, ReplicaConfig]], loads: Iterable[ReplicaLoad]
) -> dict[str, ReplicaLoad]:
    """replica name -> its load, found by url (by node name only where the node heads one
    replica): keyed by node, two replicas on one 8-GPU node shared one entry and a replica
    without fresh series hid behind its neighbour's (a load found by node name could be the
    other's: counted twice, or a foreign one counted). The one rule of the agent's observe and
    doctor's metrics check."""
    by_url: dict[str, ReplicaLoad] = {}
    by_node: dict[str, ReplicaLoad] = {}
    for load in loads:
        if load.url:
            by_url[load.url] = load
        by_node.setdefault(load.node, load)
    heads: dict[str, int] = {}
    for _, r in replicas:
        heads[r.node] = heads.get(r.node, 0) + 1
    out: dict[str, ReplicaLoad] = {}
    for _, r in replicas:
        found = by_url.get(r.url) or (by_node.get(r.node) if heads[r.node] == 1 else None)
        if found is not None:
            out[r.name] = found
    return out
