"""The agent under the leadership lease, and the watchdog (leadership.py, watchdog.py), on fakes.

The rules each test guards: a standby never acts; a deposed actor's writes are refused; every
journal record of the actor carries its epoch; the watchdog gives back what is lent once no
agent renewed the lease for ha.dead_after_s (requeueing jobs, never cancelling them), keeps it
lent when the site chose `frozen`, and leaves nodes outside its scope alone.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_idle import policy
from slurm_idle.agent import Agent
from slurm_idle.agent_metrics import Counters, render, set_leadership
from slurm_idle.cli.common import Context
from slurm_idle.config import Config, parse_config
from slurm_idle.leadership import LEASE_JOB_NAME, Deposed, Leadership, Lease, SlurmLeaseStore
from slurm_idle.lifecycle import format_lent_comment, format_reason
from slurm_idle.logs import setup_logging
from slurm_idle.model import Action, ActionKind, ModelLoad, Observation, Phase, SlurmJob
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm
from slurm_idle.watchdog import FROZEN, NO_LEASE, RECLAIMED, watch

from .test_exit_codes import Guarded

T0 = 1_796_205_600.0
LEASE_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.01)


def make_config(tmp_path: Path, name: str = "a", on_dead: str = "safe") -> Config:
    return parse_config(f"""
engine: {{kind: command, start_command: "true {{node}}", stop_command: "true {{node}}", drain_timeout_s: 5}}
models:
  - name: m
    nodes: gpu[1-3]
    url: "http://127.0.0.1:1/{{node}}"
paths:
  journal: {tmp_path}/journal-{name}.jsonl
  lock: {tmp_path}/{name}/tick.lock
timeouts:
  tick_budget_s: 10
ha:
  enabled: true
  lease_s: {LEASE_S}
  dead_after_s: 120
  on_dead: {on_dead}
""")


def lend_one(obs: Observation, cfg: Config, now: float) -> list[Action]:
    """A planner that lends one more node each pass, gpu1 kept (so every pass that may act does)."""
    serving = sorted(v.name for v in obs.nodes if v.phase is Phase.SERVING and v.name != "gpu1")
    return [Action(ActionKind.LEND, n, "m", Phase.SERVING, Phase.RETIRING, "test")
            for n in serving[:1]]


def make_pair(tmp_path: Path) -> tuple[Agent, Agent, FakeSlurm, Clock]:
    """Agents a and b on one cluster (their own journals and locks), one clock."""
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3"])
    for name in ("gpu1", "gpu2", "gpu3"):  # every node serving already
        slurm.node_map[name] = replace(slurm.node_map[name], flags=frozenset({"DRAIN"}),
                                       reason=format_reason("slurm-idle", Phase.SERVING, T0))
    engine = FakeEngine(up={"gpu1": True, "gpu2": True, "gpu3": True})
    clock = Clock()
    agents = []
    for name in ("a", "b"):
        leadership = Leadership(SlurmLeaseStore(slurm, "idle"), name, "host-" + name,
                                lease_s=LEASE_S, settle_s=2.0, clock=clock, mono=clock,
                                sleep=clock.sleep)
        agents.append(Agent(
            config=make_config(tmp_path, name), slurm=slurm,
            metrics=FakeMetrics(models={"m": ModelLoad(model="m")}),
            engine_for=lambda model: engine, planner=lend_one,
            assessor=lambda obs, cfg, now: [], clock=clock, sleep=clock.sleep,
            leadership=leadership))
    return agents[0], agents[1], slurm, clock


def journal(tmp_path: Path, name: str) -> list[dict[str, object]]:
    path = tmp_path / f"journal-{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_only_the_leader_acts_and_its_records_carry_its_epoch(tmp_path: Path) -> None:
    """a claims the empty lease and lends; b, standing by, observes nothing and acts on nothing."""
    a, b, slurm, _ = make_pair(tmp_path)
    result = a.tick()
    assert result.leads and result.standby is None and result.steps
    writes_before = [c for c in slurm.log if c[0] in ("drain", "resume", "set_comment")]
    standby = b.tick()
    assert standby.standby and "a on host-a leads (epoch 1" in standby.standby
    assert not standby.actions and not standby.steps and standby.observation is None
    assert [c for c in slurm.log if c[0] in ("drain", "resume", "set_comment")] == writes_before
    moves = [r for r in journal(tmp_path, "a") if r.get("event") == "transition"]
    assert moves and all(r["epoch"] == 1 and r["instance"] == "a" for r in moves)
    assert journal(tmp_path, "b") == []
    lease_jobs = [j for j in slurm.job_list if j.name == LEASE_JOB_NAME]
    assert len(lease_jobs) == 1 and lease_jobs[0].state == "PENDING"


def test_a_standby_takes_over_after_lease_s_and_the_old_leaders_writes_are_refused(
        tmp_path: Path) -> None:
    """a stops renewing (hung): b watches the record unchanged for lease_s, claims epoch 2,
    journals the change; a's late write raises Deposed and changes nothing."""
    a, b, slurm, clock = make_pair(tmp_path)
    a.tick()
    assert b.tick().standby  # b starts watching
    clock.t += LEASE_S - 1
    assert b.tick().standby  # not yet: the record may still be renewed
    clock.t += 2
    taken = b.tick()
    assert taken.leads and taken.standby is None
    assert b.leadership is not None and b.leadership.epoch == 2
    assert a.leadership is not None and not a.leadership.valid()
    comment_before = slurm.node_map["gpu1"].comment
    with pytest.raises(Deposed):
        a.slurm.set_comment("gpu1", "stale write")
    assert slurm.node_map["gpu1"].comment == comment_before
    changes = [r for r in journal(tmp_path, "b") if r.get("event") == "leadership"]
    assert changes and changes[-1]["change"] == "leader" and changes[-1]["epoch"] == 2
    back = a.tick()  # a wakes up: it stands by now, and says it lost the lease
    assert back.standby and not back.steps
    lost = [r for r in journal(tmp_path, "a") if r.get("event") == "leadership"]
    assert lost[-1]["change"] == "deposed" and lost[-1]["lost_epoch"] == 1


