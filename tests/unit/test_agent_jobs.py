"""The tick's glue for `placement: jobs` on in-memory fakes: a lend cancels the replica job,
a reclaim submits it, a killed tick converges with no duplicate and no lost replica."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.agent import Agent
from slurm_idle.config import Config, ReplicaConfig, parse_config
from slurm_idle.journal import DuplicateJobRecord
from slurm_idle.model import ModelLoad, Phase, ReplicaLoad, SlurmJob
from slurm_idle.policy.planner import assess, plan
from slurm_idle.testing.fakes import FakeEngine, FakeGpus, FakeMetrics, FakeSlurm
from slurm_idle.wiring import gpus_handed_over

T0 = 1_796_205_600.0


def make_config(tmp_path: Path) -> Config:
    return parse_config(f"""
engine: {{kind: command, start_command: "true", stop_command: "true", drain_timeout_s: 5}}
slurm: {{serve_partition: serve}}
models:
  - name: jm
    placement: jobs
    tokens_per_s_per_replica: 100
    job: {{replicas: 2, command: "serve --port {{port}}", port_base: 9100,
           url: "http://127.0.0.1:{{port}}"}}
policy: {{scale_down_window_s: 60, forecast: false}}
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
  file_sd: {tmp_path}/targets.json
timeouts: {{tick_budget_s: 10}}
""")


class Cluster:
    """A clock whose every sleep lets the fake 'Slurm' start pending serve jobs on gpu8 and
    the fake engines of running replica jobs come up (their name is the replica's)."""

    def __init__(self, slurm: FakeSlurm, engine: FakeEngine) -> None:
        self.t, self.slurm, self.engine = T0, slurm, engine
        self.dead: set[str] = set()  # replicas whose vLLM is gone while their job runs on

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.01)
        jobs = []
        for j in self.slurm.job_list:
            if j.state == "PENDING" and j.partition == "serve":
                j = replace(j, state="RUNNING", nodes=("gpu8",), start_time=self.t)
            jobs.append(j)
        self.slurm.job_list = jobs
        running = {j.comment.split("index=")[1].split(" ")[0] for j in jobs if j.state == "RUNNING"}
        self.engine.up = {f"jm#{i}": str(i) in running and f"jm#{i}" not in self.dead
                          for i in range(2)}


def make_agent(tmp_path: Path, demand: float) -> tuple[Agent, FakeSlurm, FakeMetrics, Cluster]:
    cfg = make_config(tmp_path)
    slurm = FakeSlurm.with_nodes(["gpu8"], gpus=8)
    engine = FakeEngine()
    metrics = FakeMetrics()
    set_demand(metrics, demand)
    cluster = Cluster(slurm, engine)
    agent = Agent(config=cfg, slurm=slurm, metrics=metrics, engine_for=lambda model: engine,
                  planner=plan, assessor=assess, clock=cluster, sleep=cluster.sleep)
    return agent, slurm, metrics, cluster


def set_demand(metrics: FakeMetrics, demand: float) -> None:
    metrics.models = {"jm": ModelLoad("jm", generation_tokens_per_s=demand,
                                      demand_tokens_per_s_max_window=demand, waiting_max_window=0)}
    metrics.replicas = {f"jm#{i}": ReplicaLoad("jm", "gpu8", url=f"http://127.0.0.1:{9100 + i}",
                                               generation_tokens_per_s=demand, name=f"jm#{i}")
                        for i in range(2)}


def active(slurm: FakeSlurm) -> list[SlurmJob]:
    return [j for j in slurm.job_list if j.state in {"PENDING", "RUNNING"}]


def phases(agent: Agent) -> list[Phase]:
    return [r.phase for r in agent.observe().replica_jobs]


