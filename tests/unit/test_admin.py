"""The admin's pin/unpin/lend/reclaim as a library (slurm_idle.admin) on the shipped fakes, and
the thin CLI over it, given its agent through the click context's factory (no patching)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_idle import admin
from slurm_idle.agent import Agent
from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.config import Config
from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import AdminRecord, Journal, StepOutcome, TransitionRecord
from slurm_idle.model import ActionKind, Phase, SlurmJob
from slurm_idle.transitions import action_for_admin

from .test_agent import continue_all, make_agent, phases

CONFIG = """
engine: {{kind: command, start_command: "true", stop_command: "true", drain_timeout_s: 5}}
models: [{{name: m, nodes: "gpu[1-3]", url: "http://127.0.0.1:1/{{node}}"}}]
paths: {{journal: {tmp}/journal.jsonl, lock: {tmp}/tick.lock}}
timeouts: {{tick_budget_s: 10}}
"""


def adopted(tmp_path: Path) -> tuple[Agent, object]:
    """An agent on fakes whose three nodes have been adopted into serving."""
    agent, slurm, *_ = make_agent(tmp_path, planner=continue_all)
    agent.tick()
    assert set(phases(agent).values()) == {Phase.SERVING}
    return agent, slurm


def journal(agent: Agent) -> list[object]:
    return list(Journal(Path(agent.config.paths.journal)).typed())


def test_pin_rewrites_the_reason_and_journals_it(tmp_path: Path) -> None:
    """pin of a serving node adds `pinned` to its Reason and writes an `admin` record."""
    agent, slurm = adopted(tmp_path)
    result = admin.pin(agent, "gpu1")
    assert result.message == "gpu1 pinned (serving)" and result.action is None
    reason = slurm.node_map["gpu1"].reason  # type: ignore[attr-defined]
    assert reason.startswith("slurm-idle:serving") and reason.endswith(" pinned")
    (record,) = [r for r in journal(agent) if isinstance(r, AdminRecord)]
    assert (record.node, record.command, record.phase, record.outcome) == (
        "gpu1", "pin", "serving", StepOutcome.OK)
    admin.unpin(agent, "gpu1")
    assert not slurm.node_map["gpu1"].reason.endswith("pinned")  # type: ignore[attr-defined]
    assert [r.command for r in journal(agent) if isinstance(r, AdminRecord)] == ["pin", "unpin"]


def test_a_refused_reason_write_is_journaled_as_an_error(tmp_path: Path) -> None:
    """Slurm refusing the drain is raised to the admin and journaled with its error."""
    agent, slurm = adopted(tmp_path)
    slurm.fail_on.add("drain")  # type: ignore[attr-defined]
    with pytest.raises(SlurmIdleError, match="drain failed"):
        admin.pin(agent, "gpu2")
    (record,) = [r for r in journal(agent) if isinstance(r, AdminRecord)]
    assert record.outcome is StepOutcome.ERROR and "drain failed" in record.detail


def test_dry_run_pin_writes_nothing(tmp_path: Path) -> None:
    """pin --dry-run says what Reason it would write; no Slurm write, no journal record."""
    agent, slurm = adopted(tmp_path)
    writes = len([c for c in slurm.log if c[0] == "drain"])  # type: ignore[attr-defined]
    result = admin.pin(agent, "gpu1", dry_run=True)
    assert result.message.startswith("would set gpu1 reason to 'slurm-idle:serving")
    assert len([c for c in slurm.log if c[0] == "drain"]) == writes  # type: ignore[attr-defined]
    assert not [r for r in journal(agent) if isinstance(r, AdminRecord)]


def test_pinned_node_cannot_be_lent_and_admin_nodes_are_refused(tmp_path: Path) -> None:
    """lend refuses a pinned node; every command refuses a node an admin drained."""
    agent, slurm = adopted(tmp_path)
    admin.pin(agent, "gpu1")
    with pytest.raises(SlurmIdleError, match="pinned"):
        admin.force(agent, "gpu1", ActionKind.LEND)
    slurm.drain("gpu2", "admin: disk check")  # type: ignore[attr-defined]
    for call in (lambda: admin.force(agent, "gpu2", ActionKind.LEND),
                 lambda: admin.force(agent, "gpu2", ActionKind.RECLAIM),
                 lambda: admin.pin(agent, "gpu2")):
        with pytest.raises(SlurmIdleError, match="admin"):
            call()
    assert slurm.node_map["gpu2"].reason == "admin: disk check"  # type: ignore[attr-defined]


def test_lend_then_reclaim_walk_the_lifecycle(tmp_path: Path) -> None:
    """force(LEND) walks serving -> lent; force(RECLAIM) requeues the lent job and serves."""
    agent, slurm = adopted(tmp_path)
    lent = admin.force(agent, "gpu1", ActionKind.LEND)
    assert [s.to_phase for s in lent.steps] == [Phase.RETIRING, Phase.LENDING, Phase.LENT]
    slurm.job_list.append(SlurmJob(7, "train", "idle", "RUNNING", ("gpu1",)))  # type: ignore[attr-defined]
    with pytest.raises(SlurmIdleError, match="lent, not serving"):
        admin.force(agent, "gpu1", ActionKind.LEND)
    back = admin.force(agent, "gpu1", ActionKind.RECLAIM)
    assert [s.to_phase for s in back.steps] == [Phase.RECLAIMING, Phase.STARTING, Phase.SERVING]
    assert (7,) in [ids for ids, _ in slurm.requeues]  # type: ignore[attr-defined]
    moves = [(r.from_phase, r.to_phase) for r in journal(agent)
             if isinstance(r, TransitionRecord) and r.action in ("lend", "reclaim")]
    assert moves[-1] == ("starting", "serving") and len(moves) == 6


def test_pin_of_a_lent_node_reclaims_it_and_keeps_it_pinned(tmp_path: Path) -> None:
    """pin of a lent node reclaims it; it comes back serving with `pinned` in its Reason."""
    agent, slurm = adopted(tmp_path)
    admin.force(agent, "gpu3", ActionKind.LEND)
    assert admin.pin(agent, "gpu3", dry_run=True).message == "would reclaim gpu3 and keep it serving"
    result = admin.pin(agent, "gpu3")
    assert result.steps[-1].to_phase is Phase.SERVING
    assert slurm.node_map["gpu3"].reason.endswith(" pinned")  # type: ignore[attr-defined]


def test_a_held_lock_refuses_the_command(tmp_path: Path) -> None:
    """An admin command never races a tick: with the lock held it fails and names the holder."""
    from slurm_idle.lock import try_lock

    agent, _ = adopted(tmp_path)
    with try_lock(agent.config.paths.lock) as locked:
        assert locked
        with pytest.raises(SlurmIdleError, match="a tick is running"):
            admin.pin(agent, "gpu1")


def test_action_for_admin_refuses_an_edge_the_table_lacks(tmp_path: Path) -> None:
    """A reclaim of a serving node is no edge of the lifecycle: action_for_admin refuses it."""
    agent, _ = adopted(tmp_path)
    view = agent.observe().nodes[0]
    with pytest.raises(SlurmIdleError):
        action_for_admin(view, ActionKind.RECLAIM, "admin")


# --- the CLI over it -----------------------------------------------------------------------


def cli(tmp_path: Path, agent: Agent, *args: str) -> tuple[int, str]:
    """Run the CLI with `agent` handed in through the context's factory."""
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(tmp=tmp_path))
    seen: list[bool] = []

    def factory(config: Config, *, read_only: bool = False) -> Agent:
        seen.append(read_only)
        return agent

    result = CliRunner().invoke(main, ["--config", str(path), *args],
                                obj=Context(agent_factory=factory))
    assert len(seen) == 1
    return result.exit_code, result.stdout