def test_a_clean_stop_hands_the_lease_over_at_once(tmp_path: Path) -> None:
    """release(): the standby takes over on its next pass, without waiting lease_s."""
    a, b, _, _ = make_pair(tmp_path)
    a.tick()
    assert b.tick().standby
    assert a.leadership is not None
    a.leadership.release()
    assert b.tick().leads


def test_textfile_says_who_leads_and_how_old_the_lease_is(tmp_path: Path) -> None:
    """The two gauges, replaced in place; a full render without ha has no samples of them."""
    path = tmp_path / "slurm_idle.prom"
    path.write_text(render(phases={}, needed={}, serving={}, tick_duration_s=1, tick_ts=T0,
                           transitions=[], tick_error=False, floors={},
                           previous=Counters()))
    assert "\nslurm_idle_leader{" not in path.read_text()
    set_leadership(path, "a", True, 4.04)
    set_leadership(path, "a", False, 12.0)
    text = path.read_text()
    assert 'slurm_idle_leader{instance="a"} 0' in text
    assert "slurm_idle_lease_age_seconds 12" in text
    assert text.count("# TYPE slurm_idle_leader gauge") == 1


# --- the watchdog ----------------------------------------------------------------------------


def lent_pool(tmp_path: Path, renewed_ago_s: float, on_dead: str = "safe",
              lease: bool = True) -> tuple[Agent, FakeSlurm, FakeEngine]:
    """gpu1 and gpu2 lent with an idle job each, gpu3 serving; the lease renewed that long ago."""
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3"])
    engine = FakeEngine(up={"gpu1": False, "gpu2": False, "gpu3": True})
    for name in ("gpu1", "gpu2"):
        slurm.node_map[name] = replace(slurm.node_map[name], state="mixed",
                                       comment=format_lent_comment("slurm-idle", T0 - 3600))
    slurm.node_map["gpu3"] = replace(slurm.node_map["gpu3"], flags=frozenset({"DRAIN"}),
                                     reason=format_reason("slurm-idle", Phase.SERVING, T0))
    slurm.job_list = [SlurmJob(job_id=7, name="train", partition="idle", state="RUNNING",
                               nodes=("gpu1",)),
                      SlurmJob(job_id=8, name="eval", partition="idle", state="RUNNING",
                               nodes=("gpu2",))]
    clock = Clock()
    if lease:
        gone = Lease("a", "host-a", 3, T0 - 7200, T0 - renewed_ago_s)
        slurm.job_list.append(SlurmJob(job_id=99, name=LEASE_JOB_NAME, partition="idle",
                                       state="PENDING", comment=gone.comment()))
    agent = Agent(config=make_config(tmp_path, "w", on_dead), slurm=slurm,
                  metrics=FakeMetrics(models={"m": ModelLoad(model="m")}),
                  engine_for=lambda model: engine, planner=policy.plan,
                  assessor=lambda obs, cfg, now: [], clock=clock, sleep=clock.sleep)
    return agent, slurm, engine