def test_reclaim_submits_runs_and_serves(tmp_path: Path) -> None:
    """High load from nothing: both replica jobs are submitted, run, pass health and serve,
    our Comment saying so; Prometheus' targets list both."""
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    for _ in range(3):
        agent.tick()
    assert phases(agent) == [Phase.SERVING, Phase.SERVING]
    assert len(active(slurm)) == 2 and all("slurm-idle:serving" in j.comment for j in active(slurm))
    assert all(j.partition == "serve" for j in active(slurm))
    sd = json.loads((tmp_path / "targets.json").read_text())
    assert sorted(t["targets"][0] for t in sd) == ["127.0.0.1:9100", "127.0.0.1:9101"]


def test_low_load_cancels_one_replica_job(tmp_path: Path) -> None:
    """Low load: one replica retires, its job is cancelled (LENT), the other keeps serving;
    the journal says so, and the targets follow."""
    agent, slurm, metrics, _ = make_agent(tmp_path, demand=150.0)
    for _ in range(3):
        agent.tick()
    set_demand(metrics, 10.0)
    result = agent.tick()
    assert [(s.node, s.from_phase, s.to_phase, s.outcome) for s in result.steps] == [
        ("jm#1", Phase.SERVING, Phase.RETIRING, "ok"), ("jm#1", Phase.RETIRING, Phase.LENDING, "ok"),
        ("jm#1", Phase.LENDING, Phase.LENT, "ok")]
    assert phases(agent) == [Phase.SERVING, Phase.LENT]
    assert ("cancel", "2") in slurm.log
    sd = json.loads((tmp_path / "targets.json").read_text())
    assert [t["targets"][0] for t in sd] == ["127.0.0.1:9100"]


def test_retire_waits_for_requests_in_flight(tmp_path: Path) -> None:
    """A retiring replica with requests in flight is not cancelled until they finish (or the
    drain timeout): the tick carries it over as `waiting`."""
    agent, slurm, metrics, _ = make_agent(tmp_path, demand=150.0)
    for _ in range(3):
        agent.tick()
    set_demand(metrics, 10.0)
    engine = agent.engine_for("jm")
    engine.running["jm#1"] = 3.0
    agent.config = replace_timeouts(agent.config, 2.0)
    result = agent.tick()
    assert result.steps[-1].outcome == "waiting" and result.steps[-1].to_phase is Phase.LENDING
    assert all(e[0] != "cancel" for e in slurm.log)


def replace_timeouts(cfg: Config, budget: float) -> Config:
    return cfg.model_copy(update={"timeouts": cfg.timeouts.model_copy(update={"tick_budget_s": budget})})


class Killed(BaseException):
    """A tick killed mid-step (SIGKILL): nothing after it runs."""


def test_killed_ticks_converge_without_duplicates(tmp_path: Path) -> None:
    """Ticks killed at random Slurm calls during lends and reclaims (40 kills): every replica
    ends with at most one job, the model converges to its need, and nothing of ours is lost."""
    agent, slurm, metrics, _ = make_agent(tmp_path, demand=150.0)
    rng = random.Random(17)
    real: dict[str, Any] = {}
    kills = 0
    for round_ in range(20):
        set_demand(metrics, 150.0 if round_ % 2 == 0 else 10.0)
        for _ in range(2):
            budget = [rng.randint(1, 6)]
            for name in ("submit", "cancel", "set_job_comment", "jobs"):
                real.setdefault(name, getattr(FakeSlurm, name))

                def killer(self: FakeSlurm, *a: Any, _n: str = name, _b: list[int] = budget,
                           **k: Any) -> Any:
                    _b[0] -= 1
                    if _b[0] <= 0:
                        raise Killed(_n)
                    return real[_n](self, *a, **k)

                setattr(slurm, name, killer.__get__(slurm))
            try:
                agent.tick()
            except Killed:
                kills += 1
            for name in real:
                setattr(slurm, name, getattr(FakeSlurm, name).__get__(slurm))
            per_replica = [j.comment.split("index=")[1][0] for j in active(slurm)]
            assert len(per_replica) == len(set(per_replica)), slurm.job_list
        for _ in range(3):
            agent.tick()
        want = 2 if round_ % 2 == 0 else 1
        assert phases(agent).count(Phase.SERVING) == want, (round_, phases(agent))
    assert kills >= 20


