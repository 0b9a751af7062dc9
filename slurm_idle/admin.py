"""An admin's commands on one pool node: `pin`, `unpin`, `lend`, `reclaim` (on a jobs-placement
replica, MODEL#INDEX, admin_jobs.py).

Each checks its preconditions on a fresh observation, under the tick lock (a command never
races a tick), then acts through the agent: `lend` and `reclaim` (and `pin` of a lent node,
which reclaims it) are ordinary lifecycle actions run by the NodeDriver, journaled as
transitions; `pin`/`unpin` of a node in a drained phase rewrite its Reason through the Slurm
adapter's NodeWriter and are journaled as `admin` records. Transitions made here count in the
agent's textfile metrics like a tick's. The CLI (cli/tick_cmd.py) only parses and prints an
`AdminResult`; scripts and tests call these functions directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar

from slurm_idle import admin_jobs
from slurm_idle.agent import Agent
from slurm_idle.errors import BadInput, OverLimit, Refused, SlurmIdleError
from slurm_idle.journal import AdminRecord, StepOutcome
from slurm_idle.lifecycle import DRAINED_PHASES, format_reason
from slurm_idle.lock import lock_holder, try_lock
from slurm_idle.model import Action, ActionKind, GroupView, NodeView, Observation, Phase
from slurm_idle.policy.rules import Refusal, lend_refusal
from slurm_idle.policy.service import out_of_service
from slurm_idle.powersave import powered_only
from slurm_idle.topology import group_views
from slurm_idle.transitions import StepResult, action_for_admin

T = TypeVar("T")


@dataclass(frozen=True)
class AdminResult:
    """What an admin command found and did (nothing when `dry_run`).

    `action`: the lifecycle action taken (lend, reclaim, or the reclaim a pin of a lent node
    asks for); `steps`: the driver's steps for it; `message`: one line for the admin when no
    action says it all (a Reason rewritten, nothing to unpin, what a dry run would do)."""

    command: str
    node: str
    dry_run: bool
    action: Action | None = None
    steps: list[StepResult] = field(default_factory=list)
    message: str = ""

    @property
    def waiting(self) -> bool:
        """The last step is carried over to the next tick."""
        return bool(self.steps) and self.steps[-1].outcome is StepOutcome.WAITING


class AdminFailed(SlurmIdleError):
    """A step of an admin's lend, reclaim or pin failed; `result` holds the steps taken."""

    def __init__(self, message: str, result: AdminResult) -> None:
        super().__init__(message)
        self.result = result


@contextmanager
def _locked(agent: Agent) -> Iterator[None]:
    """The tick lock, or a SlurmIdleError naming the tick that holds it."""
    path = agent.config.paths.lock
    with try_lock(path) as locked:
        if not locked:
            raise SlurmIdleError(
                f"a tick is running (pid {lock_holder(path) or '?'}); try again in a minute")
        yield


def _under_lock(agent: Agent, fn: Callable[[], T]) -> T:
    with _locked(agent):
        return fn()


def node_view(obs: Observation, node: str) -> NodeView:
    """The observed view of a pool node; BadInput (exit 2) for another name."""
    for v in obs.nodes:
        if v.name == node:
            return v
    pool = ", ".join(v.name for v in obs.nodes)
    raise BadInput(f"{node} is not a pool node (pool: {pool})")


def group_of(obs: Observation, agent: Agent, node: str) -> GroupView:
    """The lend group of `node` (what a lend or reclaim moves: the node and its partners)."""
    for g in group_views(obs, agent.config):
        if node in g.group.nodes:
            return g
    raise BadInput(f"{node} is not a pool node")


#: Called with each step as it ends (the CLI prints it then: a reclaim that waits out the lent
#: jobs' grace and an engine's start says how far it got, step by step, as it goes).
OnStep = Callable[[StepResult], None]


def _run(agent: Agent, action: Action, obs: Observation,
         on_step: OnStep | None = None) -> list[StepResult]:
    steps = agent.run_actions([action], obs, on_step=on_step)
    _count_transitions(agent, steps)
    return steps


def _pin_by_reclaim(agent: Agent, name: str, action: Action, obs: Observation,
                    dry_run: bool, on_step: OnStep | None = None) -> AdminResult:
    """Pinning a lent node or replica: reclaim it, `obs` already showing it pinned (so the
    reclaim's planner never lends it again). Shared by node and replica-job pins."""
    if dry_run:
        return AdminResult("pin", name, True, action,
                           message=f"would reclaim {name} and keep it serving")
    steps = _run(agent, action, obs, on_step)
    result = AdminResult("pin", name, False, action, steps)
    if any(s.outcome is StepOutcome.ERROR for s in steps):
        raise AdminFailed(f"pin {name}: reclaiming it failed: {steps[-1].error}", result)
    return result


