"""The planner over lend groups: several replicas per node, replicas spanning nodes, mixed
models. Hypothesis properties over random topologies, and the consolidation rules by example."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_idle.config import Config, EngineConfig, ModelConfig, PolicyConfig, ReplicaConfig
from slurm_idle.model import (
    ActionKind,
    GroupView,
    ModelLoad,
    NodeView,
    Observation,
    Phase,
    ReplicaLoad,
    SlurmNode,
)
from slurm_idle.policy import apply_actions, assess, plan
from slurm_idle.topology import group_views, lend_groups

from .test_policy_helpers import CAP, NOW, load

SETTLED_OR_MOVING = [Phase.SERVING, Phase.SERVING, Phase.SERVING, Phase.LENT, Phase.RETIRING,
                     Phase.LENDING, Phase.RECLAIMING, Phase.STARTING, Phase.ADMIN, Phase.UNKNOWN]
COMMITTED = {Phase.SERVING, Phase.STARTING, Phase.RECLAIMING}
TAKING = {Phase.SERVING, Phase.RETIRING}


def _replicas(draw: st.DrawFn, model: int, first_node: int) -> tuple[list[ReplicaConfig], int]:
    """One model's replicas on fresh nodes from `first_node`: k per 8-GPU node, or 2-node ones."""
    shape = draw(st.sampled_from(["per-node", "per-node", "multi-node"]))
    nodes = draw(st.integers(1, 3))
    out = []
    if shape == "per-node":
        k = draw(st.integers(1, 8))
        gpus = 8 // k
        for n in range(first_node, first_node + nodes):
            for i in range(k):
                out.append(ReplicaConfig.model_validate({
                    "node": f"n{n}", "url": f"http://n{n}:{8000 + i}", "index": i,
                    "gpus": list(range(i * gpus, (i + 1) * gpus)) if k > 1 else None}))
        return out, first_node + nodes
    for n in range(first_node, first_node + 2 * nodes, 2):
        out.append(ReplicaConfig.model_validate({"nodes": [f"n{n}", f"n{n + 1}"],
                                                 "url": f"http://n{n}:8000"}))
    return out, first_node + 2 * nodes


@st.composite
def fleets(draw: st.DrawFn) -> tuple[Observation, Config]:
    models = draw(st.integers(1, 3))
    specs = []
    node = 0
    for m in range(models):
        reps, node = _replicas(draw, m, node)
        specs.append((f"m{m}", reps))
    if models > 1 and draw(st.booleans()):
        # A node shared by two models: m0 on GPUs 0-3, m1 on 4-7 of a node of its own.
        shared = f"n{node}"
        specs[0][1].append(ReplicaConfig.model_validate(
            {"node": shared, "gpus": [0, 1, 2, 3], "url": f"http://{shared}:9000"}))
        specs[1][1].append(ReplicaConfig.model_validate(
            {"node": shared, "gpus": [4, 5, 6, 7], "url": f"http://{shared}:9001"}))
    cfg = Config(
        engine=EngineConfig(kind="command", start_command="start", stop_command="stop"),
        models=tuple(
            ModelConfig(name=name, tokens_per_s_per_replica=CAP, replicas=tuple(reps),
                        min_serving_replicas=draw(st.integers(0, 3)))
            for name, reps in specs
        ),
        policy=PolicyConfig(
            max_lent_fraction=draw(st.sampled_from([0.5, 0.75, 1.0])),
            max_transitions_per_tick=draw(st.integers(1, 4)),
            headroom_replicas=draw(st.integers(0, 1)),
        ),
    )
    views: list[NodeView] = []
    for group in lend_groups(cfg):
        phase = draw(st.sampled_from(SETTLED_OR_MOVING))
        for n in group.nodes:
            node_phase = phase
            if len(group.nodes) > 1 and draw(st.integers(0, 9)) == 0:
                node_phase = draw(st.sampled_from(SETTLED_OR_MOVING))  # a tick killed mid-write
            taking = node_phase in TAKING
            loads = tuple(
                ReplicaLoad(model=r.model, node=r.node, url=r.url, name=r.name,
                            known=draw(st.integers(0, 9)) > 0,
                            running=draw(st.sampled_from([0.0, 0.0, 2.0])),
                            sleeping=draw(st.integers(0, 12)) == 0,
                            healthy=draw(st.sampled_from([None, True, True, False])))
                for r in group.replicas if r.node == n
            ) if taking else ()
            unknown = node_phase is Phase.UNKNOWN
            drained = node_phase not in (Phase.LENT, Phase.UNKNOWN) or (unknown and draw(st.booleans()))
            views.append(NodeView(
                node=SlurmNode(name=n, state="idle", flags=frozenset({"DRAIN"} if drained else ()),
                               gpus_total=8),
                model=group.replicas[0].model, phase=node_phase,
                phase_since=NOW - draw(st.sampled_from([60, 600, 4000])),
                pinned=draw(st.integers(0, 12)) == 0,
                replica=loads[0] if loads else None, replicas=loads))
    model_loads = tuple(
        load(draw(st.floats(0, 8 * CAP)), model=m.name,
             window=draw(st.one_of(st.none(), st.floats(0, 8 * CAP))))
        if draw(st.integers(0, 9)) > 0 else ModelLoad(model=m.name, known=False)
        for m in cfg.models
    )
    return Observation(now=NOW, nodes=tuple(views), models=model_loads), cfg