@pytest.mark.parametrize("dry", [True])
def test_dry_run_submits_nothing(tmp_path: Path, dry: bool) -> None:
    """`tick --dry-run` plans the reclaim but submits no job."""
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    result = agent.tick(dry_run=dry)
    assert result.actions and not slurm.job_list


def test_a_duplicate_replica_job_is_cancelled(tmp_path: Path) -> None:
    """Two jobs of ours for one replica (a lost race): the running one is kept, the other
    cancelled at the next action on the replica, and the observation says so."""
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    for _ in range(3):
        agent.tick()
    first = active(slurm)[0]
    slurm.job_list.append(replace(first, job_id=99, state="PENDING", nodes=()))
    obs = agent.observe()
    assert any("duplicate replica job(s) 99" in e for e in obs.errors)
    agent.tick()
    assert 99 not in {j.job_id for j in slurm.job_list} and first in slurm.job_list
    [record] = [r for r in agent.journal.typed() if isinstance(r, DuplicateJobRecord)]
    assert (record.kept, record.cancelled, record.error) == (first.job_id, (99,), None)


def test_a_replica_job_pending_too_long_is_stuck_with_slurms_reason(tmp_path: Path) -> None:
    """A replica job Slurm cannot place (no preemptible GPU) stays RECLAIMING; past
    timeouts.reclaim_s the step is `stuck`, an error of the tick, with Slurm's reason."""
    agent, slurm, _, cluster = make_agent(tmp_path, demand=150.0)
    agent.config = replace_timeouts(agent.config, 2.0)
    agent.sleep = lambda s: setattr(cluster, "t", cluster.t + max(s, 0.01))  # nothing starts
    agent.tick()
    submitted = sum(1 for e in slurm.log if e[0] == "submit")
    slurm.job_list = [replace(j, state_reason="ReqNodeNotAvail") for j in slurm.job_list]
    cluster.t += agent.config.timeouts.reclaim_s + 1
    result = agent.tick()
    stuck = [s for s in result.steps if s.outcome == "stuck"]
    assert stuck and all("ReqNodeNotAvail" in (s.error or "") for s in stuck)
    assert result.errors == len(stuck)
    assert sum(1 for e in slurm.log if e[0] == "submit") == submitted == 2  # never a second job


def test_router_told_first_on_lend_and_last_on_reclaim(tmp_path: Path) -> None:
    """With a router: a replica job joins it after /health, before our Comment says serving,
    and leaves it before the Comment says retiring (so before the scancel)."""
    from slurm_idle.router.sync import RouterSet
    from slurm_idle.testing.fake_router import FakeRouter

    text = make_config(tmp_path).model_dump(mode="json")
    text["router"] = {"kind": "command", "remove_command": "true {name}", "add_command": "true {name}"}
    cfg = Config.model_validate(text)
    agent, slurm, metrics, _ = make_agent(tmp_path, demand=150.0)
    agent.config = cfg
    router = FakeRouter(log=slurm.log)
    agent.router = RouterSet(cfg, make=lambda _: router)
    for _ in range(3):
        agent.tick()
    calls = [e for e in slurm.log if e[0] in {"router_add", "set_job_comment"}]
    assert calls[0][0] == "router_add"  # before any replica's Comment says serving
    for index in (0, 1):  # the replicas start side by side: each in its own order
        added = calls.index(("router_add", f"jm#{index}"))
        serving = next(i for i, c in enumerate(calls) if c[0] == "set_job_comment"
                       and "slurm-idle:serving" in c[2] and f"index={index}" in c[2])
        assert added < serving, calls
    assert router.members == {"jm#0": "in", "jm#1": "in"}
    set_demand(metrics, 10.0)
    agent.tick()
    tail = [e[0] for e in slurm.log if e[0] in {"router_remove", "set_job_comment", "cancel"}]
    assert tail[-4:] == ["router_remove", "set_job_comment", "set_job_comment", "cancel"]
    # The reconcile puts a serving replica the router lost back in.
    router.members.pop("jm#0")
    agent.tick()
    assert router.members["jm#0"] == "in"
    # A replica job that died while serving (its job gone: LENT) is taken out of the router.
    set_demand(metrics, 10.0)
    slurm.job_list = [j for j in slurm.job_list if "index=0" not in j.comment]
    agent.router.reconcile(agent.observe())
    assert router.members["jm#0"] == "out"


