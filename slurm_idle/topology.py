"""The fleet's shape, derived from the config: replicas, and the lend groups they join nodes into.

A lend group is a connected set of nodes: two nodes are in one group when a replica spans both,
and every replica on a node belongs to that node's group. In node mode (vLLM outside Slurm)
Slurm lends whole nodes, so a group is lent only when all its replicas are retired. Checks that
a config describes a fleet that can exist (no GPU in two replicas, no unlendable tangle) live
here too, raising ValueError for pydantic to report with exit 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_idle.model import GroupView, LendGroup, NodeView, Observation, Phase, Replica

if TYPE_CHECKING:
    from slurm_idle.config import Config


def fleet_replicas(config: Config) -> tuple[Replica, ...]:
    """Every replica of the config, in config order."""
    return tuple(
        Replica(name=r.name, model=m.name, nodes=r.nodes, url=r.url, gpus=r.gpus, port=r.port,
                index=r.index)
        for m in config.models for r in m.replicas
    )


def group_replicas(replicas: tuple[Replica, ...]) -> tuple[LendGroup, ...]:
    """The lend groups the replicas make (union-find over nodes), ordered by first appearance."""
    parent: dict[str, str] = {}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for r in replicas:
        for n in r.nodes:
            parent.setdefault(n, n)
        head = root(r.nodes[0])
        for n in r.nodes[1:]:
            other = root(n)
            if other != head:
                parent[other] = head
    nodes_of: dict[str, list[str]] = {}
    for n in parent:  # insertion order: config order
        nodes_of.setdefault(root(n), []).append(n)
    reps_of: dict[str, list[Replica]] = {}
    for r in replicas:
        reps_of.setdefault(root(r.nodes[0]), []).append(r)
    return tuple(
        LendGroup(nodes=tuple(nodes), replicas=tuple(reps_of.get(key, ())))
        for key, nodes in nodes_of.items()
    )


def lend_groups(config: Config) -> tuple[LendGroup, ...]:
    """The config's lend groups, computed once per Config object."""
    cached: tuple[LendGroup, ...] | None = config._groups
    if cached is None:
        cached = group_replicas(fleet_replicas(config))
        config._groups = cached
    return cached


def group_index(config: Config) -> dict[str, LendGroup]:
    """node name -> its lend group."""
    cached: dict[str, LendGroup] | None = config._group_of
    if cached is None:
        cached = {n: g for g in lend_groups(config) for n in g.nodes}
        config._group_of = cached
    return cached


def check_topology(config: Config) -> None:
    """Refuse a fleet that cannot exist or cannot be lent; the message names the field."""
    where: dict[str, str] = {}  # replica name -> field path
    urls: dict[str, str] = {}
    on_node: dict[str, list[tuple[str, tuple[int, ...] | None, str]]] = {}
    spans: dict[str, tuple[str, str]] = {}  # node -> (model, field) of a multi-node replica on it
    for i, m in enumerate(config.models):
        for j, r in enumerate(m.replicas):
            field = f"models.{i}.replicas.{j}"
            for n in r.nodes:
                for other_field, other_gpus, other_model in on_node.get(n, []):
                    if r.gpus is None or other_gpus is None:
                        if r.gpus is None and other_gpus is None and other_model != m.name:
                            raise ValueError(
                                f"node {n!r} is listed under both {other_model!r} and {m.name!r} "
                                f"({other_field} and {field} each take the whole node; give each "
                                "its `gpus:`)")
                        raise ValueError(
                            f"{field}.gpus: node {n} is wholly given to {other_field if other_gpus is None else field} "
                            f"but also carries {field if other_gpus is None else other_field}: a GPU "
                            "in two replicas (give each replica its `gpus:`)")
                    shared = sorted(set(r.gpus) & set(other_gpus))
                    if shared:
                        raise ValueError(
                            f"{field}.gpus: GPU {shared[0]} of {n} is also in {other_field}: a GPU "
                            "in two replicas")
                on_node.setdefault(n, []).append((field, r.gpus, m.name))
                if len(r.nodes) > 1:
                    seen = spans.get(n)
                    if seen is not None and seen[0] != m.name:
                        raise ValueError(
                            f"{field}.nodes: {n} carries multi-node replicas of both {seen[0]!r} "
                            f"({seen[1]}) and {m.name!r}: their nodes would be lendable only "
                            "together, across models; keep multi-node replicas of a model on "
                            "nodes of their own")
                    spans.setdefault(n, (m.name, field))
    for i, m in enumerate(config.models):
        for j, r in enumerate(m.replicas):
            field = f"models.{i}.replicas.{j}"
            if r.name in where:
                raise ValueError(
                    f"{field}.name: replica name {r.name!r} is also {where[r.name]}'s; names must be "
                    "unique (set `name:`)")
            where[r.name] = field
            if r.url in urls:
                raise ValueError(f"{field}.url: {r.url} is also the url of {urls[r.url]}")
            urls[r.url] = field
    _check_containers(config)


