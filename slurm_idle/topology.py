"""The fleet's shape, derived from the config: replicas, and the lend groups they join nodes into.

A lend group is a connected set of nodes: two nodes are in one group when a replica spans both,
and every replica on a node belongs to that node's group. In node mode (vLLM outside Slurm)
Slurm lends whole nodes, so a group is lent only when all its replicas are retired. The checks that a
config describes a fleet that can exist are fleetspec.check_topology (run by Config itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_idle.model import GroupView, LendGroup, NodeView, Observation, Phase, Replica

if TYPE_CHECKING:  # config.py -> policy (windows) -> planner -> here: no run-time cycle
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


#: Between two transitional phases of one group, the later edge's target wins (a tick killed
#: while writing it left the other nodes one step behind): the driver re-applies that step to
#: every node, idempotently.
_TRANSITIONAL_ORDER = (Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING, Phase.HELD, Phase.STARTING)


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


def config_node_gpus(config: Config) -> dict[str, int]:
    """GPUs per pool node as the config knows them: `gpus_per_node` where set, else the GPUs of
    the replicas on it (a whole-node replica spanning k nodes: gpus_per_replica / k each). What
    the report falls back on when Slurm's gres cannot be read."""
    out: dict[str, int] = {}
    for m in config.models:
        for r in m.replicas:
            share = len(r.gpus) if r.gpus is not None else max(1, m.gpus_per_replica // len(r.nodes))
            for n in r.nodes:
                out[n] = out.get(n, 0) + share
    for m in config.models:
        if m.gpus_per_node is not None:  # the node's own count, if the replicas leave some free
            for n in {n for r in m.replicas for n in r.nodes}:
                out[n] = max(out[n], m.gpus_per_node)
    return out
