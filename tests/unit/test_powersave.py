"""Power saving: a lent node Slurm powered down stays ours and is powered up at reclaim.

Node states come from captured 22.05 `sinfo --json` and 24.11 node JSON derived from a
captured file (tests/data/slurm-json/*/power/README.md).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle.lifecycle import derive_phase, format_reason
from slurm_idle.model import Action, ActionKind, Phase, SlurmNode
from slurm_idle.powersave import needs_power_up, powered_only, unprotected
from slurm_idle.slurm.parse import parse_nodes
from tests.unit.test_agent import T0, continue_all, make_agent, phases

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm-json"
TAG = "slurm-idle"
STATES = ["powering-down", "powered-down", "power-up-requested", "powering-up"]


def gpu1(release: str, state: str) -> SlurmNode:
    path = (DATA / "22.05/power" / f"sinfo-{state}.json" if release == "22.05"
            else DATA / "24.11/power" / f"scontrol-show-node-{state}.json")
    return next(n for n in parse_nodes(json.loads(path.read_text())) if n.name == "gpu1")


@pytest.mark.parametrize("release", ["22.05", "24.11"])
@pytest.mark.parametrize("state", STATES)
def test_lent_node_keeps_phase_lent_in_every_power_state(release: str, state: str) -> None:
    """POWERING_DOWN, POWERED_DOWN, POWER_UP, POWERING_UP: no Reason of ours, our Comment: lent."""
    node = gpu1(release, state)
    assert powered_only(node) and not node.drained
    assert derive_phase(node, TAG).phase is Phase.LENT


@pytest.mark.parametrize("release", ["22.05", "24.11"])
def test_power_up_that_timed_out_is_the_admins(release: str) -> None:
    """DOWN with Slurm's "ResumeTimeout reached": a dead node, never touched."""
    node = gpu1(release, "resume-timeout-down")
    assert not powered_only(node)
    assert derive_phase(node, TAG).phase is Phase.ADMIN


@pytest.mark.parametrize("release", ["22.05", "24.11"])
def test_needs_power_up_only_before_one_is_asked(release: str) -> None:
    """Powered (or powering) down needs a POWER_UP; once asked or under way it does not."""
    assert needs_power_up(gpu1(release, "powered-down"))
    assert needs_power_up(gpu1(release, "powering-down"))
    assert not needs_power_up(gpu1(release, "power-up-requested"))
    assert not needs_power_up(gpu1(release, "powering-up"))


def test_reclaiming_node_powering_up_stays_reclaiming_but_serving_one_is_unknown() -> None:
    """Our drained node powering up during a reclaim keeps RECLAIMING; a serving node Slurm
    powered off has no engine: UNKNOWN (not counted as serving)."""
    node = gpu1("22.05", "powering-up")
    reclaiming = replace(node, flags=node.flags | {"DRAIN"},
                         reason=format_reason(TAG, Phase.RECLAIMING, T0))
    assert derive_phase(reclaiming, TAG).phase is Phase.RECLAIMING
    serving = replace(gpu1("22.05", "powered-down"), flags=frozenset({"DRAIN", "POWERED_DOWN"}),
                      reason=format_reason(TAG, Phase.SERVING, T0))
    assert derive_phase(serving, TAG).phase is Phase.UNKNOWN


def test_reclaim_of_a_powered_down_lent_node_powers_it_up_and_waits(tmp_path: Path) -> None:
    """Reclaim drains, issues POWER_UP, waits while POWERING_UP, then starts the engine."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = replace(gpu1("22.05", "powered-down"), partitions=("inference", "idle"))
    slurm.power_up_polls = 3
    engine.up["gpu1"] = False
    assert phases(agent)["gpu1"] is Phase.LENT
    obs = agent.observe()
    steps = agent.run_actions(
        [Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")], obs)
    assert [(s.to_phase, s.outcome) for s in steps] == [
        (Phase.RECLAIMING, "ok"), (Phase.STARTING, "ok"), (Phase.SERVING, "ok")]
    log = [entry[:2] for entry in slurm.log if entry[0] in {"drain", "power_up"}]
    assert log[:2] == [("drain", "gpu1"), ("power_up", "gpu1")]
    assert ("power_up", "gpu1") in log and log.count(("power_up", "gpu1")) == 1
    assert engine.up["gpu1"] is True and phases(agent)["gpu1"] is Phase.SERVING
    # The power-up cleared our Reason (as 22.05 does): it was written again while waiting,
    # and the lent Comment came off only once the node was up.
    assert log.count(("drain", "gpu1")) >= 3
    assert slurm.node_map["gpu1"].comment == ""


def test_a_drained_node_whose_reason_slurm_cleared_while_powering_up_is_still_reclaiming() -> None:
    """Drained, no Reason, POWERING_UP, our lent Comment: a reclaim under way (captured 22.05
    state: `IDLE+DRAIN+NOT_RESPONDING+POWERING_UP`, Reason empty); without our Comment: admin."""
    node = gpu1("22.05", "powering-up")
    cleared = replace(node, flags=node.flags | {"DRAIN"}, reason="")
    assert derive_phase(cleared, TAG).phase is Phase.RECLAIMING
    assert derive_phase(replace(cleared, comment=""), TAG).phase is Phase.ADMIN
    assert derive_phase(replace(cleared, reason="admin: disk"), TAG).phase is Phase.ADMIN


def test_power_up_past_the_deadline_carries_over(tmp_path: Path) -> None:
    """A node still POWERING_UP at the tick's deadline stays RECLAIMING, engine not started."""
    agent, slurm, engine, _, clock = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = replace(gpu1("24.11", "powered-down"), partitions=("inference", "idle"))
    slurm.power_up_polls = 10_000
    engine.up["gpu1"] = False
    obs = agent.observe()
    started = clock()
    steps = agent.run_actions(
        [Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")], obs)
    assert clock() - started <= agent.config.timeouts.tick_budget_s + 1
    [step] = [s for s in steps if s.to_phase is Phase.STARTING]
    assert step.outcome == "waiting" and "powering up" in (step.detail or "")
    assert phases(agent)["gpu1"] is Phase.RECLAIMING and ("start", "gpu1") not in engine.log
    slurm.power_up_polls = 0
    slurm._powering.clear()
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}))
    agent.tick()  # carries RECLAIMING on
    assert phases(agent)["gpu1"] is Phase.SERVING