def test_cli_lend_json_prints_the_library_steps(tmp_path: Path) -> None:
    """`lend NODE --json` prints the action and steps admin.force returned."""
    agent, _ = adopted(tmp_path)
    code, out = cli(tmp_path, agent, "lend", "gpu2", "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["action"]["kind"] == "lend" and [s["to"] for s in doc["steps"]] == [
        "retiring", "lending", "lent"]


def test_cli_pin_and_refusal(tmp_path: Path) -> None:
    """`pin` prints one line; `lend` of the pinned node fails with the library's refusal
    (unguarded here: run_guarded turns it into exit 3, tests/unit/test_exit_codes.py)."""
    agent, _ = adopted(tmp_path)
    code, out = cli(tmp_path, agent, "pin", "gpu1")
    assert (code, out.strip()) == (0, "gpu1 pinned (serving)")
    code, _ = cli(tmp_path, agent, "lend", "gpu1")
    assert code == 1


def test_cli_unpin_of_a_lent_node_has_nothing_to_do(tmp_path: Path) -> None:
    """`unpin` of a lent node says so and writes nothing."""
    agent, _ = adopted(tmp_path)
    admin.force(agent, "gpu1", ActionKind.LEND)
    code, out = cli(tmp_path, agent, "unpin", "gpu1")
    assert (code, out.strip()) == (0, "gpu1 is lent; nothing to unpin")



def test_explain_shows_an_admin_pin(tmp_path: Path) -> None:
    """`explain NODE` tells an admin's pin from the journal, in text and in `--json`."""
    agent, _ = adopted(tmp_path)
    admin.pin(agent, "gpu1")
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(tmp=tmp_path))
    text = CliRunner().invoke(main, ["--config", str(path), "explain", "gpu1"]).stdout
    assert "gpu1: pin by an admin while serving" in text
    doc = json.loads(CliRunner().invoke(main, ["--config", str(path), "explain", "gpu1",
                                               "--json"]).stdout)
    assert [(r["command"], r["outcome"]) for r in doc["admin"]] == [("pin", "ok")]