def test_textfile_counts_replica_jobs(tmp_path: Path) -> None:
    """The agent's metrics count replica jobs: serving per model after the tick's steps (the
    floor alert reads it) and replicas per phase."""
    from slurm_idle.wiring import group_counts, serving_after

    agent, _, metrics, _ = make_agent(tmp_path, demand=150.0)
    result = agent.tick()
    assert serving_after(result, agent.config) == {"jm": 2}
    set_demand(metrics, 10.0)
    result = agent.tick()
    assert serving_after(result, agent.config) == {"jm": 1}
    assert group_counts(result, agent.config)["replicas"][("jm", "lent")] == 1


def test_a_steered_reclaim_submits_with_nodelist(tmp_path: Path) -> None:
    """The planner's steering reaches sbatch as --nodelist, and observe lists the serve
    partition's nodes with their idle jobs (what the steering ranks)."""
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    slurm.node_map["gpu8"] = replace(slurm.node_map["gpu8"], state="allocated", gpus_used=8,
                                     partitions=("serve", "idle"))
    slurm.job_list.append(SlurmJob(50, "train", "idle", "RUNNING", nodes=("gpu8",),
                                   start_time=T0 - 60, gpus=8))
    obs = agent.observe()
    assert [(v.name, [j.job_id for j in v.jobs]) for v in obs.placement_nodes] == [("gpu8", [50])]
    agent.tick()
    submits = [e for e in slurm.log if e[0] == "submit"]
    assert submits and all("--nodelist=gpu8" in e for e in submits)


@pytest.mark.parametrize(("version", "feature", "want"), [
    ("21.08.5", "{node}", "--nodelist=gpu8"),     # no --prefer before 22.05
    ("24.11.5", None, "--nodelist=gpu8"),         # no feature naming the node: hard steering
    ("24.11.5", "{node}", "--prefer=gpu8"),
    ("22.05.8", "host-{node}", "--prefer=host-gpu8"),
])
def test_steering_argv_per_slurm_version(tmp_path: Path, version: str, feature: str | None,
                                         want: str) -> None:
    """A steered reclaim's sbatch argv: `--prefer=FEATURE` on Slurm >= 22.05 with
    slurm.prefer_feature, `--nodelist=NODE` otherwise (never both)."""
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    if feature is not None:
        agent.config = agent.config.model_copy(update={"slurm": agent.config.slurm.model_copy(
            update={"prefer_feature": feature})})
    slurm.slurm_version = version
    slurm.node_map["gpu8"] = replace(slurm.node_map["gpu8"], state="allocated", gpus_used=8,
                                     partitions=("serve", "idle"))
    slurm.job_list.append(SlurmJob(50, "train", "idle", "RUNNING", nodes=("gpu8",),
                                   start_time=T0 - 60, gpus=8))
    agent.tick()
    submits = [e for e in slurm.log if e[0] == "submit"]
    assert submits
    assert {a for e in submits for a in e[1:] if a.startswith(("--prefer", "--nodelist"))} == {want}


def test_steer_args_pure() -> None:
    """steer_args: nothing without a node; an unreadable version keeps --nodelist."""
    from slurm_idle.replicajobs import steer_args

    assert steer_args("", "24.11.5", "{node}") == []
    assert steer_args("gpu1", None, "{node}") == ["--nodelist=gpu1"]
    assert steer_args("gpu1", "garbage", "{node}") == ["--nodelist=gpu1"]
    assert steer_args("gpu1", "24.11.5", "{node}") == ["--prefer=gpu1"]


