"""The edge table is the one source of the lifecycle: taking out any single edge changes exactly
the consumers that use that edge (driver, planner, simulator, wiring, metrics), and nothing else.

Each consumer is probed at an edge: what it does with the edge's from-phase (and, for "takes
traffic", its to-phase). A probe "fails" when its answer on a table without the edge differs
from its answer on the full table (or it raises).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle import lifecycle
from slurm_idle.agent import TickResult
from slurm_idle.agent_metrics import write_textfile
from slurm_idle.errors import SlurmIdleError
from slurm_idle.lifecycle import EDGES, Edge, Lifecycle, Ready, format_lent_comment, format_reason
from slurm_idle.model import Action, ActionKind, GroupView, LendGroup, ModelLoad, NodeView, Phase
from slurm_idle.policy import assess, plan
from slurm_idle.policy.planner import _stuck
from slurm_idle.sim.engine import FleetModel, SimParams, Simulation
from slurm_idle.testing.fakes import FakeEngine, FakeSlurm
from slurm_idle.traces import Series, Trace
from slurm_idle.transitions import NodeDriver
from slurm_idle.wiring import serving_after

from .test_agent import T0, Clock, make_config
from .test_policy_helpers import NOW, config, load, node, observation

TAG = "slurm-idle"
LONG_AGO = 10**7  # seconds: older than every timeout

Probe = Callable[[Edge, Path], Hashable]


def _label(edge: Edge) -> str:
    return f"{edge.from_phase.value}->{edge.to_phase.value}"


# --- the probes, one per consumer --------------------------------------------------------------


def probe_check_transition(edge: Edge, tmp_path: Path) -> Hashable:
    return lifecycle.check_transition(edge.from_phase, edge.to_phase)


def probe_driver_step(edge: Edge, tmp_path: Path) -> Hashable:
    """The driver's first step of `edge` on fakes: its outcome and error."""
    cfg = make_config(tmp_path)
    slurm = FakeSlurm.with_nodes(["gpu1"])
    n = slurm.node_map["gpu1"]
    if edge.from_phase is Phase.LENT:
        slurm.node_map["gpu1"] = replace(n, state="mixed", comment=format_lent_comment(TAG, T0))
    elif edge.from_phase is not Phase.UNKNOWN:
        slurm.node_map["gpu1"] = replace(n, flags=frozenset({"DRAIN"}),
                                         reason=format_reason(TAG, edge.from_phase, T0))
    engine = FakeEngine(up={"gpu1": edge.from_phase in (Phase.SERVING, Phase.RETIRING, Phase.STARTING)})
    clock = Clock()
    driver = NodeDriver(cfg, slurm, lambda model: engine, clock, clock.sleep)
    info = lifecycle.derive_phase(slurm.node_map["gpu1"], TAG)
    view = NodeView(node=slurm.node_map["gpu1"], model="m", phase=info.phase, phase_since=info.since)
    action = Action(ActionKind.CONTINUE, "gpu1", "m", edge.from_phase, edge.to_phase, "probe")
    first = driver.drive(view, action, deadline=clock() + 10.0)[0]
    return first.to_phase, first.outcome, first.error


def _group(phase: Phase) -> GroupView:
    view = replace(node("m0-n0", phase), phase_since=NOW - LONG_AGO)
    return GroupView(LendGroup(("m0-n0",), ()), (view,), phase, view.phase_since, False)


def probe_driver_overdue(edge: Edge, tmp_path: Path) -> Hashable:
    driver = NodeDriver(config(), FakeSlurm.with_nodes([]), lambda model: FakeEngine(), Clock(),
                        Clock().sleep)
    return driver._overdue(_group(edge.from_phase), NOW)


def probe_planner_carry_on(edge: Edge, tmp_path: Path) -> Hashable:
    """What the planner does with a group in the from-phase (CONTINUE follows next_phase)."""
    obs = observation(node("m0-n0", edge.from_phase), *(node(f"m0-n{i}") for i in (1, 2, 3)),
                      loads=(load(100.0),))
    return tuple((a.kind, a.to_phase) for a in plan(obs, config(), NOW) if a.node == "m0-n0")


def probe_planner_stuck(edge: Edge, tmp_path: Path) -> Hashable:
    return _stuck(_group(edge.from_phase), config(), NOW)


def _planner_traffic(phase: Phase) -> int:
    obs = observation(node("m0-n0", phase), loads=(load(100.0),))
    return assess(obs, config(replicas=1), NOW)[0].serving_replicas


def probe_planner_traffic(edge: Edge, tmp_path: Path) -> Hashable:
    return _planner_traffic(edge.from_phase), _planner_traffic(edge.to_phase)


