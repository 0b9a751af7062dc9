"""Properties of plan() over random observations: floor, admin, unknown metrics, determinism,
no flapping."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_idle.config import Config
from slurm_idle.model import ActionKind, ModelLoad, NodeView, Observation, Phase
from slurm_idle.policy import apply_actions, plan

from .test_policy_helpers import CAP, NOW, config, node

PHASES = list(Phase)
COMMITTED = {Phase.SERVING, Phase.STARTING, Phase.RECLAIMING, Phase.HELD}


@st.composite
def loads(draw: st.DrawFn, model: str) -> ModelLoad | None:
    if draw(st.integers(0, 9)) == 0:
        return None
    demand = draw(st.floats(0, 6 * CAP))
    return ModelLoad(
        model=model,
        known=draw(st.integers(0, 5)) > 0,
        generation_tokens_per_s=demand,
        prompt_tokens_per_s=draw(st.floats(0, 2 * CAP)),
        waiting=draw(st.sampled_from([0.0, 0.0, 0.0, 3.0])),
        waiting_min_recent=draw(st.sampled_from([None, 0.0, 0.0, 2.0])),
        kv_cache_usage_max=draw(st.floats(0, 1)),
        ttft_p95_s=draw(st.one_of(st.none(), st.floats(0, 5))),
        demand_tokens_per_s_max_window=draw(st.one_of(st.none(), st.floats(demand, 6 * CAP))),
        waiting_max_window=draw(st.sampled_from([None, 0.0, 0.0, 2.0])),
        waiting_min_window=draw(st.sampled_from([None, 0.0, 0.0, 1.0])),
        forecast_demand_tokens_per_s=draw(st.one_of(st.none(), st.floats(0, 6 * CAP))),
        forecast_demand_tokens_per_s_max_window=draw(st.one_of(st.none(), st.floats(0, 6 * CAP))),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Observation, Config]:
    models = draw(st.integers(1, 2))
    replicas = draw(st.integers(1, 6))
    cfg = config(
        replicas=replicas,
        models=models,
        floor=draw(st.integers(0, 3)),
        max_lent_fraction=draw(st.sampled_from([0.0, 0.5, 0.75, 1.0])),
        max_transitions_per_tick=draw(st.integers(1, 4)),
        headroom_replicas=draw(st.integers(0, 1)),
        ttft_p95_slo_s=draw(st.sampled_from([None, 2.0])),
        lending_windows=draw(st.sampled_from([(), ("08:00-10:00",), ("20:00-08:00",)])),
        learn_capacity=draw(st.booleans()),
        reclaim_on_unknown_metrics=draw(st.booleans()),
    )
    views: list[NodeView] = []
    for m in range(models):
        for j in range(replicas):
            phase = draw(st.sampled_from(PHASES))
            views.append(node(
                f"m{m}-n{j}", phase, model=f"m{m}",
                pinned=draw(st.integers(0, 6)) == 0,
                known=draw(st.integers(0, 6)) > 0,
                running=draw(st.sampled_from([0.0, 1.0, 4.0])),
                drained=draw(st.booleans()) if phase is Phase.UNKNOWN else None,
                down=phase is Phase.UNKNOWN and draw(st.booleans()),
                sleeping=draw(st.integers(0, 8)) == 0,
            ))
    model_loads = tuple(x for m in range(models) if (x := draw(loads(f"m{m}"))) is not None)
    return Observation(now=NOW, nodes=tuple(views), models=model_loads), cfg


def asleep(n: NodeView) -> bool:
    return n.replica is not None and n.replica.sleeping


def recoverable(obs: Observation, model: str, cfg: Config | None = None) -> int:
    """Nodes that can serve: not the admin's, not asleep, not dead, and not HELD past
    timeouts.gpu_free_s (someone else holds its GPU: it goes to the admin)."""
    gpu_free_s = (cfg or config()).timeouts.gpu_free_s
    return sum(
        1 for n in obs.nodes
        if n.model == model and n.phase is not Phase.ADMIN and not asleep(n)
        and not (n.phase is Phase.UNKNOWN and (n.node.drained or n.node.down))
        and not (n.phase is Phase.HELD and obs.now - (n.phase_since or obs.now) > gpu_free_s)
    )


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_floor_holds_after_the_plan(scenario: tuple[Observation, Config]) -> None:
    """After the plan, each model has at least min(floor, recoverable nodes) serving or coming,
    not counting serving replicas whose engine sleeps."""
    obs, cfg = scenario
    after = apply_actions(obs, plan(obs, cfg, NOW))
    for model in cfg.models:
        committed = sum(
            1 for n in after.nodes if n.model == model.name and n.phase in COMMITTED and not asleep(n)
        )
        assert committed >= min(model.min_serving_replicas, recoverable(obs, model.name, cfg))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_admin_nodes_never_in_an_action(scenario: tuple[Observation, Config]) -> None:
    """No action ever names a node in ADMIN."""
    obs, cfg = scenario
    admin = {n.name for n in obs.nodes if n.phase is Phase.ADMIN}
    assert not admin & {a.node for a in plan(obs, cfg, NOW)}


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_no_lend_on_unknown_metrics(scenario: tuple[Observation, Config]) -> None:
    """A model whose load or any serving replica's load is unknown gets no LEND."""
    obs, cfg = scenario
    lent_models = {a.model for a in plan(obs, cfg, NOW) if a.kind is ActionKind.LEND}
    for model in lent_models:
        load = obs.model_load(model)
        assert load is not None and load.known
        for n in obs.nodes:
            if n.model == model and n.phase in (Phase.SERVING, Phase.RETIRING):
                assert n.replica is not None and n.replica.known


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_no_lend_while_a_serving_engine_sleeps(scenario: tuple[Observation, Config]) -> None:
    """A model with a serving replica whose engine reports sleeping gets no LEND, and a sleeping
    serving replica is never named by any action."""
    obs, cfg = scenario
    actions = plan(obs, cfg, NOW)
    sleepers = {n.name: n.model for n in obs.nodes if n.phase is Phase.SERVING and asleep(n)}
    assert not set(sleepers) & {a.node for a in actions}
    assert not set(sleepers.values()) & {a.model for a in actions if a.kind is ActionKind.LEND}


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_outside_the_lending_windows_nothing_stays_lent(scenario: tuple[Observation, Config]) -> None:
    """Outside every lending window no node is lent and every LENT node is reclaimed, whether
    the metrics are known or not."""
    obs, cfg = scenario
    from slurm_idle.policy import in_windows

    if in_windows(NOW, cfg.policy.lending_windows, cfg.policy.timezone):
        return
    actions = plan(obs, cfg, NOW)
    assert not [a for a in actions if a.kind is ActionKind.LEND]
    assert not [n for n in apply_actions(obs, actions).nodes if n.phase is Phase.LENT]


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plan_is_deterministic_and_order_free(scenario: tuple[Observation, Config]) -> None:
    """Equal inputs give equal plans, whatever the order the nodes were listed in."""
    obs, cfg = scenario
    first = plan(obs, cfg, NOW)
    assert plan(obs, cfg, NOW) == first
    shuffled = replace(obs, nodes=tuple(reversed(obs.nodes)))
    assert plan(shuffled, cfg, NOW) == first


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_replanning_after_the_plan_does_not_flap(scenario: tuple[Observation, Config]) -> None:
    """With unchanged load, a node lent is not taken back next tick, nor a node taken back lent."""
    obs, cfg = scenario
    first = plan(obs, cfg, NOW)
    lent = {a.node for a in first if a.kind is ActionKind.LEND}
    back = {a.node for a in first if a.kind in (ActionKind.RECLAIM, ActionKind.ABORT_LEND, ActionKind.ADOPT)}
    second = plan(apply_actions(obs, first), cfg, NOW)
    assert not lent & {a.node for a in second if a.kind in (ActionKind.RECLAIM, ActionKind.ABORT_LEND)}
    assert not back & {a.node for a in second if a.kind is ActionKind.LEND}


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_every_action_is_an_allowed_edge(scenario: tuple[Observation, Config]) -> None:
    """Every action starts from the node's phase and follows the lifecycle table."""
    from slurm_idle.lifecycle import allowed

    obs, cfg = scenario
    phases = {n.name: n.phase for n in obs.nodes}
    actions = plan(obs, cfg, NOW)
    assert len({a.node for a in actions}) == len(actions)  # one action per node
    for a in actions:
        assert a.from_phase is phases[a.node]
        assert allowed(a.from_phase, a.to_phase)
        assert a.reason