def test_prefer_feature_is_one_feature_name() -> None:
    """slurm.prefer_feature: {node} is the only placeholder, and it names one feature."""
    from pydantic import ValidationError

    from slurm_idle.config import SlurmConfig

    assert SlurmConfig(prefer_feature="{node}").prefer_feature == "{node}"
    for bad in ("{host}", "a,b", "x&{node}", ""):
        with pytest.raises(ValidationError):
            SlurmConfig(prefer_feature=bad)


class LateRequest(FakeEngine):
    """jm#1's in-flight count at each reading: idle right after it left the targets, then a
    request sent to it just before arrives, then idle again."""

    def __init__(self, readings: list[float]) -> None:
        super().__init__()
        self.readings, self.seen = list(readings), []

    def in_flight(self, replica: ReplicaConfig) -> float | None:
        if replica.name != "jm#1":
            return super().in_flight(replica)
        value = self.readings.pop(0) if self.readings else 0.0
        self.seen.append(value)
        return value


def test_a_retiring_replica_job_is_cancelled_only_when_idle_at_two_readings(tmp_path: Path) -> None:
    """The jobs placement ends a drain as the node placement does (engine.IdleTwice): a first
    idle reading right after the retire is not enough to cancel the replica's job, since a
    request on its way is not counted yet; its job is cancelled after two in a row."""
    agent, _slurm, metrics, cluster = make_agent(tmp_path, demand=150.0)
    engine = LateRequest([0.0, 1.0, 0.0, 0.0])
    engine.up = cluster.engine.up
    cluster.engine = engine
    agent.engine_for = lambda model: engine
    for _ in range(3):
        agent.tick()
    set_demand(metrics, 10.0)
    agent.tick()
    assert phases(agent) == [Phase.SERVING, Phase.LENT]
    assert engine.seen[:4] == [0.0, 1.0, 0.0, 0.0]  # not cancelled at the first idle reading


# --- the GPU wait: the replica job's script checks its GPUs, the agent names and times it ----

class HeldCluster(Cluster):
    """As Cluster, but a starting job runs its script's GPU wait: while its replica is in
    `held`, it writes the `held` Comment its script carries (the one the agent signed at
    submission) and starts no engine; once released, the script's Comment back, then vLLM.
    Each replica's job gets GPUs 4*index..4*index+3 of gpu8."""

    def __init__(self, slurm: FakeSlurm, engine: FakeEngine, held: set[int]) -> None:
        super().__init__(slurm, engine)
        self.held = held

    def sleep(self, s: float) -> None:
        super().sleep(s)
        jobs = []
        for j in self.slurm.job_list:
            index = int(j.comment.split("index=")[1].split(" ")[0])
            if j.state == "RUNNING" and j.comment.split(" ")[0].endswith((":reclaiming", ":held")):
                said = re.findall(r"scontrol update JobId=\S+ Comment='([^']*)'",
                                  self.slurm.scripts[j.job_id])
                held_comment, back_comment = said
                j = replace(j, comment=held_comment if index in self.held else back_comment,
                            gpu_indexes=(tuple(range(4 * index, 4 * index + 4)),))
            jobs.append(j)
        self.slurm.job_list = jobs
        self.engine.up = {f"jm#{i}": up and i not in self.held for i, up in
                          ((int(k[-1]), v) for k, v in self.engine.up.items())}


def make_held_agent(tmp_path: Path, held: set[int]) -> tuple[Agent, FakeSlurm, HeldCluster, FakeGpus]:
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    cluster = HeldCluster(slurm, agent.engine_for("jm"), held)
    gpus = FakeGpus()
    gpus.hold("gpu8", 0, 20000, holder="job 42")  # replica 0's first GPU
    gpus.hold("gpu8", 4, 700)  # replica 1's, within gpu.free_tolerance_mib
    agent.clock, agent.sleep, agent.gpus = cluster, cluster.sleep, gpus
    return agent, slurm, cluster, gpus