def test_a_reclaim_without_power_saving_never_asks_for_power_up(tmp_path: Path) -> None:
    """An ordinary lent node: reclaimed without any POWER_UP call."""
    agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], comment=f"{TAG}:lent since=2026-12-03T08:43:04Z")
    engine.up["gpu1"] = False
    obs = agent.observe()
    steps = agent.run_actions(
        [Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")], obs)
    assert [s.outcome for s in steps] == ["ok", "ok", "ok"]
    assert not [e for e in slurm.log if e[0] == "power_up"]


def test_unprotected_lists_nodes_outside_every_exclusion() -> None:
    """Names, partitions and DRAIN state exclude; nothing is reported with power saving off."""
    nodes = [SlurmNode(name=f"gpu{i}", state="idle", partitions=("inference", "idle")) for i in (1, 2)]
    on = {"SuspendProgram": "/sbin/suspend", "SuspendTime": "600 sec"}
    assert unprotected(on, nodes) == ["gpu1", "gpu2"]
    assert unprotected({**on, "SuspendExcNodes": "gpu2"}, nodes) == ["gpu1"]
    assert unprotected({**on, "SuspendExcParts": "inference"}, nodes) == []
    assert unprotected({**on, "SuspendExcStates": "DRAIN"}, nodes) == []
    assert unprotected({"SuspendProgram": "(null)"}, nodes) == []


def test_status_warns_of_serving_nodes_slurm_may_suspend(tmp_path: Path) -> None:
    """`status` names the drained (serving) pool nodes outside the suspend exclusions only."""
    from slurm_idle.commands import ReplayRunner
    from slurm_idle.doctor import status_warnings
    from slurm_idle.errors import CommandError

    agent, slurm, *_ = make_agent(tmp_path, planner=continue_all)
    agent.tick()  # all three serving
    slurm.node_map["gpu3"] = replace(slurm.node_map["gpu3"], flags=frozenset(), reason="",
                                     comment=f"{TAG}:lent since=2026-12-03T08:43:04Z")
    config_text = ("SuspendProgram          = /sbin/suspend\nSuspendTime             = 600 sec\n"
                   "SuspendExcNodes         = gpu2\n")
    runner = ReplayRunner({("scontrol", "show", "config"): config_text})
    [line] = status_warnings(agent.config, agent.observe(), runner)
    assert "gpu1" in line and "gpu2" not in line and "gpu3" not in line
    quiet = ReplayRunner({("scontrol", "show", "config"): "SuspendProgram          = (null)\n"})
    assert status_warnings(agent.config, agent.observe(), quiet) == []
    broken = ReplayRunner({("scontrol",): CommandError(["scontrol"], 1, "no controller")})
    assert "cannot read" in status_warnings(agent.config, agent.observe(), broken)[0]


def test_cli_power_up_command_and_already_up_is_a_no_op() -> None:
    """`scontrol update nodename=X state=POWER_UP`; 22.05's rc=1 "Invalid node state" for a
    node that is up (captured) is not an error."""
    from slurm_idle.commands import ReplayRunner
    from slurm_idle.errors import CommandError
    from slurm_idle.slurm.cli_backend import CliBackend

    runner = ReplayRunner({("scontrol", "update"): ""})
    CliBackend(runner).power_up("gpu1")
    assert runner.calls[0][0] == ("scontrol", "update", "nodename=gpu1", "state=POWER_UP")
    up = ReplayRunner({("scontrol",): CommandError(
        ["scontrol"], 1, "slurm_update error: Invalid node state specified")})
    CliBackend(up).power_up("gpu1")
    down = ReplayRunner({("scontrol",): CommandError(["scontrol"], 1, "Unable to contact slurm controller")})
    with pytest.raises(CommandError):
        CliBackend(down).power_up("gpu1")
