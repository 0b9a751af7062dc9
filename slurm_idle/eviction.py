"""Emptying a reclaimed node: every job on it handled on its own, each warned, then requeued.

At a reclaim each of the lend partition's jobs on the node gets, independently of the others:
- **our container jobs** (submitted through slurm-idle): SIGTERM to their srun steps (the
  runner checkpoints and stops the container), then `scontrol requeue` once no workload step
  is left or `slurm.requeue_grace_s` has passed;
- **plain batch jobs**: their own `--signal` (read back from the batch script: submitit
  writes `#SBATCH --signal=USR2@90` there; `B:` means the batch shell only) or
  `slurm.default_job_signal`, then the grace, then the requeue; with neither, the requeue at
  once (Slurm's SIGTERM, KillWait, SIGKILL: a script that ends with its step would otherwise
  end COMPLETED before the requeue);
- **interactive jobs** (srun/salloc, which Slurm cannot requeue: "Only batch jobs are
  accepted"): SIGTERM (or the default signal), the grace, then `scancel`. Service first;
- **foreign jobs** (any other partition's, e.g. a job of the serve partition, whose
  PriorityTier lets it take a lent node, that is not one of our replica jobs): SIGTERM to its
  steps, the grace, then `scancel`, or `scontrol requeue` for a batch job when
  `slurm.foreign_job_action` is requeue (cancelled when Slurm refuses). Journaled as
  `event: foreign_job`: a node is never left stuck behind a job that is not ours.
A job whose requeue or cancel fails is retried at the next poll and named in the node's wait
reason; it never holds up the others. Every signal, requeue, cancel and failure is journaled
(`event: job`).

Nothing here waits: `Evictor.step` is called on every poll of the driver's wait loop, which
runs under the tick's deadline through the shared Slurm polls. The grace of a reclaim carried
over from an earlier tick counts from the node's `reclaiming since=` (the jobs were signalled
then), so a later tick neither signals twice nor waits the grace again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from slurm_idle.config import Config
from slurm_idle.errors import SlurmIdleError
from slurm_idle.jobs import parse_job_comment
from slurm_idle.journal import ForeignJobRecord, JobAction, JobRecord
from slurm_idle.logs import get_logger
from slurm_idle.model import SlurmJob
from slurm_idle.slurm.parse import JobSignal, parse_signal_option
from slurm_idle.slurm.protocol import JobControl, NotRequeueable

log = get_logger(__name__)

#: Seconds between two attempts at a failed requeue/cancel of one job (one poll is 1 s).
RETRY_S = 5.0


@dataclass
class JobPlan:
    """What a reclaim does to one job, and how far it got."""

    job_id: int
    kind: str  # container | plain | interactive | foreign
    signal: JobSignal | None  # None: no early warning, finish at once
    signalled_at: float | None = None
    finished: bool = False
    failed_at: float | None = None
    error: str | None = None
    cancel: bool = False  # finished by scancel: an srun/salloc job, or a foreign job to cancel
    partition: str = ""
    user: str = ""

    @property
    def finish(self) -> str:
        return "cancel" if self.cancel else "requeue"


class Evictor:
    """Per-node plans of the jobs being evicted; each node's plans are touched only by the
    thread driving that node."""

    def __init__(
        self,
        config: Config,
        slurm: JobControl,
        clock: Callable[[], float],
        steps: Callable[[], Mapping[int, int]],
        on_event: Callable[[JobRecord], None],
    ) -> None:
        self.config = config
        self.slurm = slurm
        self.clock = clock
        self.steps = steps  # shared poll of slurm.workload_steps()
        self.on_event = on_event
        self._plans: dict[str, dict[int, JobPlan]] = {}

    @property
    def grace_s(self) -> float:
        return self.config.slurm.requeue_grace_s

    def step(self, node: str, jobs: Iterable[SlurmJob], signalled_since: float | None,
             again: bool = False, foreign: Iterable[SlurmJob] = ()) -> list[str]:
        """One pass over the lend partition's `jobs` and the `foreign` jobs on `node`: warn
        the new ones, finish those whose grace is over; returns what still holds the node
        (failures named).

        `signalled_since`: when an earlier tick started this reclaim (its jobs were warned
        then), None when this process drains the node now. `again`: the node is overdue: every
        job is finished once more, whatever was done before.
        """
        plans = self._plans.setdefault(node, {})
        now = self.clock()
        problems = []
        foreign = list(foreign)
        outsiders = {j.job_id for j in foreign}
        for job in [*jobs, *foreign]:
            plan = plans.get(job.job_id)
            if plan is None:
                if job.state != "RUNNING":
                    continue  # COMPLETING/requeued already: leaving the node on its own
                plan = plans[job.job_id] = (self._foreign_plan(job) if job.job_id in outsiders
                                            else self._plan(job))
                if signalled_since is not None and plan.signal is not None:
                    plan.signalled_at = signalled_since  # warned by the tick that drained it
                else:
                    self._warn(node, plan, now)
            elif again:
                plan.finished = False
            if not plan.finished and self._due(plan, now):
                self._finish(node, plan, now)
            if plan.error:
                problems.append(f"job {plan.job_id}: {plan.finish} failed ({plan.error}), retrying")
        return problems

    def _foreign_plan(self, job: SlurmJob) -> JobPlan:
        """Not ours, but on a node the service needs: SIGTERM, the grace, then cancelled (or
        requeued, a requeueable batch job, when slurm.foreign_job_action says so)."""
        cancel = (not job.batch or not job.requeue
                  or self.config.slurm.foreign_job_action == "cancel")
        return JobPlan(job.job_id, "foreign", JobSignal("TERM"), cancel=cancel,
                       partition=job.partition, user=job.user)

    def _plan(self, job: SlurmJob) -> JobPlan:
        default = self.config.slurm.default_job_signal
        fallback = parse_signal_option(default) if default else None
        if not job.batch:
            return JobPlan(job.job_id, "interactive", fallback or JobSignal("TERM"), cancel=True)
        if parse_job_comment(job.comment, self.config.slurm.tag) is not None:
            return JobPlan(job.job_id, "container", JobSignal("TERM"))
        own = None
        reader = getattr(self.slurm, "job_signal", None)
        if reader is not None:
            try:
                own = reader(job.job_id)
            except SlurmIdleError as exc:
                log.warning("job %s: cannot read its --signal (%s)", job.job_id, exc)
        return JobPlan(job.job_id, "plain", own or fallback)

    def _warn(self, node: str, plan: JobPlan, now: float) -> None:
        plan.signalled_at = now
        if plan.signal is None or self.grace_s <= 0:
            return
        try:
            self.slurm.signal([plan.job_id], plan.signal.signal, plan.signal.batch_shell)
        except SlurmIdleError as exc:
            self._event(node, plan, "error", f"signal {plan.signal.signal} failed: {exc}")
            return
        where = "batch shell" if plan.signal.batch_shell else "steps"
        self._event(node, plan, "signalled",
                    f"SIG{plan.signal.signal} to its {where}; {plan.finish} after "
                    f"{self.grace_s:g}s or once it stops")

    def _due(self, plan: JobPlan, now: float) -> bool:
        if plan.failed_at is not None and now - plan.failed_at < RETRY_S:
            return False
        if plan.signal is None or plan.signalled_at is None or self.grace_s <= 0:
            return True
        if now >= plan.signalled_at + self.grace_s:
            return True
        # Steps that ended on the warning: the container runner checkpointed and stopped its
        # container; an interactive job's srun is gone. Plain and foreign jobs keep their
        # grace (a batch shell may still be checkpointing after its step, or have none).
        return plan.kind not in {"plain", "foreign"} and self.steps().get(plan.job_id, 0) == 0

    def _finish(self, node: str, plan: JobPlan, now: float) -> None:
        try:
            if plan.cancel:
                self.slurm.cancel([plan.job_id])
                why = (f"not ours (partition {plan.partition}), on a node the service needs: "
                       "cancelled after its grace (slurm.foreign_job_action)"
                       if plan.kind == "foreign" else
                       "not a batch job: Slurm cannot requeue it, cancelled after its grace")
            else:
                try:
                    self.slurm.requeue([plan.job_id])
                    why = (f"not ours (partition {plan.partition}): requeued after its grace "
                           "(slurm.foreign_job_action)" if plan.kind == "foreign" else "requeued")
                except NotRequeueable:
                    # Slurm says it is not a batch job after all: service first.
                    self.slurm.cancel([plan.job_id])
                    plan.cancel = True
                    if plan.kind != "foreign":
                        plan.kind = "interactive"
                    why = "Slurm refused to requeue it (not a batch job): cancelled"
                except SlurmIdleError as exc:
                    if plan.kind != "foreign":
                        raise
                    # Not ours to retry for ever (--no-requeue, held): service first.
                    self.slurm.cancel([plan.job_id])
                    plan.cancel = True
                    why = f"requeue refused ({str(exc).splitlines()[0][:120]}): cancelled"
        except SlurmIdleError as exc:
            plan.failed_at, plan.error = now, str(exc).splitlines()[0][:200]
            self._event(node, plan, "error", f"{plan.finish} failed: {plan.error}")
            return
        plan.finished, plan.failed_at, plan.error = True, None, None
        self._event(node, plan, "cancelled" if plan.cancel else "requeued", why)

    def _event(self, node: str, plan: JobPlan, action: str, why: str) -> None:
        level = log.warning if action in {"error", "cancelled"} or plan.kind == "foreign" else log.info
        level("%s: job %s (%s): %s: %s", node, plan.job_id, plan.kind, action, why)
        if plan.kind == "foreign":
            self.on_event(ForeignJobRecord(
                ts=self.clock(), node=node, job_id=plan.job_id, kind=plan.kind,
                action=JobAction(action), detail=why, partition=plan.partition, user=plan.user))
            return
        self.on_event(JobRecord(ts=self.clock(), node=node, job_id=plan.job_id, kind=plan.kind,
                                action=JobAction(action), detail=why))
