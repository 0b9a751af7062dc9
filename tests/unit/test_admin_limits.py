"""An admin's `lend` obeys the planner's limits in both placements (rules.lend_refusal): the
floor and max_lent_fraction refuse it with exit 2, `--dry-run` too; `--force` lends and is
journaled; and the agent's fast check brings a floor back whoever broke it (rules.below_floor).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle import admin
from slurm_idle.errors import ExitCode, OverLimit
from slurm_idle.journal import AdminRecord, Journal
from slurm_idle.model import ActionKind, Phase
from slurm_idle.policy import fast, fast_plan, rules

from . import test_admin as nodes_admin
from . import test_admin_jobs as jobs_admin
from .test_exit_codes import run
from .test_lend_rules import BACK, L, S, pool


def admin_records(path: str) -> list[AdminRecord]:
    return [r for r in Journal(Path(path)).typed() if isinstance(r, AdminRecord)]


def test_a_lend_below_the_floor_is_refused_with_exit_2_dry_run_too(tmp_path: Path) -> None:
    """Nodes: two of three lent by the admin, the third would leave the model under its floor
    of 1: OverLimit (exit 2) naming min_serving_replicas, with and without --dry-run, and the
    node still serves."""
    agent, _ = nodes_admin.adopted(tmp_path)
    admin.force(agent, "gpu1", ActionKind.LEND)
    admin.force(agent, "gpu2", ActionKind.LEND)
    for dry_run in (True, False):
        with pytest.raises(OverLimit, match=r"m would have 0 serving .*min_serving_replicas 1"):
            admin.force(agent, "gpu3", ActionKind.LEND, dry_run=dry_run)
    assert OverLimit.exit_code == ExitCode.BAD_INPUT == 2
    assert nodes_admin.phases(agent)["gpu3"] is Phase.SERVING


def test_force_lends_below_the_floor_and_journals_the_rule(tmp_path: Path) -> None:
    """Nodes: `--force` lends the last serving node; once lent, an `admin` record names the rule
    it overrode and the result says so (a dry run journals nothing)."""
    agent, _ = nodes_admin.adopted(tmp_path)
    admin.force(agent, "gpu1", ActionKind.LEND)
    admin.force(agent, "gpu2", ActionKind.LEND)
    dry = admin.force(agent, "gpu3", ActionKind.LEND, dry_run=True, override=True)
    assert dry.message.startswith("--force: m would have 0 serving")
    assert admin_records(agent.config.paths.journal) == []
    result = admin.force(agent, "gpu3", ActionKind.LEND, override=True)
    assert [s.to_phase for s in result.steps][-1] is Phase.LENT
    [record] = admin_records(agent.config.paths.journal)
    assert (record.node, record.command, record.phase) == ("gpu3", "lend --force", "serving")
    assert record.detail.startswith("overrode floor: m would have 0 serving")


def test_the_cli_exits_2_and_force_prints_what_it_overrode(tmp_path: Path) -> None:
    """`slurm-idle lend` below the floor: exit 2, one stderr line naming the rule and --force;
    `lend --force --json` lends and says `forced`."""
    agent, _ = nodes_admin.adopted(tmp_path)
    admin.force(agent, "gpu1", ActionKind.LEND)
    admin.force(agent, "gpu2", ActionKind.LEND)
    for args in (("lend", "gpu3"), ("lend", "gpu3", "--dry-run")):
        result = run(tmp_path, agent, *args)
        assert result.exit_code == 2, result.output
        assert "under its floor" in result.stderr and "--force" in result.stderr
    result = run(tmp_path, agent, "lend", "gpu3", "--force", "--json")
    assert result.exit_code == 0, result.output
    assert "under its floor" in json.loads(result.stdout)["forced"]


def test_a_jobs_replica_lend_obeys_the_floor_and_force(tmp_path: Path) -> None:
    """Jobs: the last serving replica of `jm` is refused (exit 2, dry run too); --force lends
    it and journals the rule."""
    agent, _ = jobs_admin.serving_both(tmp_path)
    admin.force(agent, "jm#0", ActionKind.LEND)
    for dry_run in (True, False):
        with pytest.raises(OverLimit, match="jm would have 0 serving"):
            admin.force(agent, "jm#1", ActionKind.LEND, dry_run=dry_run)
    admin.force(agent, "jm#1", ActionKind.LEND, override=True)
    assert jobs_admin.phases(agent) == [Phase.LENT, Phase.LENT]
    [record] = admin_records(agent.config.paths.journal)
    assert (record.node, record.command) == ("jm#1", "lend --force")


@pytest.mark.parametrize("placement", ["nodes", "jobs"])
def test_lend_refusal_counts_the_lent_cap_in_both_placements(placement: str) -> None:
    """max_lent_fraction 0.5 of four, one already lent: one more may go, two may not, naming
    the cap."""
    obs, cfg = pool(placement, (S, S, S, L), max_lent_fraction=0.5)
    assert rules.lend_refusal(obs, cfg, [("m0", True)]) is None
    broken = rules.lend_refusal(obs, cfg, [("m0", True), ("m0", True)])
    assert broken is not None and broken.rule == "max_lent_fraction"
    assert "max_lent_fraction 0.5 (at most 2)" in broken.why


@pytest.mark.parametrize("placement", ["nodes", "jobs"])
def test_the_fast_check_restores_a_broken_floor_in_both_placements(
        placement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica lent (an admin's --force), no load at all: the fast check reclaims one
    for the floor; without below_floor it would wait for the full tick."""
    obs, cfg = pool(placement, (L, L, L))
    acts = fast_plan(obs, cfg, obs.now)
    assert [(a.kind, a.to_phase) for a in acts] == [(ActionKind.RECLAIM, BACK)]
    assert "under its floor 1" in fast.under_pressure(obs, cfg)["m0"][-1]
    monkeypatch.setattr(fast, "below_floor", lambda o, c: {})
    assert fast_plan(obs, cfg, obs.now) == []