def test_the_watchdog_reclaims_its_lent_node_once_no_agent_renewed_the_lease(
        tmp_path: Path) -> None:
    """Dead for 130 s (> 120): gpu1 drained, its job requeued (not cancelled), engine started,
    serving; gpu2, not this watchdog's node, stays lent; the journal says why."""
    agent, slurm, engine = lent_pool(tmp_path, renewed_ago_s=130)
    result = watch(agent, ("gpu1",))
    assert result.verdict == RECLAIMED and not result.failed, result.as_json()
    assert [a.node for a in result.actions] == ["gpu1"]
    assert ("requeue", "7") in slurm.log
    assert not [c for c in slurm.log if c[0] == "cancel"]
    assert engine.up["gpu1"] is True and engine.up["gpu2"] is False
    phases = {v.name: v.phase for v in agent.observe().nodes}
    assert phases["gpu1"] is Phase.SERVING and phases["gpu2"] is Phase.LENT
    records = journal(tmp_path, "w")
    said = [r for r in records if r.get("event") == "watchdog"]
    assert said and said[0]["verdict"] == "reclaimed" and said[0]["nodes"] == ["gpu1"]
    assert any("watchdog: no agent renewed the lease" in str(r.get("reason", ""))
               for r in records if r.get("event") == "transition")


def test_the_watchdog_does_nothing_while_an_agent_renews(tmp_path: Path) -> None:
    agent, slurm, engine = lent_pool(tmp_path, renewed_ago_s=20)
    result = watch(agent, ("gpu1", "gpu2"))
    assert result.verdict == "alive" and not result.actions
    assert engine.up["gpu1"] is False and ("requeue", "7") not in slurm.log


def test_frozen_keeps_the_nodes_lent_and_fails(tmp_path: Path) -> None:
    agent, slurm, engine = lent_pool(tmp_path, renewed_ago_s=500, on_dead="frozen")
    result = watch(agent, ())
    assert result.verdict == FROZEN and result.failed
    assert sorted(a.node for a in result.actions) == ["gpu1", "gpu2"]
    assert engine.up["gpu1"] is False and ("requeue", "7") not in slurm.log


def test_without_a_lease_the_watchdog_waits(tmp_path: Path) -> None:
    agent, _, engine = lent_pool(tmp_path, renewed_ago_s=0, lease=False)
    assert watch(agent, ()).verdict == NO_LEASE
    assert engine.up["gpu1"] is False


def test_the_dry_run_changes_nothing(tmp_path: Path) -> None:
    agent, slurm, engine = lent_pool(tmp_path, renewed_ago_s=500)
    result = watch(agent, (), dry_run=True)
    assert result.verdict == RECLAIMED and sorted(a.node for a in result.actions) == ["gpu1", "gpu2"]
    assert not result.steps and engine.up["gpu1"] is False
    assert not [c for c in slurm.log if c[0] in ("drain", "requeue", "set_comment")]