def _sim(phase: Phase) -> Simulation:
    trace = Trace(start=NOW, steps=1, series={"m": Series(rps=(1.0,), prompt_tokens=(1.0,), output_tokens=(1.0,))})
    sim = Simulation(trace, [FleetModel("m", 1, 1, 1000.0)], SimParams())
    for n in sim.by_name.values():
        n.phase, n.since = phase, NOW - LONG_AGO
    return sim


def probe_sim_apply(edge: Edge, tmp_path: Path) -> Hashable:
    sim = _sim(edge.from_phase)
    [n] = sim.by_name.values()
    return sim.apply(Action(ActionKind.RECLAIM, n.name, "m", edge.from_phase, edge.to_phase, "probe"), NOW)


def probe_sim_latency(edge: Edge, tmp_path: Path) -> Hashable:
    try:
        return SimParams().latency(edge.from_phase)
    except KeyError:
        return None


class _Idle:
    name = "idle"
    auto_continue = False

    def decide(self, sim: Simulation, minute: int, now: float) -> list[Action]:
        return []


def _sim_traffic(phase: Phase) -> int:
    return _sim(phase).run(_Idle()).timeline["m"][0][0]


def probe_sim_traffic(edge: Edge, tmp_path: Path) -> Hashable:
    return _sim_traffic(edge.from_phase), _sim_traffic(edge.to_phase)


def _wiring_traffic(phase: Phase) -> int:
    obs = observation(node("m0-n0", phase), loads=(ModelLoad(model="m0"),))
    return serving_after(TickResult(observation=obs), config(replicas=1)).get("m0", 0)


def probe_wiring_traffic(edge: Edge, tmp_path: Path) -> Hashable:
    return _wiring_traffic(edge.from_phase), _wiring_traffic(edge.to_phase)


def probe_metrics_labels(edge: Edge, tmp_path: Path) -> Hashable:
    path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.prom"  # a new file: no earlier counters
    write_textfile(path, phases=None, needed={}, serving={}, tick_duration_s=0.1, tick_ts=1.0,
                   transitions=[], tick_error=False)
    label = f'slurm_idle_transitions_total{{from="{edge.from_phase.value}",to="{edge.to_phase.value}"}}'
    return label in path.read_text()


PROBES: dict[str, Probe] = {
    "check_transition": probe_check_transition,
    "driver_step": probe_driver_step,
    "driver_overdue": probe_driver_overdue,
    "planner_carry_on": probe_planner_carry_on,
    "planner_stuck": probe_planner_stuck,
    "planner_traffic": probe_planner_traffic,
    "sim_apply": probe_sim_apply,
    "sim_latency": probe_sim_latency,
    "sim_traffic": probe_sim_traffic,
    "wiring_traffic": probe_wiring_traffic,
    "metrics_labels": probe_metrics_labels,
}

EVERY_EDGE = {"check_transition", "driver_step", "sim_apply", "metrics_labels"}
#: A timed edge is its phase's forward step: CONTINUE, stuck detection, simulated latency.
FORWARD = {"driver_overdue", "planner_carry_on", "planner_stuck", "sim_latency"}
#: Edges whose `ready` defines which phases take traffic.
TRAFFIC = {"planner_traffic", "sim_traffic", "wiring_traffic"}

EXPECTED: dict[tuple[Phase, Phase], set[str]] = {
    (Phase.SERVING, Phase.RETIRING): EVERY_EDGE,
    (Phase.RETIRING, Phase.LENDING): EVERY_EDGE | FORWARD | TRAFFIC,
    (Phase.RETIRING, Phase.SERVING): EVERY_EDGE,
    (Phase.LENDING, Phase.LENT): EVERY_EDGE | FORWARD,
    (Phase.LENDING, Phase.STARTING): EVERY_EDGE,
    (Phase.LENT, Phase.RECLAIMING): EVERY_EDGE,
    (Phase.RECLAIMING, Phase.STARTING): EVERY_EDGE | FORWARD,
    (Phase.RECLAIMING, Phase.HELD): EVERY_EDGE,
    (Phase.HELD, Phase.STARTING): EVERY_EDGE | FORWARD,
    (Phase.HELD, Phase.ADMIN): EVERY_EDGE,
    (Phase.STARTING, Phase.ADMIN): EVERY_EDGE,
    (Phase.STARTING, Phase.SERVING): EVERY_EDGE | FORWARD | TRAFFIC,
    (Phase.UNKNOWN, Phase.RECLAIMING): EVERY_EDGE,
    (Phase.SERVING, Phase.STARTING): EVERY_EDGE,
}


