"""Reclaim empties a node job by job: each warned with its own signal, given the grace under
the tick's deadline, then requeued, or cancelled when Slurm cannot requeue it (eviction.py)."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_idle.agent import Agent
from slurm_idle.config import parse_config
from slurm_idle.lifecycle import format_lent_comment, format_reason
from slurm_idle.model import Action, ActionKind, ModelLoad, Phase, SlurmJob
from slurm_idle.slurm.parse import JobSignal
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm

T0 = 1_796_205_600.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.01)


def make_agent(tmp_path: Path, grace_s: float = 10, budget_s: float = 30, signal: str = ""):
    cfg = parse_config(f"""
slurm: {{requeue_grace_s: {grace_s}{', default_job_signal: ' + signal if signal else ''}}}
engine: {{kind: command, start_command: "true", stop_command: "true", drain_timeout_s: 5}}
models:
  - name: m
    nodes: gpu[1-2]
    url: "http://127.0.0.1:1/{{node}}"
paths: {{journal: {tmp_path}/journal.jsonl, lock: {tmp_path}/tick.lock}}
timeouts: {{tick_budget_s: {budget_s}}}
""")
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2"])
    slurm.node_map["gpu1"] = slurm.node_map["gpu1"].__class__(
        name="gpu1", state="mixed", comment=format_lent_comment("slurm-idle", T0))
    engine = FakeEngine(up={"gpu1": False, "gpu2": True})
    clock = Clock()
    agent = Agent(config=cfg, slurm=slurm, metrics=FakeMetrics(models={"m": ModelLoad(model="m")}),
                  engine_for=lambda model: engine, planner=lambda o, c, n: [],
                  assessor=lambda o, c, n: [], clock=clock, sleep=clock.sleep)
    return agent, slurm, clock


def reclaim(agent: Agent) -> list:
    obs = agent.observe()
    view = next(v for v in obs.nodes if v.name == "gpu1")
    action = (Action(ActionKind.RECLAIM, "gpu1", "m", Phase.LENT, Phase.RECLAIMING, "load rose")
              if view.phase is Phase.LENT else
              Action(ActionKind.CONTINUE, "gpu1", "m", view.phase, Phase.STARTING, "continue"))
    return agent.run_actions([action], obs)


def job(job_id: int, **kw: object) -> SlurmJob:
    return SlurmJob(job_id=job_id, name=f"j{job_id}", partition="idle", state="RUNNING",
                    nodes=("gpu1",), **kw)  # type: ignore[arg-type]


def journal(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]


def test_an_interactive_job_is_signalled_then_cancelled_and_never_blocks_the_others(
    tmp_path: Path,
) -> None:
    """An srun job (Slurm refuses to requeue it) gets SIGTERM, the grace, then scancel; the
    batch job beside it is requeued at once all the same, and the journal says why."""
    agent, slurm, clock = make_agent(tmp_path)
    slurm.job_list = [job(7), job(8, batch=False)]
    slurm.no_steps = set()  # the srun ignores SIGTERM: its step stays until the grace ends
    started = clock()
    steps = reclaim(agent)
    assert steps[-1].to_phase is Phase.SERVING and steps[-1].outcome == "ok"
    assert slurm.requeues == [((7,), 0)]  # the batch job, alone: never joined with the srun
    assert slurm.signals == [((8,), "TERM", False)]
    assert ("cancel", "8") in slurm.log
    assert clock() - started >= agent.config.slurm.requeue_grace_s  # the grace was given
    cancelled = [r for r in journal(tmp_path) if r.get("event") == "job" and r["action"] == "cancelled"]
    assert [r["job_id"] for r in cancelled] == [8] and "not a batch job" in cancelled[0]["detail"]


def test_one_failing_requeue_does_not_hold_up_the_other_jobs(tmp_path: Path) -> None:
    """Jobs are requeued one by one: a failure is journaled and retried, the others go."""
    agent, slurm, _ = make_agent(tmp_path, budget_s=8)
    slurm.job_list = [job(7), job(8), job(9)]
    slurm.fail_jobs = {8}
    steps = reclaim(agent)
    assert steps[-1].outcome == "waiting" and "job 8: requeue failed" in (steps[-1].detail or "")
    assert ((7,), 0) in slurm.requeues and ((9,), 0) in slurm.requeues
    assert [j.job_id for j in slurm.job_list if j.state == "RUNNING"] == [8]
    errors = [r for r in journal(tmp_path) if r.get("event") == "job" and r["action"] == "error"]
    assert errors and {r["job_id"] for r in errors} == {8}


def test_a_job_not_batch_after_all_is_cancelled_when_slurm_refuses_the_requeue(
    tmp_path: Path,
) -> None:
    """Whatever the job JSON said, Slurm's "Only batch jobs are accepted" leads to a cancel."""
    agent, slurm, _ = make_agent(tmp_path)
    slurm.job_list = [job(7)]
    real_requeue = slurm.requeue

    def refuse(ids, grace_s=0):  # type: ignore[no-untyped-def]
        slurm.job_list = [j.__class__(**{**j.__dict__, "batch": False}) for j in slurm.job_list]
        real_requeue(ids, grace_s)

    slurm.requeue = refuse  # type: ignore[method-assign]
    steps = reclaim(agent)
    assert steps[-1].to_phase is Phase.SERVING
    assert ("cancel", "7") in slurm.log


def test_a_plain_job_gets_its_own_signal_and_the_grace_before_the_requeue(tmp_path: Path) -> None:
    """A submitit-style job (`#SBATCH --signal=B:USR2@60`) gets USR2 on its batch shell, then
    requeue_grace_s to checkpoint, then the requeue (not Slurm's bare SIGTERM at once)."""
    agent, slurm, clock = make_agent(tmp_path)
    slurm.job_list = [job(7)]
    slurm.job_signals = {7: JobSignal("USR2", batch_shell=True)}
    started = clock()
    steps = reclaim(agent)
    assert steps[-1].to_phase is Phase.SERVING
    assert slurm.signals == [((7,), "USR2", True)]
    assert slurm.requeues == [((7,), 0)]
    assert clock() - started >= 10


def test_the_default_signal_goes_to_jobs_without_their_own(tmp_path: Path) -> None:
    """slurm.default_job_signal warns a plain job that asked for nothing."""
    agent, slurm, _ = make_agent(tmp_path, signal="USR1")
    slurm.job_list = [job(7)]
    reclaim(agent)
    assert slurm.signals == [((7,), "USR1", False)]


def test_a_grace_past_the_deadline_carries_over_without_a_second_signal(tmp_path: Path) -> None:
    """The grace is waited under the tick's deadline: what is left carries over to the next
    tick, which counts it from `reclaiming since=` and does not signal again."""
    agent, slurm, clock = make_agent(tmp_path, grace_s=20, budget_s=8)
    slurm.job_list = [job(7)]
    slurm.job_signals = {7: JobSignal("USR2")}
    started = clock()
    first = reclaim(agent)
    assert first[-1].outcome == "waiting" and slurm.requeues == []
    assert clock() - started < 12  # the tick did not wait the whole grace
    reason = format_reason("slurm-idle", Phase.RECLAIMING, started, False)
    assert slurm.node_map["gpu1"].reason.split(" since=")[0] == reason.split(" since=")[0]
    while not slurm.requeues:  # later ticks
        clock.sleep(5)
        reclaim(agent)
    assert clock() - started >= 20
    assert slurm.signals == [((7,), "USR2", False)]  # once
