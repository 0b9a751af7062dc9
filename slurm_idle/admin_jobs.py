"""An admin's `lend`, `reclaim`, `pin`, `unpin` of one `placement: jobs` replica (MODEL#INDEX).

The same commands as for a pool node (admin.py), on the unit of jobs placement: the replica
job. `lend` (serving -> retiring -> ... -> lent: the job cancelled) and `reclaim` (lent ->
reclaiming: the job submitted) are ordinary lifecycle actions run by the JobDriver, journaled
as transitions. A pin lives where the replica's phase lives, in our Comment on its job
(`... port=8101 pinned model=NAME`): `pin` of a replica with a job rewrites its Comment
(an `admin` journal record), `pin` of a lent replica reclaims it with the pin in the new job's
Comment; `unpin` rewrites the Comment without it. The planner never lends a pinned replica
(policy/jobs.py). Called by admin.py under the tick lock; nothing here takes it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from slurm_idle.errors import BadInput, Refused, SlurmIdleError
from slurm_idle.journal import AdminRecord, StepOutcome
from slurm_idle.lifecycle import job_edge_for
from slurm_idle.model import Action, ActionKind, JobReplica, Observation, Phase
from slurm_idle.policy.service import out_of_service
from slurm_idle.replicajobs import format_comment

if TYPE_CHECKING:  # admin.py imports this module
    from slurm_idle.admin import AdminResult, OnStep
    from slurm_idle.agent import Agent

#: Phases whose replica has a job of ours to carry a pin (a Comment to rewrite).
_WITH_JOB = frozenset({Phase.SERVING, Phase.STARTING, Phase.HELD, Phase.RECLAIMING})


def is_replica_name(name: str) -> bool:
    """`MODEL#INDEX` names a jobs-placement replica; node names never hold a '#'."""
    return "#" in name


def replica_view(obs: Observation, name: str) -> JobReplica:
    """The observed replica `name`; BadInput (exit 2) naming the known ones for another name."""
    for r in obs.replica_jobs:
        if r.name == name:
            return r
    known = ", ".join(r.name for r in obs.replica_jobs) or "none: no model has placement: jobs"
    raise BadInput(f"{name} is not a replica of a placement: jobs model (replicas: {known})")


def _action(r: JobReplica, kind: ActionKind, reason: str) -> Action:
    to = Phase.RETIRING if kind is ActionKind.LEND else Phase.RECLAIMING
    job_edge_for(r.phase, to)  # IllegalTransition if the table has no such edge
    return Action(kind, r.name, r.model, r.phase, to, reason,
                  {"index": r.index, **({"job_id": r.job_id} if r.job_id is not None else {})})


def force(agent: Agent, name: str, kind: ActionKind, dry_run: bool,
          on_step: OnStep | None = None, override: bool = False) -> AdminResult:
    """`lend MODEL#INDEX` (serving, not pinned, within the model's floor and max_lent_fraction
    unless `override`) or `reclaim MODEL#INDEX` (lent); `on_step` gets each step as it ends."""
    from slurm_idle.admin import AdminFailed, AdminResult, _run, check_limits, journal_force

    obs = agent.observe()
    r = replica_view(obs, name)
    if kind is ActionKind.LEND and r.pinned:
        raise Refused(f"{name} is pinned; `slurm-idle unpin {name}` first")
    wanted = Phase.SERVING if kind is ActionKind.LEND else Phase.LENT
    if r.phase is not wanted:
        raise Refused(f"{name} is {r.phase.value}, not {wanted.value}; cannot {kind.value} "
                      "it now (see `slurm-idle status`)")
    broken = None
    if kind is ActionKind.LEND:
        broken = check_limits(agent, obs, name, [(r.model, not out_of_service(r.load))], override)
    action = _action(r, kind, f"admin: slurm-idle {kind.value} {name}")
    steps = [] if dry_run else _run(agent, action, obs, on_step)
    forced = journal_force(agent, name, r.phase, broken, steps)
    result = AdminResult(kind.value, name, dry_run, action, steps, message=forced)
    if any(s.outcome is StepOutcome.ERROR for s in steps):
        raise AdminFailed(f"{kind.value} {name} failed: {steps[-1].error}", result)
    return result


def set_pin(agent: Agent, name: str, pinned: bool, dry_run: bool,
            on_step: OnStep | None = None) -> AdminResult:
    """`pin` / `unpin` of a replica: its job's Comment rewritten, or (pin of a lent replica)
    the replica reclaimed with the pin in its new job's Comment."""
    from slurm_idle.admin import AdminResult, _pin_by_reclaim

    command = "pin" if pinned else "unpin"
    obs = agent.observe()
    r = replica_view(obs, name)
    if r.phase in _WITH_JOB and r.job_id is not None:
        if r.pinned == pinned:
            return AdminResult(command, name, dry_run,
                               message=f"{name} is already {'pinned' if pinned else 'not pinned'}")
        # STARTING has no word of its own: its Comment still says reclaiming.
        word = Phase.RECLAIMING if r.phase is Phase.STARTING else r.phase
        since = r.phase_since if r.phase is not Phase.STARTING and r.phase_since else obs.now
        comment = format_comment(agent.config.slurm.tag, word, since, r.model, r.index, r.port, pinned,
                                 agent.trust)
        if dry_run:
            return AdminResult(command, name, True,
                               message=f"would set job {r.job_id}'s comment to {comment!r}")
        _write_comment(agent, r, command, comment)
        return AdminResult(command, name, False, message=f"{name} {'pinned' if pinned else 'unpinned'} "
                                                          f"({r.phase.value}, job {r.job_id})")
    if not pinned:
        return AdminResult(command, name, dry_run, message=f"{name} is {r.phase.value}; nothing to unpin")
    if r.phase is Phase.LENT:
        kept = replace(r, pinned=True)
        action = _action(kept, ActionKind.RECLAIM, f"admin: slurm-idle pin {name}")
        return _pin_by_reclaim(agent, name, action, replace(obs, replica_jobs=tuple(
            kept if x.name == name else x for x in obs.replica_jobs)), dry_run, on_step)
    raise Refused(f"{name} is {r.phase.value}; cannot pin it now (pin it once it is "
                  "lent: that reclaims it)")


def _write_comment(agent: Agent, r: JobReplica, command: str, comment: str) -> None:
    """Rewrite a replica job's Comment for pin/unpin, journaled (an `admin` record, with the
    error when Slurm refused)."""
    assert agent.journal is not None and r.job_id is not None
    record = AdminRecord(ts=agent.clock(), node=r.name, command=command, phase=r.phase.value,
                         outcome=StepOutcome.OK, detail=f"job {r.job_id} comment set to {comment!r}")
    slurm: Any = agent.slurm  # a SlurmBackend, as the JobDriver takes it (set_job_comment)
    try:
        slurm.set_job_comment(r.job_id, comment)
    except SlurmIdleError as exc:
        agent.journal.append(replace(record, outcome=StepOutcome.ERROR, detail=str(exc)))
        raise
    agent.journal.append(record)