def test_a_replica_job_on_a_held_gpu_waits_named_then_serves(tmp_path: Path) -> None:
    """The script of replica 0's job finds GPU 0 held: the job is HELD (its Comment says so),
    the step names the GPU, its MiB and holder, and no engine is asked for; replica 1 serves.
    Once the GPU is free the script starts vLLM and the replica serves."""
    agent, slurm, cluster, _ = make_held_agent(tmp_path, held={0})
    steps = [s for _ in range(3) for s in agent.tick().steps]
    assert phases(agent) == [Phase.HELD, Phase.SERVING]
    waiting = [s for s in steps if s.node == "jm#0" and s.outcome == "waiting"]
    assert waiting and all("gpu8 GPU 0: 20000 MiB held (allowed 1024), holder job 42"
                           in (s.detail or "") for s in waiting)
    assert waiting[-1].from_phase is Phase.HELD and waiting[-1].to_phase is Phase.STARTING
    assert "GPU 4" not in (waiting[-1].detail or "")  # replica 1's GPU is within the tolerance
    cluster.held.clear()
    result = agent.tick()
    assert [(s.from_phase, s.to_phase, s.outcome) for s in result.steps if s.node == "jm#0"] == [
        (Phase.HELD, Phase.STARTING, "ok"), (Phase.STARTING, Phase.SERVING, "ok")]
    assert phases(agent) == [Phase.SERVING, Phase.SERVING]
    assert not any(e[0] in ("drain", "cancel") for e in slurm.log)


def test_a_replica_job_held_past_gpu_free_s_is_handed_over(tmp_path: Path) -> None:
    """Past timeouts.gpu_free_s the held job's node is drained for the admin (the Reason
    naming GPU, MiB and holder) and the job cancelled; the replica is submitted again."""
    agent, slurm, cluster, _ = make_held_agent(tmp_path, held={0})
    for _ in range(3):
        agent.tick()
    held_job = next(r.job_id for r in agent.observe().replica_jobs if r.phase is Phase.HELD)
    cluster.t += agent.config.timeouts.gpu_free_s + 1
    result = agent.tick()
    assert [(s.action, s.from_phase, s.to_phase, s.outcome) for s in result.steps][:1] == [
        ("hand-over", Phase.HELD, Phase.LENDING, "ok")]
    [reason] = [e[2] for e in slurm.log if e[0] == "drain"]
    assert reason.startswith("slurm-idle:gpu-held since=")
    assert "GPU 0: 20000 MiB, holder job 42 -- free them" in reason
    assert ("cancel", str(held_job)) in slurm.log
    assert held_job not in {j.job_id for j in slurm.job_list}
    # The textfile's slurm_idle_gpu_held (alert SlurmIdleGpuHeld) names it: gpu8 is a node of
    # the jobs' partition.
    slurm.node_map["gpu8"] = replace(slurm.node_map["gpu8"], partitions=("serve", "idle"))
    after = agent.tick()
    assert [(g.node, g.gpu, g.used_mib, g.holder) for g in gpus_handed_over(after, agent.config)] == [
        ("gpu8", 0, 20000, "job 42")]
    assert sum(1 for e in slurm.log if e[0] == "submit") == 3  # replica 0 submitted again


def test_a_hand_over_leaves_a_node_an_admin_drained_alone(tmp_path: Path) -> None:
    """A node someone else drained keeps its Reason; the held job is still cancelled."""
    agent, slurm, cluster, _ = make_held_agent(tmp_path, held={0})
    for _ in range(3):
        agent.tick()
    slurm.node_map["gpu8"] = replace(slurm.node_map["gpu8"], flags=frozenset({"DRAIN"}),
                                     reason="admin: new GPUs")
    cluster.t += agent.config.timeouts.gpu_free_s + 1
    agent.tick()
    assert not any(e[0] == "drain" for e in slurm.log)
    assert slurm.node_map["gpu8"].reason == "admin: new GPUs"
    assert any(e[0] == "cancel" for e in slurm.log)