def _out(g: GroupView, ld: ReplicaLoad | None) -> bool:
    """A replica that counts for nothing: unhealthy, or asleep in a group that claims to serve.
    Asleep in a group coming back (a tick killed mid-reclaim: one node still lent) is what a
    reclaim's start wakes, so it is coming back."""
    return ld is not None and (ld.healthy is False or (ld.sleeping and g.phase is Phase.SERVING))


def _capacity(obs: Observation, cfg: Config, model: str, phases: set[Phase]) -> int:
    """Replicas of `model` in groups now in `phases` that count (see `_out`)."""
    n = 0
    for g in group_views(obs, cfg):
        if g.phase not in phases:
            continue
        for r in g.group.replicas:
            if r.model == model and not _out(g, g.load(r)):
                n += 1
    return n


def _recoverable(obs: Observation, cfg: Config, model: str) -> int:
    n = 0
    for g in group_views(obs, cfg):
        if g.phase is Phase.ADMIN or (g.phase is Phase.UNKNOWN and any(
                v.node.drained or v.node.down for v in g.nodes)):
            continue
        for r in g.group.replicas:
            ld = g.load(r)
            if r.model == model and not (ld is not None and (ld.sleeping or ld.healthy is False)):
                n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_every_model_keeps_its_need_and_floor(fleet: tuple[Observation, Config]) -> None:
    """After every plan each model's replicas serving or coming back reach what it needs (and
    its floor), as far as its recoverable replicas allow."""
    obs, cfg = fleet
    after = apply_actions(obs, plan(obs, cfg, NOW), cfg)
    for verdict in assess(obs, cfg, NOW):
        model = cfg.model(verdict.model)
        committed = _capacity(after, cfg, model.name, COMMITTED)
        want = max(verdict.needed_replicas, model.min_serving_replicas)
        assert committed >= min(want, _recoverable(obs, cfg, model.name)), verdict.reason


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_no_group_with_a_needed_replica_is_lent(fleet: tuple[Observation, Config]) -> None:
    """A LEND takes a whole group only when every model on it still has its need over the
    window serving without it."""
    obs, cfg = fleet
    actions = plan(obs, cfg, NOW)
    lends = [a for a in actions if a.kind is ActionKind.LEND]
    if not lends:
        return
    after = apply_actions(obs, actions, cfg)
    verdicts = {v.model: v for v in assess(obs, cfg, NOW)}
    groups = {g.name: g for g in group_views(obs, cfg)}
    for a in lends:
        for model in groups[a.node].group.models():
            serving = _capacity(after, cfg, model, {Phase.SERVING})
            assert serving >= verdicts[model].needed_replicas
            assert serving >= min(cfg.model(model).min_serving_replicas,
                                  _recoverable(obs, cfg, model))


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_groups_move_as_one_and_none_stays_half_retired(fleet: tuple[Observation, Config]) -> None:
    """An action names a group once, by its key node, from the group's phase, along an allowed
    edge; after it every node of an acted-on group shares one phase; every transitional group
    (a retiring one past timeouts.retire_s included) gets an action; admin groups get none."""
    from slurm_idle.lifecycle import allowed

    obs, cfg = fleet
    actions = plan(obs, cfg, NOW)
    groups = {g.name: g for g in group_views(obs, cfg)}
    assert len({a.node for a in actions}) == len(actions)
    for a in actions:
        g = groups[a.node]
        assert a.from_phase is g.phase and allowed(a.from_phase, a.to_phase)
        assert g.phase is not Phase.ADMIN
    named = {a.node for a in actions}
    for g in groups.values():
        if g.phase in (Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING, Phase.STARTING):
            assert g.name in named
    after = apply_actions(obs, actions, cfg)
    by_name = {v.name: v for v in after.nodes}
    for name in named:
        assert len({by_name[n].phase for n in groups[name].group.nodes}) == 1


# --- by example --------------------------------------------------------------------------------