def _count_transitions(agent: Agent, steps: list[StepResult]) -> None:
    """Admin transitions count in the agent's metrics too (alerts watch the counter)."""
    path = agent.config.paths.textfile
    if path is None:
        return
    from slurm_idle.agent_metrics import add_transitions

    add_transitions(path, [(s.from_phase.value, s.to_phase.value) for s in steps
                           if s.outcome is StepOutcome.OK])


def force(agent: Agent, node: str, kind: ActionKind, dry_run: bool = False,
          on_step: OnStep | None = None, notify: Callable[[str], None] | None = None,
          override: bool = False) -> AdminResult:
    """`lend NODE` (serving -> lent) or `reclaim NODE` (lent or unknown -> serving) through the
    normal transition path, for the node's whole lend group. Refuses an admin's node, a pinned
    node (lend), and a group in another phase (Refused, exit 3); an unknown node is BadInput
    (exit 2); a lend that would leave a model under its floor or over its max_lent_fraction
    is OverLimit (exit 2, dry run too) unless `override` (`--force`: made, and journaled as
    an `admin` record naming the rule). A failed step is AdminFailed (exit 1).

    `on_step` gets each step as it ends; `notify` a line before a wait the admin would
    otherwise sit through in silence (a reclaim giving the lent jobs their grace)."""
    return _under_lock(agent, lambda: _force(agent, node, kind, dry_run, on_step, notify, override))


def check_limits(agent: Agent, obs: Observation, name: str,
                 leaving: list[tuple[str, bool]], override: bool) -> Refusal | None:
    """The rules.lend_refusal of an admin's lend of `name` (its replicas `leaving`): OverLimit
    without `override`; with it, the rule to override (None when no rule is broken)."""
    broken = lend_refusal(obs, agent.config, leaving)
    if broken is None or override:
        return broken
    after = {"floor": "the agent's fast check then takes a replica back for the floor",
             "max_lent_fraction": "the planner lends no more of the model until it is within"}
    raise OverLimit(f"lend {name} refused: {broken.why}; `slurm-idle lend --force {name}` lends "
                    f"it anyway ({after.get(broken.rule, 'journaled')})")


def journal_force(agent: Agent, name: str, phase: Phase, broken: Refusal | None,
                  steps: list[StepResult]) -> str:
    """Journal an overridden rule once the forced lend ran (an `admin` record `lend --force`,
    its outcome the steps'); the line the command prints ("" when nothing was overridden)."""
    if broken is None:
        return ""
    if steps:
        assert agent.journal is not None
        failed = any(s.outcome is StepOutcome.ERROR for s in steps)
        agent.journal.append(AdminRecord(
            ts=agent.clock(), node=name, command="lend --force", phase=phase.value,
            outcome=StepOutcome.ERROR if failed else StepOutcome.OK,
            detail=f"overrode {broken.rule}: {broken.why}"))
    return f"--force: {broken.why}"


def grace_wait(agent: Agent, group: GroupView) -> str | None:
    """What a reclaim of `group` is about to wait for: the lend partition's jobs on it, warned
    and given `slurm.requeue_grace_s` to checkpoint (None: no job, or no grace)."""
    slurm = agent.config.slurm
    ids = sorted({j.job_id for j in group.jobs if j.partition == slurm.lend_partition})
    if not ids or slurm.requeue_grace_s <= 0:
        return None
    return (f"reclaim {group.name}: {slurm.lend_partition} job(s) {', '.join(map(str, ids))} "
            f"get up to {slurm.requeue_grace_s:g}s (slurm.requeue_grace_s) to stop before "
            "their requeue; waiting ...")


def _force(agent: Agent, node: str, kind: ActionKind, dry_run: bool,
           on_step: OnStep | None = None,
           notify: Callable[[str], None] | None = None, override: bool = False) -> AdminResult:
    if admin_jobs.is_replica_name(node):  # MODEL#INDEX: a placement: jobs replica
        return admin_jobs.force(agent, node, kind, dry_run, on_step, override)
    obs = agent.observe()
    view = node_view(obs, node)
    if view.phase is Phase.ADMIN:
        raise Refused(f"{node} is drained by an admin ({view.node.reason!r}); slurm-idle "
                      "never touches it")
    if kind is ActionKind.LEND and view.pinned:
        raise Refused(f"{node} is pinned; `slurm-idle unpin {node}` first")
    group = group_of(obs, agent, node)
    if group.phase is Phase.ADMIN:
        raise Refused(f"{node} is in lend group {','.join(group.group.nodes)}, which an "
                      "admin drained; slurm-idle never touches it")
    wanted = Phase.SERVING if kind is ActionKind.LEND else Phase.LENT
    if group.phase is not wanted and not (kind is ActionKind.RECLAIM and group.phase is Phase.UNKNOWN):
        raise Refused(
            f"{node} is {group.phase.value}, not {wanted.value}; cannot {kind.value} it now"
            " (see `slurm-idle status`)"
        )
    broken = None
    if kind is ActionKind.LEND:
        broken = check_limits(agent, obs, node, [(r.model, not out_of_service(group.load(r)))
                                                 for r in group.group.replicas], override)
    # The group moves as one: the action names its key node, from the group's phase.
    action = replace(action_for_admin(replace(view, phase=group.phase), kind,
                                      f"admin: slurm-idle {kind.value} {node}"), node=group.name)
    wait = grace_wait(agent, group) if kind is ActionKind.RECLAIM and not dry_run else None
    if wait is not None and notify is not None:
        notify(wait)
    steps = [] if dry_run else _run(agent, action, obs, on_step)
    forced = journal_force(agent, node, group.phase, broken, steps)
    result = AdminResult(kind.value, node, dry_run, action, steps, message=forced)
    failed = [s for s in steps if s.outcome is StepOutcome.ERROR]
    if failed:
        raise AdminFailed(f"{kind.value} {node} failed: {steps[-1].error}", result)
    return result


