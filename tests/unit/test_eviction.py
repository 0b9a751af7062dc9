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


def make_agent(tmp_path: Path, grace_s: float = 10, budget_s: float = 30, signal: str = "",
               foreign: str = "", jobs_model: bool = False):
    jobs = ("\n  - {name: j, placement: jobs, job: {replicas: 1, command: serve, port_base: 9000}}"
            if jobs_model else "")
    cfg = parse_config(f"""
slurm: {{requeue_grace_s: {grace_s}{', default_job_signal: ' + signal if signal else ''}\
{', foreign_job_action: ' + foreign if foreign else ''}}}
engine: {{kind: command, start_command: "true", stop_command: "true", drain_timeout_s: 5}}
models:
  - name: m
    nodes: gpu[1-2]
    url: "http://127.0.0.1:1/{{node}}"{jobs}
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


# --- foreign jobs: another partition's, not ours, on a node the service needs ----------------


def foreign(job_id: int, **kw: object) -> SlurmJob:
    return SlurmJob(job_id=job_id, name=f"f{job_id}", partition="inference", state="RUNNING",
                    nodes=("gpu1",), **kw)  # type: ignore[arg-type]


def test_a_foreign_job_that_ignores_sigterm_is_cancelled_after_the_grace(tmp_path: Path) -> None:
    """`srun -p inference -w gpu1 bash -c "trap '' TERM; sleep 290"` on a lent node: the reclaim
    sends it SIGTERM, waits slurm.requeue_grace_s, then cancels it (foreign_job_action's
    default), and the node serves again within the same tick; journaled as foreign_job."""
    agent, slurm, clock = make_agent(tmp_path)
    slurm.job_list = [foreign(9, batch=False, user="alice")]
    slurm.no_steps = set()  # its step ignores SIGTERM: still there until the grace ends
    started = clock()
    steps = reclaim(agent)
    assert steps[-1].to_phase is Phase.SERVING and steps[-1].outcome == "ok"
    assert slurm.signals == [((9,), "TERM", False)]
    assert ("cancel", "9") in slurm.log and not slurm.requeues
    assert clock() - started >= agent.config.slurm.requeue_grace_s  # warned, then the grace
    records = [r for r in journal(tmp_path) if r.get("event") == "foreign_job"]
    assert [(r["job_id"], r["action"]) for r in records] == [(9, "signalled"), (9, "cancelled")]
    assert records[-1]["partition"] == "inference" and records[-1]["user"] == "alice"
    assert records[-1]["kind"] == "foreign" and "slurm.foreign_job_action" in records[-1]["detail"]


def test_a_foreign_job_keeps_its_grace_even_when_its_steps_end(tmp_path: Path) -> None:
    """A foreign batch job whose step ended on SIGTERM may still be saving in its batch shell:
    it is cancelled only when the grace is over, never at once."""
    agent, slurm, clock = make_agent(tmp_path)
    slurm.job_list = [foreign(9)]
    slurm.no_steps = {9}
    started = clock()
    reclaim(agent)
    assert ("cancel", "9") in slurm.log and clock() - started >= 10


def test_foreign_job_action_requeue_requeues_batch_jobs_and_cancels_sruns(tmp_path: Path) -> None:
    """slurm.foreign_job_action: requeue: a foreign batch job is requeued after the grace, an
    srun/salloc one (Slurm cannot requeue it) is cancelled; neither before the grace."""
    agent, slurm, clock = make_agent(tmp_path, foreign="requeue")
    slurm.job_list = [foreign(9), foreign(10, batch=False)]
    started = clock()
    steps = reclaim(agent)
    assert steps[-1].to_phase is Phase.SERVING
    assert slurm.requeues == [((9,), 0)] and ("cancel", "10") in slurm.log
    assert clock() - started >= 10
    actions = {(r["job_id"], r["action"]) for r in journal(tmp_path) if r.get("event") == "foreign_job"}
    assert actions == {(9, "signalled"), (9, "requeued"), (10, "signalled"), (10, "cancelled")}


def test_a_foreign_job_slurm_will_not_requeue_is_cancelled_not_retried(tmp_path: Path) -> None:
    """foreign_job_action: requeue, but the requeue fails (a --no-requeue job, held): the job is
    cancelled at once instead of holding the node through retries."""
    agent, slurm, _ = make_agent(tmp_path, foreign="requeue")
    slurm.job_list = [foreign(9), foreign(10, requeue=False)]
    slurm.fail_jobs = {9}
    steps = reclaim(agent)
    assert steps[-1].to_phase is Phase.SERVING
    assert ("cancel", "9") in slurm.log and ("cancel", "10") in slurm.log
    assert ((10,), 0) not in slurm.requeues  # not requeueable: cancelled without trying


def test_a_foreign_job_past_the_tick_is_finished_by_the_next_tick_never_stuck(tmp_path: Path) -> None:
    """A grace longer than the tick's time left: the node stays reclaiming, named, and the next
    tick cancels the job once the grace (counted from the drain) is over: serving again."""
    agent, slurm, clock = make_agent(tmp_path, grace_s=20, budget_s=8)
    slurm.job_list = [foreign(9, batch=False)]
    steps = reclaim(agent)
    assert steps[-1].outcome == "waiting"
    assert "job 9 (partition inference), not ours: signalled, cancelled" in (steps[-1].detail or "")
    clock.t += 30
    steps = reclaim(agent)
    assert steps[-1].to_phase is Phase.SERVING and steps[-1].outcome == "ok"
    assert slurm.signals == [((9,), "TERM", False)]  # warned once, by the first tick
    assert ("cancel", "9") in slurm.log


def test_our_replica_jobs_are_not_foreign(tmp_path: Path) -> None:
    """A `placement: jobs` replica job of ours (our Comment, the model's partition, index and
    port) on the node is left alone; a job with a look-alike Comment of an unknown model is not
    ours and is cancelled after the grace."""
    from slurm_idle.replicajobs import format_comment
    from slurm_idle.replicatrust import agent_user, trust_for

    agent, slurm, _ = make_agent(tmp_path, jobs_model=True)
    agent.trust = trust_for(agent.config, create=True, now=T0)
    mine = format_comment("slurm-idle", Phase.SERVING, T0, "j", 0, 9000, trust=agent.trust)
    fake = format_comment("slurm-idle", Phase.SERVING, T0, "nope", 0, 9000, trust=agent.trust)
    slurm.job_list = [foreign(20, comment=mine, user=agent_user()),
                      foreign(21, comment=fake, batch=False, user=agent_user())]
    steps = reclaim(agent)
    assert steps[-1].outcome == "waiting" and "job 20 (partition inference)" not in (steps[-1].detail or "")
    assert slurm.signals == [((21,), "TERM", False)] and ("cancel", "21") in slurm.log
    assert ("cancel", "20") not in slurm.log and [j.job_id for j in slurm.job_list] == [20]