def _two_per_node(nodes: int, floor: int = 1) -> Config:
    return Config.model_validate({
        "engine": {"kind": "command", "start_command": "s", "stop_command": "t"},
        "models": [{"name": "m0", "nodes": f"g[1-{nodes}]", "replicas_per_node": 2,
                    "url": "http://{node}:800{index}", "tokens_per_s_per_replica": CAP,
                    "min_serving_replicas": floor}],
        "policy": {"max_transitions_per_tick": 8},
    })


def _node(name: str, cfg: Config, phase: Phase = Phase.SERVING, running: float = 0.0,
          gpus: int = 8) -> NodeView:
    loads = tuple(ReplicaLoad(model=m, node=name, url=r.url, name=r.name, running=running)
                  for m, r in cfg.replicas_on(name) if r.node == name)
    return NodeView(node=SlurmNode(name=name, state="idle", flags=frozenset({"DRAIN"}),
                                   gpus_total=gpus),
                    model="m0", phase=phase, phase_since=NOW - 600,
                    replica=loads[0] if loads else None, replicas=loads)


def test_two_replicas_per_node_lend_whole_nodes_only() -> None:
    """Need 3 of 8 replicas on 4 two-replica nodes: 2 nodes are lent (4 replicas serve), never
    a third that would leave 2."""
    cfg = _two_per_node(4)
    obs = Observation(now=NOW, nodes=tuple(_node(f"g{i}", cfg) for i in range(1, 5)),
                      models=(load(1920.0),))  # needs 3 replicas at 800 tok/s each
    lends = [a for a in plan(obs, cfg, NOW) if a.kind is ActionKind.LEND]
    assert len(lends) == 2


def test_idle_groups_are_vacated_first() -> None:
    """Consolidation: the group whose replicas run nothing is lent before a busy one."""
    cfg = _two_per_node(2)
    obs = Observation(now=NOW, nodes=(_node("g1", cfg, running=3.0), _node("g2", cfg)),
                      models=(load(0.5 * CAP),))
    lends = [a.node for a in plan(obs, cfg, NOW) if a.kind is ActionKind.LEND]
    assert lends == ["g2"]


def test_a_group_is_reclaimed_for_its_replicas_of_the_model() -> None:
    """A lent two-replica node brings back two replicas: a deficit of 2 reclaims one node."""
    cfg = _two_per_node(3)
    lent = [replace(_node(f"g{i}", cfg, Phase.LENT), replica=None, replicas=()) for i in (2, 3)]
    obs = Observation(now=NOW, nodes=(_node("g1", cfg), *lent), models=(load(3.2 * CAP),))
    reclaims = [a.node for a in plan(obs, cfg, NOW) if a.kind is ActionKind.RECLAIM]
    assert reclaims == ["g2"]


def test_a_spanning_replica_lends_and_reclaims_both_nodes() -> None:
    """A replica on g[1-2] moves both nodes: the action names g1, apply moves g1 and g2."""
    cfg = Config.model_validate({
        "engine": {"kind": "command", "start_command": "s", "stop_command": "t"},
        "models": [{"name": "m0", "tokens_per_s_per_replica": CAP, "min_serving_replicas": 1,
                    "replicas": [{"nodes": "g[1-2]", "url": "http://g1:8000"},
                                 {"nodes": "g[3-4]", "url": "http://g3:8000"}]}],
    })
    obs = Observation(now=NOW, nodes=tuple(_node(f"g{i}", cfg) for i in range(1, 5)),
                      models=(load(0.1 * CAP),))
    actions = plan(obs, cfg, NOW)
    assert [(a.kind, a.node) for a in actions] == [(ActionKind.LEND, "g1")]
    after = apply_actions(obs, actions, cfg)
    assert [v.phase for v in after.nodes] == [Phase.RETIRING, Phase.RETIRING, Phase.SERVING,
                                              Phase.SERVING]


def test_a_shared_node_is_lent_only_if_both_models_can_spare_it() -> None:
    """A node with replicas of m0 and m1 is not lent while m1 needs its replica there."""
    cfg = Config.model_validate({
        "engine": {"kind": "command", "start_command": "s", "stop_command": "t"},
        "models": [
            {"name": "m0", "tokens_per_s_per_replica": CAP, "replicas": [
                {"node": "g1", "gpus": "0-3", "url": "http://g1:8000"},
                {"node": "g2", "url": "http://g2:8000"}]},
            {"name": "m1", "tokens_per_s_per_replica": CAP, "replicas": [
                {"node": "g1", "gpus": "4-7", "url": "http://g1:8001"}]},
        ],
    })
    nodes = (_node("g1", cfg), _node("g2", cfg, running=1.0))
    busy = Observation(now=NOW, nodes=nodes, models=(load(0.1 * CAP), load(0.5 * CAP, model="m1")))
    assert [a.node for a in plan(busy, cfg, NOW) if a.kind is ActionKind.LEND] == ["g2"]