def pin(agent: Agent, node: str, dry_run: bool = False,
        on_step: OnStep | None = None) -> AdminResult:
    """Keep NODE serving: `pinned` in its Reason (the planner never lends it). A lent node (or
    one not managed yet) is reclaimed first and kept (`on_step`: each of its steps as it ends)."""
    return _under_lock(agent, lambda: _set_pin(agent, node, True, dry_run, on_step))


def unpin(agent: Agent, node: str, dry_run: bool = False) -> AdminResult:
    """Release a pinned NODE back to the planner (its Reason loses `pinned`)."""
    return _under_lock(agent, lambda: _set_pin(agent, node, False, dry_run))


def _set_pin(agent: Agent, node: str, pinned: bool, dry_run: bool,
             on_step: OnStep | None = None) -> AdminResult:
    if admin_jobs.is_replica_name(node):  # MODEL#INDEX: a placement: jobs replica
        return admin_jobs.set_pin(agent, node, pinned, dry_run, on_step)
    command = "pin" if pinned else "unpin"
    obs = agent.observe()
    view = node_view(obs, node)
    if not pinned and not dry_run:
        _allow_lend(agent, node)
    if view.phase is Phase.ADMIN:
        raise Refused(f"{node} is drained by an admin ({view.node.reason!r}); not touching it")
    if view.phase in DRAINED_PHASES:
        reason = format_reason(agent.config.slurm.tag, view.phase, view.phase_since or obs.now,
                               pinned)
        if dry_run:
            return AdminResult(command, node, True, message=f"would set {node} reason to {reason!r}")
        _write_reason(agent, view, command, reason)
        return AdminResult(command, node, False,
                           message=f"{node} {'pinned' if pinned else 'unpinned'} ({view.phase.value})")
    if not pinned:
        return AdminResult(command, node, dry_run,
                           message=f"{node} is {view.phase.value}; nothing to unpin")
    # A lent node Slurm powered down is pinned like any other: the reclaim powers it up.
    if view.phase in {Phase.LENT, Phase.UNKNOWN} and (not view.node.down or powered_only(view.node)):
        # Pinning a lent node means: bring it back now and keep it.
        pinned_view = replace(view, pinned=True)
        action = action_for_admin(pinned_view, ActionKind.RECLAIM, f"admin: slurm-idle pin {node}")
        return _pin_by_reclaim(agent, node, action, replace(obs, nodes=tuple(
            pinned_view if v.name == node else v for v in obs.nodes)), dry_run, on_step)
    raise Refused(f"{node} is {view.phase.value}; cannot pin it now")


def _write_reason(agent: Agent, view: NodeView, command: str, reason: str) -> None:
    """Rewrite a node's Reason for pin/unpin through the NodeWriter, journaled (an `admin`
    record, with the error when Slurm refused)."""
    assert agent.journal is not None
    record = AdminRecord(ts=agent.clock(), node=view.name, command=command,
                         phase=view.phase.value, outcome=StepOutcome.OK,
                         detail=f"reason set to {reason!r}")
    try:
        agent.slurm.drain(view.name, reason)
    except SlurmIdleError as exc:
        agent.journal.append(replace(record, outcome=StepOutcome.ERROR, detail=str(exc)))
        raise
    agent.journal.append(record)


def _allow_lend(agent: Agent, node: str) -> None:
    """`unpin` also lifts a lend refused for the memory the node's engines left on its GPUs
    (engine_notes.py): the admin has looked at it."""
    from slurm_idle.engine_notes import EngineNotes, notes_path
    from slurm_idle.logs import get_logger
    from slurm_idle.topology import group_index

    group = group_index(agent.config).get(node)
    notes = EngineNotes(notes_path(agent.config.paths.journal))
    for replica in group.replicas if group is not None else ():
        if notes.lend_refused(replica.name) is not None:
            notes.allow_lend(replica.name)
            get_logger(__name__).info("%s: lend allowed again (refused before: the memory its "
                                      "engine left on the GPUs)", replica.name)