def run_cli(tmp_path: Path, agent: Agent, text: str, *args: str) -> tuple[int, str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    try:
        result = CliRunner().invoke(
            Guarded(Context(agent_factory=lambda config, read_only=False: agent)),  # type: ignore[arg-type]
            ["--config", str(path), *args])
    finally:
        setup_logging()
    return result.exit_code, result.output


def test_watchdog_command_usage_errors_exit_2(tmp_path: Path) -> None:
    """Without ha, with a node not in the pool, or with --node and --all: exit 2, one line."""
    agent, _, _ = lent_pool(tmp_path, renewed_ago_s=500)
    base = (f"engine: {{kind: command, start_command: 'true', stop_command: 'true'}}\n"
            f"models:\n  - name: m\n    nodes: gpu[1-3]\n    url: 'http://127.0.0.1:1/{{node}}'\n"
            f"paths: {{journal: {tmp_path}/j.jsonl, lock: {tmp_path}/l/tick.lock}}\n")
    code, out = run_cli(tmp_path, agent, base, "watchdog", "--node", "gpu1")
    assert code == 2 and "ha.enabled" in out
    with_ha = base + "ha: {enabled: true}\n"
    code, out = run_cli(tmp_path, agent, with_ha, "watchdog", "--node", "gpu9")
    assert code == 2 and "gpu9" in out
    code, out = run_cli(tmp_path, agent, with_ha, "watchdog", "--node", "gpu1", "--all")
    assert code == 2


def test_watchdog_command_json_and_exit_codes(tmp_path: Path) -> None:
    """--json prints the pass; frozen exits 1."""
    agent, _, _ = lent_pool(tmp_path, renewed_ago_s=500, on_dead="frozen")
    text = (f"engine: {{kind: command, start_command: 'true', stop_command: 'true'}}\n"
            f"models:\n  - name: m\n    nodes: gpu[1-3]\n    url: 'http://127.0.0.1:1/{{node}}'\n"
            f"paths: {{journal: {tmp_path}/j.jsonl, lock: {tmp_path}/l/tick.lock}}\n"
            "ha: {enabled: true, on_dead: frozen}\n")
    code, out = run_cli(tmp_path, agent, text, "watchdog", "--all", "--json")
    assert code == 1
    doc = json.loads(out[out.index("{"):])
    assert doc["verdict"] == "frozen" and doc["lease"]["instance"] == "a"


def test_each_agents_textfile_says_whether_it_leads(tmp_path: Path) -> None:
    """The leader's full tick writes slurm_idle_leader 1 with the rest; the standby's writes 0
    and the lease's age, and nothing it did not observe."""
    from slurm_idle.wiring import _textfile_writer

    a, b, _, clock = make_pair(tmp_path)
    for agent, name in ((a, "a"), (b, "b")):
        agent.config = agent.config.model_copy(update={"paths": agent.config.paths.model_copy(
            update={"textfile": str(tmp_path / f"{name}.prom")})})
        agent.on_tick = _textfile_writer(agent.config)
    a.tick()
    clock.t += 5
    b.tick()
    lead, standby = (tmp_path / "a.prom").read_text(), (tmp_path / "b.prom").read_text()
    assert 'slurm_idle_leader{instance="a"} 1' in lead and "slurm_idle_ticks_total 1" in lead
    assert 'slurm_idle_leader{instance="b"} 0' in standby
    age = next(line for line in standby.splitlines() if line.startswith("slurm_idle_lease_age"))
    assert float(age.split()[1]) >= 5  # since a's claim, before its pass and b's 5 s
    assert "slurm_idle_ticks_total" not in standby


def test_the_watchdogs_fence_stops_it_once_an_agent_renews_again(tmp_path: Path) -> None:
    """StillDead: quiet while the lease stays as found (or within FENCE_READ_S of the last
    read); Deposed once an agent renewed it."""
    from slurm_idle.watchdog import FENCE_READ_S, StillDead, read_lease

    agent, slurm, _ = lent_pool(tmp_path, renewed_ago_s=500)
    seen = read_lease(agent)
    assert seen is not None
    fence = StillDead(agent, seen)
    assert isinstance(agent.clock, Clock)
    agent.clock.t += FENCE_READ_S + 1
    fence()  # unchanged: the write goes through
    back = replace(seen, epoch=seen.epoch + 1, renewed=agent.clock.t)
    slurm.set_job_comment(99, back.comment())
    fence()  # read less than FENCE_READ_S ago: not read again yet
    agent.clock.t += FENCE_READ_S + 1
    with pytest.raises(Deposed):
        fence()


def test_a_standby_that_cannot_read_the_lease_reports_an_error(tmp_path: Path) -> None:
    """Slurm unreachable is not "another agent leads": the pass carries the error (exit 1)."""
    _a, b, slurm, _ = make_pair(tmp_path)
    slurm.fail_on = {"jobs"}
    result = b.tick()
    assert result.standby and result.error and "leadership lease" in result.error


def test_a_damaged_lease_is_no_lease() -> None:
    """NaN never equals itself and infinity never ages: either would stall the election."""
    good = Lease("a", "h", 1, T0, T0)
    assert Lease.parse(good.comment()) == good
    assert Lease.parse(good.comment().replace(str(T0), "NaN", 1)) is None
    assert Lease.parse(good.comment().replace(str(T0), "Infinity")) is None


def test_ha_timings_are_checked() -> None:
    """settle_s above lease_s / 5, or dead_after_s below 2 x lease_s, is a config error."""
    from slurm_idle.config import HaConfig

    HaConfig(enabled=True, lease_s=30, settle_s=2, dead_after_s=60)
    with pytest.raises(ValueError, match="settle_s"):
        HaConfig(enabled=True, lease_s=30, settle_s=10)
    with pytest.raises(ValueError, match="dead_after_s"):
        HaConfig(enabled=True, lease_s=30, dead_after_s=45)


def test_an_admin_change_from_a_host_that_does_not_lead_is_refused(tmp_path: Path) -> None:
    """With a live lease held on another host, `lend` exits 3 naming that host; changing
    nothing. `--dry-run` still answers."""
    agent, slurm, _ = lent_pool(tmp_path, renewed_ago_s=5)  # held by host-a, renewed 5 s ago
    text = (f"engine: {{kind: command, start_command: 'true', stop_command: 'true'}}\n"
            f"models:\n  - name: m\n    nodes: gpu[1-3]\n    url: 'http://127.0.0.1:1/{{node}}'\n"
            f"paths: {{journal: {tmp_path}/j.jsonl, lock: {tmp_path}/l/tick.lock}}\n"
            "ha: {enabled: true}\n")
    writes = len([c for c in slurm.log if c[0] in ("drain", "resume", "set_comment")])
    code, out = run_cli(tmp_path, agent, text, "reclaim", "gpu1")
    assert code == 3 and "host-a" in out, out
    assert len([c for c in slurm.log if c[0] in ("drain", "resume", "set_comment")]) == writes


def test_a_group_of_several_nodes_is_driven_by_its_first_nodes_watchdog(tmp_path: Path) -> None:
    """A replica spanning gpu6 and gpu7: gpu7's watchdog leaves the group to gpu6's, which
    reclaims it (two watchdogs driving one group would start its engine twice)."""
    cfg = parse_config(f"""
engine: {{kind: command, start_command: "true {{node}}", stop_command: "true {{node}}", drain_timeout_s: 5}}
models:
  - name: big
    gpus_per_node: 8
    min_serving_replicas: 1
    replicas: [{{nodes: "gpu[6-7]", url: "http://127.0.0.1:9000/gpu6"}}]
paths:
  journal: {tmp_path}/journal-w.jsonl
  lock: {tmp_path}/w/tick.lock
ha: {{enabled: true}}
""")
    slurm = FakeSlurm.with_nodes(["gpu6", "gpu7"], gpus=8)
    for name in ("gpu6", "gpu7"):
        slurm.node_map[name] = replace(slurm.node_map[name], state="idle",
                                       comment=format_lent_comment("slurm-idle", T0 - 3600))
    gone = Lease("a", "host-a", 3, T0 - 7200, T0 - 500)
    slurm.job_list = [SlurmJob(job_id=99, name=LEASE_JOB_NAME, partition="idle",
                               state="PENDING", comment=gone.comment())]
    engine = FakeEngine(up={"gpu6": False, "gpu7": False})
    clock = Clock()
    agent = Agent(config=cfg, slurm=slurm, metrics=FakeMetrics(models={}),
                  engine_for=lambda model: engine, planner=policy.plan,
                  assessor=lambda obs, cfg, now: [], clock=clock, sleep=clock.sleep)
    assert watch(agent, ("gpu7",), dry_run=True).verdict == "nothing-lent"
    assert [a.node for a in watch(agent, ("gpu6",), dry_run=True).actions] != []


def test_a_deposed_agents_textfile_keeps_its_heartbeat_and_drops_what_it_no_longer_sees(
        tmp_path: Path) -> None:
    """After a failover the old leader's file must not keep its phase gauges (counted twice
    beside the new leader's) nor an old tick time (SlurmIdleTickStale for a live standby)."""
    from slurm_idle.wiring import _textfile_writer

    a, b, _, clock = make_pair(tmp_path)
    a.config = a.config.model_copy(update={"paths": a.config.paths.model_copy(
        update={"textfile": str(tmp_path / "a.prom")})})
    a.on_tick = _textfile_writer(a.config)
    a.tick()
    assert 'slurm_idle_nodes{phase="serving"}' in (tmp_path / "a.prom").read_text()
    b.tick()
    clock.t += LEASE_S + 1
    assert b.tick().leads
    clock.t += 7
    assert a.tick().standby
    text = (tmp_path / "a.prom").read_text()
    assert 'slurm_idle_leader{instance="a"} 0' in text
    assert "slurm_idle_nodes{" not in text
    stamp = next(line for line in text.splitlines()
                 if line.startswith("slurm_idle_last_tick_timestamp_seconds"))
    assert float(stamp.split()[1]) == pytest.approx(clock.t, abs=1)


def test_taking_the_lead_forgets_the_engine_names_this_host_issued(tmp_path: Path) -> None:
    """Names issued when this host last led are stale once another leader restarted engines."""
    from slurm_idle.engine import IdentityStore, identity_dir
    from slurm_idle.wiring import forget_identities

    cfg = make_config(tmp_path, "a")
    store = IdentityStore(identity_dir(cfg.paths.journal))
    store.issue("gpu1")
    assert store.current("gpu1") is not None
    forget_identities(cfg)
    assert store.current("gpu1") is None
