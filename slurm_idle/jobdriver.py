"""The effectors of `placement: jobs`: drive one replica job along the lifecycle, edge by edge.

Lend: SERVING -> RETIRING (our Comment on the job says so) -> LENDING (in-flight requests
reached 0, or engine.drain_timeout_s: `scancel`, vLLM gets SIGTERM and finishes within its own
--shutdown-timeout) -> LENT (the job left the queue: its GPUs are the idle partition's).
Reclaim: LENT -> RECLAIMING (`sbatch` of the replica job into the serve partition: Slurm
preempts the idle jobs holding the GPUs it needs, with their GraceTime and signals) ->
STARTING (the job runs) -> SERVING (/health 200 and awake: our Comment says serving).
The GPU wait is the job script's (replicajobs.gpu_wait): it starts vLLM only once no one else
holds memory on its GPUs, its Comment saying `held` meanwhile (HELD, named here from the GPU
readings of its node); past timeouts.gpu_free_s the node is drained for the admin and the job
cancelled (HELD -> LENDING), so the replica is submitted again elsewhere.

The edges are lifecycle.JOB_EDGES (the node table's phases; each edge's `ready` is waited
for, its `effect` applied, its timeout makes a phase stuck), dispatched like the node driver's.
Every step is idempotent and its phase is in Slurm before the slow part of the next starts
(the Comment, or the job's own state), so a tick killed anywhere converges on the next one;
a replica is only ever submitted when `squeue` shows no job of ours for it, and duplicates
(which the lock should make impossible) are cancelled, the oldest kept. Waits poll one shared
`squeue` until the tick's deadline; what is not done by then is carried over (`waiting`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_idle import handover
from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.errors import SlurmIdleError
from slurm_idle.gpugate import GpuReader
from slurm_idle.journal import DuplicateJobRecord, StepOutcome
from slurm_idle.lifecycle import (
    Edge,
    Effect,
    Ready,
    job_edge_for,
    job_next_phase,
    job_overdue,
)
from slurm_idle.logs import get_logger
from slurm_idle.model import Action, ActionKind, JobReplica, Phase, SlurmJob
from slurm_idle.policy.gpus import HeldGpu, allowance_mib, describe, gate
from slurm_idle.replicajobs import (
    format_comment,
    gpu_report,
    parse_comment,
    render_script,
    steer_args,
    submit_args,
)
from slurm_idle.router.sync import job_target
from slurm_idle.transitions import POLL_S, CarryOver, SharedPoll, StepResult

if TYPE_CHECKING:
    from slurm_idle.replicatrust import ReplicaTrust
    from slurm_idle.router import PoolRouters

log = get_logger(__name__)

_GONE = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
_RUNNING = frozenset({"RUNNING"})


def probe_config(r: JobReplica) -> ReplicaConfig:
    """The replica as the engine probes (health, in flight) and metrics adapters take it."""
    return ReplicaConfig(node=r.nodes[0], nodes=r.nodes, url=r.url, port=r.port, index=r.index,
                         name=r.name)


@dataclass
class JobDriver:
    """Applies transitions to replica jobs through the Slurm backend and the model's engine
    probes (only health and in-flight: Slurm starts and stops the engine)."""

    config: Config
    slurm: Any  # slurm_idle.slurm.SlurmBackend (+ set_job_comment)
    engine_for: Callable[[str], Any]
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    on_step: Callable[[StepResult], None] = field(default=lambda result: None)
    read_file: Callable[[str], str] = field(default=lambda path: Path(path).read_text())
    router: PoolRouters | None = None  # None: no router is told
    trust: ReplicaTrust | None = None  # signs every Comment written (replicatrust.py)
    # The GPU memory of the jobs' nodes (the site's exporter through Prometheus): only to name
    # what a HELD job waits for; None: not named.
    gpu_readings: GpuReader | None = None

    def __post_init__(self) -> None:
        self._jobs = SharedPoll(self.slurm.jobs, POLL_S, self.clock)

    def cancel_duplicates(self, replicas: Sequence[JobReplica]) -> list[DuplicateJobRecord]:
        """Cancel every duplicate replica job (two jobs of ours for one replica: the lock should
        make it impossible; the running, then oldest, one is kept). Returns journal records."""
        records = []
        for r in replicas:
            if not r.duplicates:
                continue
            error = None
            try:
                self.slurm.cancel(list(r.duplicates))
            except SlurmIdleError as exc:
                error = str(exc)
            record = DuplicateJobRecord(ts=self.clock(), replica=r.name, model=r.model,
                                        kept=r.job_id, cancelled=tuple(r.duplicates), error=error)
            log.warning("%s: cancelled duplicate replica job(s) %s (kept job %s)", r.name,
                        ", ".join(map(str, r.duplicates)), r.job_id)
            records.append(record)
        return records

    # --- one replica ---------------------------------------------------------------------

    def drive(self, r: JobReplica, action: Action, deadline: float) -> list[StepResult]:
        """Take `action` on replica `r`, then carry on along the lifecycle until a settled
        phase, a wait that outlasts `deadline`, or an error (journaled, never raised)."""
        steps: list[StepResult] = []
        to: Phase | None = action.to_phase
        nodelist = str(action.details.get("nodelist", ""))  # policy/jobs.py steer()
        while to is not None:
            started, before = self.clock(), r.phase
            why = action.reason
            try:
                edge = job_edge_for(before, to)
                why = action.reason if not steps else edge.why
                if not self._waiters()[edge.ready](r, deadline):
                    raise CarryOver(f"not ready: {edge.ready.value}")
                r = self._effects()[edge.effect](r, edge, deadline, nodelist)
                outcome, error, detail = StepOutcome.OK, None, None
            except CarryOver as exc:
                outcome, error, detail = StepOutcome.WAITING, None, str(exc)
                if overdue_job(r, self.config, started):
                    # e.g. a replica job PENDING past timeouts.reclaim_s (a reservation, an admin
                    # drain, no preemptible GPU): an error of the tick (exit 1, the textfile's
                    # tick errors, SlurmIdleTickErrors) with Slurm's reason; retried next tick.
                    outcome, error = StepOutcome.STUCK, f"{r.phase.value} for longer than its timeout; {detail}"
            except SlurmIdleError as exc:
                outcome, error, detail = StepOutcome.ERROR, str(exc), None
            step = StepResult(r.name, r.model, action.kind.value, before, to, why, outcome,
                              started, self.clock() - started, error, detail)
            steps.append(step)
            self.on_step(step)
            if outcome != "ok" or action.kind is ActionKind.ABORT_LEND:
                break
            nxt = job_next_phase(to)
            to = nxt if nxt is not None and self.clock() < deadline else None
        return steps

    # --- what an edge waits for (Edge.ready) and does (Edge.effect) ------------------------

    def _waiters(self) -> dict[Ready, Callable[[JobReplica, float], bool]]:
        return {
            Ready.NOW: lambda r, deadline: True,
            Ready.ENGINES_IDLE: self._engine_idle,
            Ready.JOB_GONE: self._job_gone,
            Ready.JOB_RUNNING: lambda r, deadline: self._wait(
                r, deadline, lambda j: j is not None and j.state in _RUNNING and bool(j.nodes),
                "to run") is not None,
            Ready.ENGINES_SERVING: self._engine_serving,
            Ready.GPUS_FREE: self._gpus_free,
        }

    def _effects(self) -> dict[Effect, Callable[[JobReplica, Edge, float, str], JobReplica]]:
        return {
            Effect.ROUTER_REMOVE: lambda r, e, d, n: self._route_and_write(
                r, e, "remove", "retiring: out of the router before the job is cancelled"),
            Effect.ROUTER_ADD: lambda r, e, d, n: self._route_and_write(
                r, e, "add", "load rose again: back into the router"),
            Effect.CANCEL_JOB: self._cancel,
            Effect.NOTHING: self._moved_on,
            Effect.SUBMIT_JOB: self._submit,
            Effect.WARM_UP_AND_ROUTER_ADD: self._warm_up_and_serve,
            Effect.HAND_OVER: self._hand_over,
        }

    def _route_and_write(self, r: JobReplica, edge: Edge, op: str, reason: str) -> JobReplica:
        self._router(op, r, reason)
        now = self.clock()
        self._comment(r, edge.to_phase, now)
        return _moved(r, edge.to_phase, now)

    def _cancel(self, r: JobReplica, edge: Edge, deadline: float, nodelist: str) -> JobReplica:
        now = self.clock()
        self._comment(r, Phase.LENDING, now)
        assert r.job_id is not None
        self.slurm.cancel([r.job_id])
        return _moved(r, Phase.LENDING, now, job_state="COMPLETING")  # cancelled: no re-cancel

    def _job_gone(self, r: JobReplica, deadline: float) -> bool:
        if r.job_state in _RUNNING and r.job_id is not None:
            # Our Comment says lending but the job still runs: the tick that wrote it was
            # killed before its scancel. Cancelling again is harmless.
            self.slurm.cancel([r.job_id])
        self._wait(r, deadline, lambda j: j is None or j.state in _GONE, "to leave the queue")
        return True

    def _moved_on(self, r: JobReplica, edge: Edge, deadline: float, nodelist: str) -> JobReplica:
        """LENT (the job left) or STARTING (it runs: where, and since when, from squeue)."""
        if edge.to_phase is Phase.LENT:
            return _moved(r, Phase.LENT, self.clock(), job_id=None, nodes=(), url="")
        job = self._job(r.job_id)
        model = self.config.model(r.model)
        assert job is not None and job.nodes and model.job is not None
        url = model.job.url.format(node=job.nodes[0], port=r.port)
        return _moved(r, edge.to_phase, job.start_time or self.clock(), nodes=job.nodes, url=url,
                      job_state=job.state)

    def _submit(self, r: JobReplica, edge: Edge, deadline: float, nodelist: str) -> JobReplica:
        model = self.config.model(r.model)
        now = self.clock()
        script = None if model.job is None or model.job.script is None else self.read_file(model.job.script)
        steer = steer_args(nodelist, self._slurm_version(), self.config.slurm.prefer_feature)
        report = gpu_report(self.config, model, r.index, now, r.pinned, self.trust)
        job_id = self.slurm.submit(render_script(self.config, model, r.index, script, report),
                                   [*submit_args(self.config, model, r.index, now, r.pinned,
                                                self.trust), *steer])
        return _moved(r, Phase.RECLAIMING, now, job_id=job_id, job_state="PENDING")

    def _warm_up_and_serve(self, r: JobReplica, edge: Edge, deadline: float, nodelist: str) -> JobReplica:
        if self.router is not None and r.url:
            self.router.warm_up_target(job_target(r))
        return self._route_and_write(r, edge, "add", "healthy and warm: into the router")

    def _slurm_version(self) -> str | None:
        """The cluster's release for steer_args, only asked when `--prefer` could be used
        (the CLI backend caches it); None if Slurm will not say: `--nodelist` then."""
        if self.config.slurm.prefer_feature is None:
            return None
        try:
            return str(self.slurm.version())
        except SlurmIdleError:
            return None

    def _router(self, op: str, r: JobReplica, reason: str) -> None:
        """Tell the router first (remove before retiring, add before serving); a failure keeps
        the replica where it is (RouterError), as in node placement."""
        if self.router is not None and r.url and r.nodes:
            self.router.call_target(op, job_target(r), reason)

    def _comment(self, r: JobReplica, phase: Phase, now: float) -> None:
        assert r.job_id is not None
        self.slurm.set_job_comment(r.job_id, format_comment(self.config.slurm.tag, phase, now,
                                                            r.model, r.index, r.port, r.pinned,
                                                            self.trust))

    def _job(self, job_id: int | None) -> SlurmJob | None:
        if job_id is None:
            return None
        jobs: list[SlurmJob] = self._jobs.get()
        return next((j for j in jobs if j.job_id == job_id), None)

    def _wait(self, r: JobReplica, deadline: float, done: Callable[[SlurmJob | None], bool],
              what: str) -> SlurmJob | None:
        while True:
            job = self._job(r.job_id)
            if done(job):
                return job
            # A job not listed may be one just submitted that a shared poll of a second ago
            # predates: waited for like a pending one (the next tick reads it LENT if gone).
            if job is not None and job.state in _GONE:
                raise SlurmIdleError(f"{r.name}: replica job {r.job_id} ended ({job.state}) "
                                     f"while waiting for it {what}")
            if self.clock() >= deadline:
                state = ("not listed" if job is None else
                         job.state + (f": {job.state_reason}" if job.state_reason else ""))
                raise CarryOver(f"replica job {r.job_id} still {state}: waiting for it {what}")
            self.sleep(POLL_S)

    def _engine_idle(self, r: JobReplica, deadline: float) -> bool:
        """Wait for the requests in flight to finish, up to engine.drain_timeout_s after the
        retire began (then the cancel goes ahead: vLLM's --shutdown-timeout is the last net)."""
        from slurm_idle.engine import IdleTwice

        engine = self.engine_for(r.model)
        limit = self.config.engine_for(r.model).drain_timeout_s
        since = r.phase_since if r.phase_since is not None else self.clock()
        if not r.nodes:
            return True
        probe = probe_config(r)
        left: float | None = None

        def idle() -> bool:
            nonlocal left
            left = engine.in_flight(probe)
            return left is None or left <= 0

        drained = IdleTwice(idle, self.clock, POLL_S)  # the same end of a drain as a node's
        while True:
            if drained() or self.clock() - since >= limit:
                return True
            if self.clock() >= deadline:
                raise CarryOver(f"{left:g} request(s) still in flight" if left else
                                "idle at one reading: drained at the next")
            self.sleep(POLL_S)

    def _engine_serving(self, r: JobReplica, deadline: float) -> bool:
        engine = self.engine_for(r.model)
        probe = probe_config(r)
        while True:
            job = self._job(r.job_id)
            if job is None or job.state in _GONE:
                raise SlurmIdleError(f"{r.name}: replica job {r.job_id} ended before serving")
            health = engine.health(probe)
            if health.serving:  # serving is the fact, whatever a stale `held` Comment says
                return True
            if self._says_held(job):  # its script waits for its GPUs: HELD from the next tick
                raise CarryOver(self._held_detail(job))
            if self.clock() >= deadline:
                raise CarryOver(f"{r.url}: not healthy yet ({health.error or 'starting'})")
            self.sleep(POLL_S)


    # --- the GPU wait (the job's script checks; we name what it waits for) ---------------------

    def _says_held(self, job: SlurmJob) -> bool:
        comment = parse_comment(job.comment, self.config.slurm.tag)
        return job.state in _RUNNING and comment is not None and comment.word == Phase.HELD.value

    def _held(self, job: SlurmJob) -> list[HeldGpu]:
        """The job's GPUs over what a starting engine may find there, by the GPU readings of
        its nodes (the same rule as the node gate: policy/gpus.py); [] without readings."""
        if self.gpu_readings is None or not job.nodes:
            return []
        try:
            readings = self.gpu_readings(job.nodes)
        except SlurmIdleError as exc:
            log.warning("GPU readings unavailable (%s): a held replica job's GPUs are not named", exc)
            return []
        allowed = allowance_mib(engine_up=False, residue_mib=None,
                                tolerance_mib=self.config.gpu.free_tolerance_mib,
                                max_residue_mib=self.config.gpu.max_residue_mib)
        held: list[HeldGpu] = []
        for i, node in enumerate(job.nodes):
            indexes = job.gpu_indexes[i] if i < len(job.gpu_indexes) else None
            held += gate({node: readings.get(node)}, indexes or None, allowed, None).held
        return held

    def _held_detail(self, job: SlurmJob) -> str:
        held = self._held(job)
        what = describe(held) if held else (
            f"no GPU reading of {', '.join(job.nodes)} names it (see the job's stderr)")
        return (f"replica job {job.job_id} waits for its GPUs before vLLM starts: {what} "
                f"(past timeouts.gpu_free_s, {self.config.timeouts.gpu_free_s:g} s, its node "
                "goes to the admin and the replica elsewhere)")

    def _engine_answers(self, r: JobReplica) -> bool:
        """Its vLLM serves: the wait is over whatever the Comment still says (the script's
        update back from `held` may not have taken)."""
        return bool(self.engine_for(r.model).health(probe_config(r)).serving)

    def _gpus_free(self, r: JobReplica, deadline: float) -> bool:
        """HELD: the job's script says its GPUs are free (its Comment back to starting)."""
        while True:
            job = self._job(r.job_id)
            if job is None or job.state in _GONE:
                raise SlurmIdleError(f"{r.name}: replica job {r.job_id} ended while it waited for its GPUs")
            if not self._says_held(job) or self._engine_answers(r):
                return True
            if self.clock() >= deadline:
                raise CarryOver(self._held_detail(job))
            self.sleep(POLL_S)

    def _hand_over(self, r: JobReplica, edge: Edge, deadline: float, nodelist: str) -> JobReplica:
        """HELD past timeouts.gpu_free_s: drain the job's nodes for the admin (the Reason
        naming the held GPUs and their holder, handover.py; a node someone else drained keeps
        its Reason), then cancel the job: the replica is submitted again elsewhere."""
        job = self._job(r.job_id)
        if job is None or not self._says_held(job) or self._engine_answers(r):
            raise CarryOver(f"replica job {r.job_id} no longer waits for its GPUs: not handed over")
        held = self._held(job)
        now = self.clock()
        drained = {n.name for n in self.slurm.nodes() if n.drained or n.down}
        for node in job.nodes:
            if node in drained:
                log.warning("%s: %s is drained already: its Reason is left as it is", r.name, node)
                continue
            self.slurm.drain(node, handover.format_reason(self.config.slurm.tag, node, now, held))
        self.slurm.cancel([job.job_id])
        log.error("%s: replica job %s handed over (%s drained for the admin): %s", r.name,
                  job.job_id, ", ".join(job.nodes), describe(held) or "GPU held (no reading)")
        return _moved(r, Phase.LENDING, now, job_state="COMPLETING")


def overdue_job(r: JobReplica, config: Config, now: float) -> bool:
    """A replica job's timed phase older than its edge's timeout (JOB_EDGES): stuck."""
    return job_overdue(r.phase, r.phase_since, config, now)


def _moved(r: JobReplica, phase: Phase, since: float, **changes: Any) -> JobReplica:
    return replace(r, phase=phase, phase_since=since, **changes)