def _check_containers(config: Config) -> None:
    """With `docker`, replicas sharing a head node need container names that tell them apart."""
    heads: dict[tuple[str, str], int] = {}
    for m in config.models:
        engine = m.engine or config.engine
        if engine is None or engine.kind != "docker":
            continue
        template = engine.container
        for r in m.replicas:
            key = (template, r.node)
            heads[key] = heads.get(key, 0) + 1
            if heads[key] > 1 and not any(p in template for p in ("{index}", "{port}", "{name}")):
                raise ValueError(
                    f"engine.container {template!r} names one container per node, but {r.node} "
                    "runs several replicas: add {index} or {port} (e.g. vllm-{node}-{index})")


#: Between two transitional phases of one group, the later edge's target wins (a tick killed
#: while writing it left the other nodes one step behind): the driver re-applies that step to
#: every node, idempotently.
_TRANSITIONAL_ORDER = (Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING, Phase.STARTING)


def group_phase(views: tuple[NodeView, ...]) -> tuple[Phase, float | None, bool]:
    """(phase, since, pinned) of a group from its nodes' phases.

    An admin's node makes the whole group the admin's (never touched). Nodes that agree give
    their phase. A transitional phase beats a settled one (a step under way is carried on over
    every node). Settled phases that disagree (a node added to the group, an odd manual
    change) read as RECLAIMING: the group is brought back to serving, service first.
    """
    pinned = any(v.pinned for v in views)
    phases = {v.phase for v in views}
    if Phase.ADMIN in phases:
        return Phase.ADMIN, None, pinned
    if len(phases) == 1:
        (phase,) = phases
    else:
        moving = [p for p in _TRANSITIONAL_ORDER if p in phases]
        phase = moving[-1] if moving else Phase.RECLAIMING
    sinces = [v.phase_since for v in views if v.phase is phase and v.phase_since is not None]
    return phase, (min(sinces) if sinces else None), pinned


def group_views(observation: Observation, config: Config) -> list[GroupView]:
    """The observation's nodes as lend groups, in observation order. A node the config does not
    know is a group of its own with one replica named after it (as before groups existed); a
    group with a node missing from the observation is left out (nothing to act on)."""
    index = group_index(config)
    by_name = {v.name: v for v in observation.nodes}
    seen: set[str] = set()
    out: list[GroupView] = []
    for view in observation.nodes:
        group = index.get(view.name)
        if group is None:
            group = LendGroup((view.name,), (Replica(view.name, view.model, (view.name,), ""),))
        if group.name in seen:
            continue
        seen.add(group.name)
        if len(group.nodes) == 1:
            out.append(GroupView(group, (view,), view.phase, view.phase_since, view.pinned))
            continue
        members = tuple(by_name[n] for n in group.nodes if n in by_name)
        if len(members) != len(group.nodes):
            continue
        phase, since, pinned = group_phase(members)
        out.append(GroupView(group, members, phase, since, pinned))
    return out
