"""An admin's lend / reclaim / pin / unpin of a `placement: jobs` replica named MODEL#INDEX
(admin_jobs.py), on the in-memory fakes of test_agent_jobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_idle import admin
from slurm_idle.agent import Agent
from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import AdminRecord, Journal, StepOutcome, TransitionRecord
from slurm_idle.model import ActionKind, Phase
from slurm_idle.testing.fakes import FakeSlurm

from .test_agent_jobs import active, make_agent, phases, set_demand


def serving_both(tmp_path: Path) -> tuple[Agent, FakeSlurm]:
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    for _ in range(3):
        agent.tick()
    assert phases(agent) == [Phase.SERVING, Phase.SERVING]
    return agent, slurm


def journal(agent: Agent) -> list[object]:
    return list(Journal(Path(agent.config.paths.journal)).typed())


def test_lend_then_reclaim_a_replica_by_name(tmp_path: Path) -> None:
    """`lend jm#0` cancels that replica's job after its drain (journaled transitions, the
    other replica untouched); `reclaim jm#0` submits it again and it serves."""
    agent, slurm = serving_both(tmp_path)
    other = next(j.job_id for j in active(slurm) if "index=1 " in j.comment)
    result = admin.force(agent, "jm#0", ActionKind.LEND)
    assert [(s.node, s.to_phase) for s in result.steps] == [
        ("jm#0", Phase.RETIRING), ("jm#0", Phase.LENDING), ("jm#0", Phase.LENT)]
    assert phases(agent) == [Phase.LENT, Phase.SERVING]
    assert [j.job_id for j in active(slurm)] == [other]
    moves = [(r.node, r.to_phase) for r in journal(agent) if isinstance(r, TransitionRecord)]
    assert ("jm#0", "lent") in [(n, str(p)) for n, p in moves]
    result = admin.force(agent, "jm#0", ActionKind.RECLAIM)
    assert result.steps[0].to_phase is Phase.RECLAIMING
    assert phases(agent) == [Phase.SERVING, Phase.SERVING]


def test_refusals_say_why(tmp_path: Path) -> None:
    """Unknown replica names, a lend of a lent replica and a reclaim of a serving one are
    refused with one line naming the phase; --dry-run changes nothing."""
    agent, slurm = serving_both(tmp_path)
    with pytest.raises(SlurmIdleError, match=r"jm#7 is not a replica .*jm#0, jm#1"):
        admin.force(agent, "jm#7", ActionKind.LEND)
    with pytest.raises(SlurmIdleError, match="jm#1 is serving, not lent"):
        admin.force(agent, "jm#1", ActionKind.RECLAIM)
    before = list(slurm.log)
    result = admin.force(agent, "jm#1", ActionKind.LEND, dry_run=True)
    assert result.dry_run and result.action is not None and not result.steps
    assert [e for e in slurm.log[len(before):] if e[0] in {"cancel", "set_job_comment"}] == []


def test_pin_keeps_a_replica_from_being_lent(tmp_path: Path) -> None:
    """`pin jm#1` writes the pin into its job's Comment (an admin record); under low load the
    planner then lends jm#0 instead, and `lend jm#1` is refused; `unpin` releases it."""
    agent, slurm = serving_both(tmp_path)
    result = admin.pin(agent, "jm#1")
    assert result.message.startswith("jm#1 pinned (serving")
    pinned = [j for j in active(slurm) if "index=1 " in j.comment]
    assert pinned and " pinned sig=" in pinned[0].comment
    (record,) = [r for r in journal(agent) if isinstance(r, AdminRecord)]
    assert (record.node, record.command, record.outcome) == ("jm#1", "pin", StepOutcome.OK)
    assert [r.pinned for r in agent.observe().replica_jobs] == [False, True]
    with pytest.raises(SlurmIdleError, match="jm#1 is pinned"):
        admin.force(agent, "jm#1", ActionKind.LEND)
    set_demand(agent.metrics, 10.0)  # type: ignore[arg-type]
    agent.tick()
    assert phases(agent) == [Phase.LENT, Phase.SERVING]  # the unpinned one went
    # The pin survives the driver's own Comment rewrites: still there after the tick.
    assert [r.pinned for r in agent.observe().replica_jobs] == [False, True]
    admin.unpin(agent, "jm#1")
    assert [r.pinned for r in agent.observe().replica_jobs] == [False, False]
    assert admin.unpin(agent, "jm#0").message == "jm#0 is lent; nothing to unpin"


def test_pin_of_a_lent_replica_reclaims_it_pinned(tmp_path: Path) -> None:
    """`pin` of a lent replica submits its job with the pin already in the Comment."""
    agent, slurm = serving_both(tmp_path)
    admin.force(agent, "jm#1", ActionKind.LEND)
    result = admin.pin(agent, "jm#1")
    assert result.action is not None and result.action.kind is ActionKind.RECLAIM
    submits = [e for e in slurm.log if e[0] == "submit"]
    assert any(" pinned sig=" in a for a in submits[-1])
    replica = agent.observe().replica_jobs[1]
    assert replica.pinned and replica.phase is Phase.SERVING


def test_status_shows_a_pinned_replica(tmp_path: Path) -> None:
    """`status --json` replica rows carry `pinned`; the table marks the phase with '*'."""
    from slurm_idle.status import replica_rows

    agent, _ = serving_both(tmp_path)
    admin.pin(agent, "jm#0")
    rows = {r["name"]: r for r in replica_rows(agent.observe(), agent.config)}
    assert rows["jm#0"]["pinned"] is True and rows["jm#1"]["pinned"] is False