@pytest.mark.parametrize("placement", ["nodes", "jobs"])
def test_a_model_at_its_floor_is_not_under_pressure(placement: str) -> None:
    """One serving of three, floor 1, idle: nothing for the fast check (a floor met is no news)."""
    obs, cfg = pool(placement, (S, L, L))
    assert rules.below_floor(obs, cfg) == {}
    assert fast_plan(obs, cfg, obs.now) == []


def test_headcount_leaves_out_an_admins_node() -> None:
    """A node an admin drained is not the model's: neither counted in total nor serving."""
    obs, cfg = pool("nodes", (S, S, L))
    drained = replace(obs, nodes=(obs.nodes[0], replace(obs.nodes[1], phase=Phase.ADMIN), obs.nodes[2]))
    assert rules.headcount(drained, cfg, cfg.model("m0")) == rules.Headcount(2, 1, 1)


@pytest.mark.parametrize("placement", ["nodes", "jobs"])
def test_a_replica_out_of_service_does_not_hold_the_floor(placement: str) -> None:
    """The one serving replica asleep (out of service) serves nothing: the model is under its
    floor."""
    obs, cfg = pool(placement, (S, L))
    obs = replace(obs, nodes=tuple(replace(v, replica=replace(v.replica, sleeping=True))
                                   if v.replica is not None else v for v in obs.nodes),
                  replica_jobs=tuple(replace(r, load=replace(r.load, sleeping=True))
                                     if r.load is not None else r for r in obs.replica_jobs))
    assert rules.below_floor(obs, cfg) == {"m0": "0 serving, under its floor 1"}


@pytest.mark.parametrize("placement", ["nodes", "jobs"])
def test_a_replica_on_its_way_back_holds_the_floor_for_the_fast_check(placement: str) -> None:
    """Nothing serves yet but one replica is starting (the agent just started, or a reclaim
    under way): the floor is on its way, so the fast check reclaims nothing more; once that
    start is stuck past its timeout it no longer counts."""
    obs, cfg = pool(placement, (Phase.STARTING, L, L))
    assert rules.below_floor(obs, cfg) == {}
    assert [a.kind for a in fast_plan(obs, cfg, obs.now)] == [ActionKind.CONTINUE]
    late = obs.now + cfg.timeouts.start_s + 700
    stuck = replace(obs, now=late)
    assert rules.below_floor(stuck, cfg) == {"m0": "0 serving, under its floor 1"}