def _answers(edge: Edge, tmp_path: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, probe in PROBES.items():
        try:
            out[name] = probe(edge, tmp_path)
        except (SlurmIdleError, KeyError, AssertionError) as exc:
            out[name] = ("raised", type(exc).__name__)
    return out


def test_every_edge_has_an_expectation() -> None:
    """The expectations below name every edge of the table, and nothing else."""
    assert set(EXPECTED) == {(e.from_phase, e.to_phase) for e in EDGES}


@pytest.mark.parametrize("edge", EDGES, ids=_label)
def test_removing_an_edge_breaks_exactly_its_consumers(edge: Edge, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `edge`, exactly the consumers that use it answer differently."""
    full = _answers(edge, tmp_path)
    assert full["check_transition"] == edge.why and full["driver_step"][1] != "error"  # type: ignore[index]
    monkeypatch.setattr(lifecycle, "LIFECYCLE", Lifecycle(e for e in EDGES if e is not edge))
    reduced = _answers(edge, tmp_path)
    changed = {name for name in PROBES if reduced[name] != full[name]}
    assert changed == EXPECTED[(edge.from_phase, edge.to_phase)]


def test_takes_traffic_is_serving_and_retiring() -> None:
    """The table makes SERVING (engines came up) and RETIRING (draining) the traffic phases."""
    assert {p for p in Phase if lifecycle.takes_traffic(p)} == {Phase.SERVING, Phase.RETIRING}


def test_every_transitional_phase_is_timed() -> None:
    """RETIRING, LENDING, RECLAIMING, HELD and STARTING each have one forward edge with a
    timeout that names a key of `timeouts`, so each can be reported stuck."""
    cfg = config()
    assert lifecycle.timed_phases() == {Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING,
                                        Phase.HELD, Phase.STARTING}
    assert {p: lifecycle.phase_timeout_s(p, cfg) for p in lifecycle.timed_phases()} == {
        Phase.RETIRING: cfg.timeouts.retire_s, Phase.LENDING: cfg.timeouts.lend_s,
        Phase.RECLAIMING: cfg.timeouts.reclaim_s, Phase.HELD: cfg.timeouts.gpu_free_s,
        Phase.STARTING: cfg.timeouts.start_s,
    }


def test_the_phases_on_the_way_back_are_derived_from_the_table() -> None:
    """RECLAIMING, HELD and STARTING reach serving by their forward steps; RETIRING and
    LENDING settle in LENT first. Without STARTING -> SERVING nothing is on its way back."""
    assert lifecycle.arriving_phases() == {Phase.RECLAIMING, Phase.HELD, Phase.STARTING}
    cut = Lifecycle(e for e in EDGES if (e.from_phase, e.to_phase) != (Phase.STARTING, Phase.SERVING))
    assert cut.arriving == frozenset()


def test_a_timeout_may_be_a_function_of_the_config() -> None:
    """`Edge.timeout` as a callable bounds the phase by what it returns."""
    edge = Edge(Phase.RETIRING, Phase.LENDING, "why", lambda c: 2 * c.timeouts.retire_s,
                Ready.ENGINES_IDLE, lifecycle.Effect.WRITE_PHASE)
    assert edge.timeout_s(config()) == 2 * config().timeouts.retire_s


def test_a_table_with_two_forward_edges_from_one_phase_is_refused() -> None:
    """A phase moves on by one edge only: two timed edges from it make no Lifecycle."""
    twin = replace(EDGES[1], to_phase=Phase.SERVING)
    with pytest.raises(ValueError, match="two timed"):
        Lifecycle((*EDGES[:2], twin))


# --- the table is checked where phases change -------------------------------------------------


def _driver_on(phase: Phase, tmp_path: Path) -> tuple[NodeDriver, FakeSlurm, FakeEngine, NodeView, Clock]:
    slurm = FakeSlurm.with_nodes(["gpu1"])
    n = slurm.node_map["gpu1"]
    if phase is Phase.LENT:
        slurm.node_map["gpu1"] = replace(n, state="mixed", comment=format_lent_comment(TAG, T0))
    else:
        slurm.node_map["gpu1"] = replace(n, flags=frozenset({"DRAIN"}), reason=format_reason(TAG, phase, T0))
    engine = FakeEngine(up={"gpu1": phase is Phase.SERVING})
    clock = Clock()
    driver = NodeDriver(make_config(tmp_path), slurm, lambda model: engine, clock, clock.sleep)
    view = NodeView(node=slurm.node_map["gpu1"], model="m", phase=phase, phase_since=T0)
    return driver, slurm, engine, view, clock


@pytest.mark.parametrize(("from_phase", "to_phase"), [
    (Phase.LENT, Phase.SERVING), (Phase.SERVING, Phase.LENT), (Phase.RETIRING, Phase.STARTING),
    (Phase.LENT, Phase.STARTING), (Phase.RETIRING, Phase.LENT),
], ids=lambda p: p.value)
def test_the_driver_refuses_an_edge_off_the_table(from_phase: Phase, to_phase: Phase,
                                                  tmp_path: Path) -> None:
    """An action off the table (a planner bug) is an error before any Slurm write or engine
    call: the driver checks the edge, it does not pick a step by where the action leads."""
    driver, slurm, engine, view, clock = _driver_on(from_phase, tmp_path)
    action = Action(ActionKind.CONTINUE, "gpu1", "m", from_phase, to_phase, "bug")
    [step] = driver.drive(view, action, deadline=clock() + 10.0)
    assert step.outcome == "error" and step.error is not None and "is not allowed" in step.error
    assert [c for c in slurm.log if c[0] not in ("nodes", "jobs")] == []
    assert engine.log == []


@pytest.mark.parametrize(("phase", "kind"), [
    (Phase.SERVING, ActionKind.RECLAIM), (Phase.LENT, ActionKind.LEND),
    (Phase.STARTING, ActionKind.LEND), (Phase.ADMIN, ActionKind.RECLAIM),
    (Phase.RECLAIMING, ActionKind.RECLAIM),
], ids=str)
def test_an_admin_lend_or_reclaim_off_the_table_is_refused(phase: Phase, kind: ActionKind) -> None:
    """`lend NODE` needs a SERVING node, `reclaim NODE` a LENT or unmanaged one: anything else
    is IllegalTransition, before an action exists."""
    from slurm_idle.transitions import action_for_admin

    view = replace(node("m0-n0", phase), phase=phase)
    with pytest.raises(lifecycle.IllegalTransition):
        action_for_admin(view, kind, "admin")


def test_an_admin_lend_and_reclaim_on_the_table_are_actions() -> None:
    """A SERVING node lends (-> RETIRING); a LENT node reclaims (-> RECLAIMING)."""
    from slurm_idle.transitions import action_for_admin

    lend = action_for_admin(node("m0-n0"), ActionKind.LEND, "admin")
    reclaim = action_for_admin(node("m0-n0", Phase.LENT), ActionKind.RECLAIM, "admin")
    assert (lend.from_phase, lend.to_phase) == (Phase.SERVING, Phase.RETIRING)
    assert (reclaim.from_phase, reclaim.to_phase) == (Phase.LENT, Phase.RECLAIMING)


def test_job_edges_are_the_node_edges_without_the_lending_shortcut() -> None:
    """`placement: jobs` has the same phase changes as node placement but LENDING -> STARTING
    (a cancelled job cannot come back), UNKNOWN -> RECLAIMING (no job is simply LENT), the
    repair SERVING -> STARTING (a replica job's engine is its job's), and its GPU wait is the
    job's own: its script finds a GPU held once the job runs (STARTING -> HELD, not
    RECLAIMING -> HELD) and a hand-over cancels the job (HELD -> LENDING, not HELD -> ADMIN);
    a replica job's start is its job's (no wake to give up on: no STARTING -> ADMIN); every
    transitional phase is timed, and nothing else is allowed."""
    from slurm_idle import lifecycle

    keys = {(e.from_phase, e.to_phase) for e in lifecycle.JOB_EDGES}
    assert keys == ({(e.from_phase, e.to_phase) for e in lifecycle.EDGES} - {
        (Phase.LENDING, Phase.STARTING), (Phase.UNKNOWN, Phase.RECLAIMING),
        (Phase.SERVING, Phase.STARTING), (Phase.RECLAIMING, Phase.HELD), (Phase.HELD, Phase.ADMIN),
        (Phase.STARTING, Phase.ADMIN)}
        | {(Phase.STARTING, Phase.HELD), (Phase.HELD, Phase.LENDING)})
    assert set(lifecycle.JOB_LIFECYCLE.forward) == {Phase.RETIRING, Phase.LENDING,
                                                    Phase.RECLAIMING, Phase.HELD, Phase.STARTING}
    assert lifecycle.job_arriving_phases() == {Phase.RECLAIMING, Phase.HELD, Phase.STARTING}
    with pytest.raises(lifecycle.IllegalTransition):
        lifecycle.job_edge_for(Phase.LENDING, Phase.STARTING)
