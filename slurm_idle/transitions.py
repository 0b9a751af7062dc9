"""The effectors: drive one lend group along its lifecycle, one allowed edge at a time.

A group (topology.py) is one node in a one-replica-per-node pool, a node with several replicas,
or the nodes a replica spans. Its phase is written on every one of its nodes, each engine step
is taken for every replica of it (each with its own `{port}`/`{index}`, container or url), and
the group serves only once all its replicas are healthy.

`NodeDriver.drive` is the single function that applies transitions: each step looks its edge up
in the lifecycle table (lifecycle.EDGES; anything else is refused), waits for the edge's `ready`
and applies its `effect`. Every step is idempotent
(draining a drained node, stopping a stopped engine, resuming a resumed node are no-ops), and
the phase is written into Slurm before the slow part of the next step starts, so a tick killed
at any point leaves a node whose Reason says where to carry on. Waiting steps (in-flight
requests, jobs leaving the node, an engine's stop taking effect, engine health) poll in the
one loop `_poll_until` until the tick's deadline; the engines only signal (each start or stop
one call, given the tick's time left, at least MIN_ENGINE_CALL_S) and never wait. What is
not done by then stays in its phase with a journaled why (`CarryOver`) for the next tick, which
re-issues the stop (LENDING) or re-checks health and re-issues the start (STARTING). A phase
older than its timeout is reported as stuck and its step retried. So a tick, and the lock
every later cron tick needs, outlives its budget by a few MIN_ENGINE_CALL_S at most (a stop
is given at least that much, and an old vLLM's drain before it as much again, per replica).

A node's Comment is shared with the admin. Only ours (`slurm-idle:`-tagged) is ever cleared; an
admin's text found on a node we lend is kept after our marker (`lent_comment`) and put back as
it was on reclaim (`admin_comment`). Our marker stays first because `derive_phase` reads a lent
node from a Comment that starts with our tag, so recovering the phase from Slurm is unchanged.

Over 400 lines on purpose (for now): every effect and wait of the table works on the same
per-tick state of `NodeDriver` (shared polls, evictor, what this tick drained or started, the
one poll loop), so its methods stay one class (what it shares with jobdriver.py is in steps.py, re-exported
here); the engines' waits moved in here from
engine.py (issue 12). Splitting it into effect modules is a follow-up once the placement work
in flight has landed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from slurm_idle import handover
from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.engine_notes import EngineNotes, notes_path
from slurm_idle.errors import SlurmIdleError
from slurm_idle.eviction import Evictor
from slurm_idle.gpugate import GpuGate, GpuReader
from slurm_idle.journal import JobRecord, StepOutcome
from slurm_idle.lifecycle import (
    Edge,
    Effect,
    Ready,
    allowed,
    check_transition,
    derive_phase,
    edge_for,
    format_reason,
    is_ours,
    next_phase,
    overdue,
)
from slurm_idle.logs import get_logger
from slurm_idle.model import (
    Action,
    ActionKind,
    GroupView,
    LendGroup,
    NodeView,
    Phase,
    SlurmJob,
    SlurmNode,
)
from slurm_idle.policy.gpus import GateVerdict, describe
from slurm_idle.powersave import needs_power_up, power_flags
from slurm_idle.slurm.protocol import PoolSlurm
from slurm_idle.start_retry import After, StartRetries
from slurm_idle.steps import (
    ACTIVE_JOB_STATES,
    MIN_ENGINE_CALL_S,
    POLL_S,
    CarryOver,
    Divert,
    SharedPoll,
    StepResult,
    Superseded,
    admin_comment,
    lent_comment,
)
from slurm_idle.topology import group_index

__all__ = ["ACTIVE_JOB_STATES", "MIN_ENGINE_CALL_S", "POLL_S", "CarryOver", "SharedPoll", "StepResult", "admin_comment", "lent_comment"]

if TYPE_CHECKING:  # imported where used (the engine package loads the HTTP and docker helpers)
    from slurm_idle.engine import Engine
    from slurm_idle.replicatrust import ReplicaTrust
    from slurm_idle.router import PoolRouters

log = get_logger(__name__)


@dataclass
class NodeDriver:
    """Applies transitions to pool nodes through the Slurm backend and engine controls."""

    config: Config
    slurm: PoolSlurm
    engine_for: Callable[[str], Engine]  # model name -> its engine control
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    on_step: Callable[[StepResult], None] = field(default=lambda result: None)
    on_event: Callable[[JobRecord], None] = field(default=lambda record: None)
    router: PoolRouters | None = None  # None: no router is told
    # Which replica jobs are the agent's (replicatrust.py); None: read from the key on disk.
    trust: ReplicaTrust | None = None
    # The pool's GPU memory (the site's exporter through Prometheus); None: GPUs not checked.
    gpu_readings: GpuReader | None = None

    def __post_init__(self) -> None:
        self._jobs_poll = SharedPoll(self.slurm.jobs, POLL_S, self.clock)
        self._nodes_poll = SharedPoll(self.slurm.nodes, POLL_S, self.clock)
        steps = getattr(self.slurm, "workload_steps", None)
        self._steps_poll = SharedPoll(steps or dict, POLL_S, self.clock)
        self._evictor = Evictor(self.config, self.slurm, self.clock, self._steps_poll.get,
                                self.on_event)
        # Per group, touched only by that group's thread: whether this process drained it for
        # a reclaim (its jobs are warned now, not by an earlier tick); per replica, whether it
        # already started its engine (never start it twice in a tick).
        self._drained: set[str] = set()
        self._started: set[str] = set()
        self._powered_up: set[str] = set()  # nodes asked to POWER_UP in this tick
        # Per group: the reason of the step under way, journaled with its router calls.
        self._why: dict[str, str] = {}
        self._replica_configs = {r.name: (m.name, r) for m in self.config.models for r in m.replicas}
        self._notes = EngineNotes(notes_path(self.config.paths.journal))
        self._gpus = GpuGate(self.config, self.gpu_readings, self.clock, self._notes, self.engine_for)
        self._retries = StartRetries(self.config, self._notes, self.engine_for, self.clock)
        # Per group: the side edge a waiting step asked for (Divert), taken by `drive`: (the
        # phase the step wrote before it, if any; the edge's to-phase).
        self._diverts: dict[str, tuple[Phase | None, Phase]] = {}

    @property
    def tag(self) -> str:
        return self.config.slurm.tag

    # -- public -------------------------------------------------------------------------------

    def group_of(self, view: NodeView | GroupView) -> GroupView:
        """A node's view as its lend group; a node of a multi-node group needs the group's view
        (the agent builds it from the whole observation)."""
        if isinstance(view, GroupView):
            return view
        group = group_index(self.config).get(view.name)
        if group is None:
            group = LendGroup((view.name,), ())
        if len(group.nodes) > 1:
            raise SlurmIdleError(f"{view.name} is one node of lend group {', '.join(group.nodes)}: "
                                 "act on the whole group")
        return GroupView(group, (view,), view.phase, view.phase_since, view.pinned)

    def drive(self, view: NodeView | GroupView, action: Action, deadline: float) -> list[StepResult]:
        """Carry `view`'s group (or lone node) from its phase toward where `action` leads, until
        settled, blocked on a condition at `deadline`, or failed. Returns every step attempted."""
        results: list[StepResult] = []
        target: Phase | None = action.to_phase
        reason = action.reason
        current = self.group_of(view)
        model = action.model
        while target is not None:
            result = self._step(current, model, target, action.kind.value, reason, deadline)
            results.append(result)
            self.on_step(result)
            if result.outcome is not StepOutcome.OK:
                divert = self._diverts.pop(current.name, None)
                if divert is None:
                    break
                # Not ready, but the table has a side edge for why (RECLAIMING -> HELD), from
                # the phase the step already wrote, if it wrote one (a give-up in a start).
                written, to = divert
                if written is not None and written is not current.phase:
                    now = self.clock()
                    current = replace(current, phase=written, phase_since=now, nodes=tuple(
                        replace(v, phase=written, phase_since=now) for v in current.nodes))
                if not allowed(current.phase, to):
                    break
                target, reason = to, check_transition(current.phase, to)
                continue
            since = result.started + result.duration_s
            current = replace(current, phase=target, phase_since=since,
                              nodes=tuple(replace(v, phase=target, phase_since=since) for v in current.nodes))
            target = next_phase(current.phase)
            if target is not None:
                reason = check_transition(current.phase, target)
        return results

    # -- one step: wait for the edge's `ready`, apply its `effect` ----------------------------------------------------------------

    def _step(
        self, view: GroupView, model: str, to_phase: Phase, action: str, reason: str, deadline: float
    ) -> StepResult:
        started = self.clock()
        outcome, error, detail = StepOutcome.OK, None, None
        try:
            # The single check: an edge off the table is refused before any adapter call.
            edge = edge_for(view.phase, to_phase)
            self._why[view.name] = reason
            if self._waiters()[edge.ready](view, deadline):
                self._effects()[edge.effect](view, edge, deadline)
            else:
                outcome = StepOutcome.WAITING
        except Divert as exc:
            outcome, detail = StepOutcome.WAITING, str(exc)
            self._diverts[view.name] = (exc.written, exc.phase)
        except CarryOver as exc:
            outcome, detail = StepOutcome.WAITING, str(exc)
        except Superseded as exc:
            outcome, error = StepOutcome.SKIPPED, str(exc)
        except SlurmIdleError as exc:
            outcome, error = StepOutcome.ERROR, str(exc)
        except Exception as exc:  # noqa: BLE001 - an effector bug must not crash the tick
            outcome, error = StepOutcome.ERROR, f"{type(exc).__name__}: {exc}"
        # A step that diverts is not stuck: the side edge is its way on, taken at once.
        if (outcome is StepOutcome.WAITING and view.name not in self._diverts
                and self._overdue(view, started)):
            outcome = StepOutcome.STUCK
            error = f"{view.phase.value} for longer than its timeout; will retry" + (
                f"; {detail}" if detail else "")
        result = StepResult(
            node=view.name,
            model=model,
            action=action,
            from_phase=view.phase,
            to_phase=to_phase,
            reason=reason,
            outcome=outcome,
            started=started,
            duration_s=self.clock() - started,
            error=error,
            detail=detail,
            nodes=tuple(view.group.nodes) if len(view.nodes) > 1 else (),
        )
        # A step carried over (waiting) or left to an admin (skipped) is the normal course: a
        # decision line; a failed or stuck one is an error (the tick exits 1), the one line
        # stderr gets, even under -q.
        level = log.error if outcome in (StepOutcome.ERROR, StepOutcome.STUCK) else log.info
        level(
            "%s %s -> %s: %s [%s%s]",
            ",".join(v.name for v in view.nodes), view.phase.value, to_phase.value, reason, outcome,
            f": {error or detail}" if error or detail else "",
        )
        return result

    def _waiters(self) -> dict[Ready, Callable[[GroupView, float], bool]]:
        """Per `Edge.ready`: wait for it until the deadline. True once ready; False or
        CarryOver (with why) when not yet at the deadline."""
        return {
            Ready.NOW: lambda view, deadline: True,
            Ready.ENGINES_IDLE: self._engines_idle,
            Ready.NODES_EMPTY: self._empty_and_gpus_free,
            Ready.GPUS_FREE: self._gpus_free,
            Ready.ENGINES_SERVING: self._engines_serving,
        }

    def _effects(self) -> dict[Effect, Callable[[GroupView, Edge, float], None]]:
        """Per `Edge.effect`: the adapter calls, each writing `edge.to_phase`."""
        return {
            Effect.ROUTER_REMOVE: self._retire,
            Effect.ROUTER_ADD: self._back_to_serving,
            Effect.WRITE_PHASE: lambda view, edge, deadline: self._mark(view, edge.to_phase),
            Effect.STOP_ENGINES_AND_RESUME: self._stop_engine_and_resume,
            Effect.START_ENGINES: self._start_engines,
            Effect.RESTORE_COMMENT_AND_START: self._restore_comment_and_start,
            Effect.DRAIN_AND_REQUEUE: self._drain_and_requeue,
            Effect.WARM_UP_AND_ROUTER_ADD: self._warm_up_and_serve,
            Effect.RESTART_ENGINES: self._restart_engines,
            Effect.HAND_OVER: self._hand_over,
        }

    def _still_ours(self, view: GroupView, fresh: bool = False) -> None:
        """Raise Superseded if an admin drained (or downed) a node of the group since we
        observed it: the whole group is then left alone.

        The shared poll is at most POLL_S old; `fresh` reads Slurm now, for the step that
        follows a long wait (an engine stop) and would otherwise undo an admin's drain.
        """
        names = {v.name for v in view.nodes}
        for node in self.slurm.nodes() if fresh else self._nodes_poll.get():
            if node.name in names and derive_phase(node, self.tag).phase is Phase.ADMIN:
                raise Superseded(f"{node.name} was taken by an admin ({node.reason!r}); leaving it alone")

    def _mark(self, view: GroupView, phase: Phase) -> None:
        """Write the group's phase on every one of its nodes (each write idempotent)."""
        self._still_ours(view)
        reason = format_reason(self.tag, phase, self.clock(), view.pinned)
        for node in view.nodes:
            self.slurm.drain(node.name, reason)

    def _replicas(self, view: GroupView) -> list[tuple[str, ReplicaConfig]]:
        """(model, replica config) of every replica of the group."""
        out = []
        for replica in view.group.replicas:
            found = self._replica_configs.get(replica.name)
            if found is None:  # the planner only hands us pool nodes
                raise SlurmIdleError(f"{view.name} is not a pool node in the config")
            out.append(found)
        if not out:
            raise SlurmIdleError(f"{view.name} is not a pool node in the config")
        return out

    def _router_nodes(self, view: GroupView) -> list[str]:
        """The group's replicas as the router knows them: by replica name, each its own
        target (two replicas on a node are two servers; a whole-node replica's name is its
        node's)."""
        return list(dict.fromkeys(r.name or r.nodes[0] for r in view.group.replicas)) or [view.name]

    # -- the edges' effects (Edge.effect, `_effects`) and waits (Edge.ready, `_waiters`) ---------

    def _retire(self, view: GroupView, edge: Edge, deadline: float) -> None:
        # The router first: no new request reaches the replicas while they drain. A failed
        # call raises before the mark, so the group stays SERVING (retried next tick).
        self._still_ours(view)
        if self.router is not None:
            for node in self._router_nodes(view):
                self.router.remove(node, self._why.get(view.name, "retiring"))
        self._mark(view, edge.to_phase)

    def _back_to_serving(self, view: GroupView, edge: Edge, deadline: float) -> None:
        if self.router is not None:
            for node in self._router_nodes(view):
                self.router.add(node, self._why.get(view.name, "back to serving"))
        self._mark(view, edge.to_phase)

    def _poll_until(self, deadline: float, ready: Callable[[], bool]) -> bool:
        """The driver's one wait loop: ask `ready` every POLL_S (Slurm through the shared polls)
        until it says yes (True) or the deadline has passed (False). It always asks once."""
        while True:
            if ready():
                return True
            now = self.clock()
            if now >= deadline:
                return False
            self.sleep(min(POLL_S, max(0.0, deadline - now)))

    def _engines_idle(self, view: GroupView, deadline: float) -> bool:
        """No request in flight on any replica (at two readings a poll apart: IdleTwice), or
        the engine's drain window is over. False: still draining at the tick's deadline, the
        next tick carries on."""
        from slurm_idle.engine import IdleTwice, is_idle

        since = view.phase_since if view.phase_since is not None else self.clock()
        draining = {}  # replica name -> (its IdleTwice, drain window, its end)
        for model, replica in self._replicas(view):
            drain_s = self.config.engine_for(model).drain_timeout_s
            drained_now = IdleTwice(functools.partial(is_idle, self.engine_for(model), replica),
                                    self.clock, POLL_S)
            draining[replica.name] = (drained_now, drain_s, since + drain_s)

        def drained() -> bool:
            for name, (drained_now, drain_s, give_up_at) in list(draining.items()):
                if drained_now():
                    del draining[name]
                elif self.clock() >= give_up_at:
                    if not drained_now.was_idle:
                        log.warning("%s: requests still running after the %.0fs drain window; "
                                    "stopping anyway", name, drain_s)
                    del draining[name]
            return not draining

        last_window_end = max(end for *_, end in draining.values())
        return self._poll_until(min(deadline, last_window_end), drained)

    def _call_engine(self, op: str, model: str, replica: ReplicaConfig, deadline: float) -> None:
        """Engine start/stop, given the tick's time left (at least MIN_ENGINE_CALL_S)."""
        method = getattr(self.engine_for(model), op)
        method(replica, timeout_s=max(MIN_ENGINE_CALL_S, deadline - self.clock()))

    def _drain_for_stop(self, view: GroupView, model: str, replica: ReplicaConfig, deadline: float) -> None:
        """Before a stop or sleep that would drop the requests in flight (a vLLM too old to
        keep them, or one that does not say its version): wait until nothing is in flight, up
        to engine.drain_timeout_s after LENDING began. The tick's deadline first is a CarryOver
        (the next tick drains on); the drain window first is not: the stop goes ahead, as
        RETIRING's own drain does."""
        from slurm_idle.engine import is_idle

        engine = self.engine_for(model)
        why = engine.stop_drops_requests(replica)
        if why is None or is_idle(engine, replica):
            return  # nothing in flight (or a server that is down): nothing to drain
        drain_s = self.config.engine_for(model).drain_timeout_s
        since = view.phase_since if view.phase_since is not None else self.clock()
        window_end = since + drain_s
        if self._poll_until(min(deadline, window_end), lambda: is_idle(engine, replica)):
            return
        if self.clock() < window_end:
            raise CarryOver(f"{replica.name}: {why}: requests still in flight at the tick's "
                            "deadline; stays lending, the next tick drains on")
        log.warning("%s: %s and requests are still in flight after the %.0f s drain window; "
                    "stopping anyway", replica.name, why, drain_s)

    def _stop_engine_and_resume(self, view: GroupView, edge: Edge, deadline: float) -> None:
        from slurm_idle.engine import EngineDeadline

        self._still_ours(view)
        # A quick stop (an emulator's, well under a second) still completes in the tick that
        # asked, as the engine calls themselves do (MIN_ENGINE_CALL_S).
        deadline = max(deadline, self.clock() + MIN_ENGINE_CALL_S)
        replicas = self._replicas(view)
        for model, replica in replicas:
            self._drain_for_stop(view, model, replica, deadline)
            try:
                self._call_engine("stop", model, replica, deadline)
            except EngineDeadline as exc:
                raise CarryOver(f"{exc}; stays lending, carried over to the next tick, which "
                                "re-issues the stop") from None
        stopping = {r.name: (m, r) for m, r in replicas}

        def released() -> bool:
            for name, (model, replica) in list(stopping.items()):
                if self.engine_for(model).released(replica):
                    del stopping[name]
            return not stopping

        # The stop is a signal (a sleep request, a container stop): the GPUs are free only once
        # the engine says so, and only then may the nodes be RESUMEd.
        if not self._poll_until(deadline, released):
            raise CarryOver(f"replica(s) {', '.join(stopping)}: not stopped (or asleep) yet at the "
                            "tick's deadline; stays lending, the next tick re-issues the stop "
                            "and checks again")
        self._measure_residue(view, replicas, deadline)
        # Stopping can take minutes: an admin who drained a node meanwhile keeps the group (the
        # RESUME below would clear their drain and reason).
        self._still_ours(view, fresh=True)
        for node in view.nodes:
            if node.phase is Phase.LENT:
                continue  # resumed by a tick killed half-way through the group
            # Comment first: a tick killed between the two leaves a drained "lending" node,
            # which the next tick carries on; never an undrained node without our comment.
            self.slurm.set_comment(node.name, lent_comment(self.tag, self.clock(), node.node.comment))
            self.slurm.resume(node.name)

    def _measure_residue(self, view: GroupView, replicas: list[tuple[str, ReplicaConfig]],
                         deadline: float) -> None:
        """The engine stopped or asleep: what it left on each GPU, from samples taken after
        that (the exporter lags), is recorded as its residue, which the GPU gate allows it
        to find again at the reclaim. Above gpu.max_residue_mib a research job would get a GPU
        with less memory than Slurm promises: the lend is refused (Divert back to STARTING),
        and the replica is not lent again until `slurm-idle unpin`."""
        if not self._gpus.active:
            return
        since = min(self._notes.released_at(r.name, self.clock(), view.phase_since)
                    for _, r in replicas) + self.config.gpu.sample_lag_s
        measured: dict[str, dict[int, int]] = {}

        def read() -> bool:
            got = self._gpus.residue(replicas, newer_than=since)
            if got is not None:
                measured.update(got)
            return got is not None

        if not self._poll_until(deadline, read):
            raise CarryOver("waiting for GPU readings taken after the engine stopped (the memory "
                            "it leaves is measured before the node is lent); stays lending")
        limit = self.config.gpu.max_residue_mib
        over = [f"{name} GPU {i}: {mib} MiB" for name, per in measured.items()
                for i, mib in sorted(per.items()) if mib > limit]
        for _, replica in replicas:
            self._notes.forget_release(replica.name)
        if over:
            why = (f"lend refused: the engine left {'; '.join(over)} on its GPUs (more than "
                   f"gpu.max_residue_mib {limit}); not lent again until `slurm-idle unpin`")
            for _, replica in replicas:
                self._notes.refuse_lend(replica.name, why, self.clock())
            raise Divert(Phase.STARTING, why)
        for name, per in measured.items():
            self._notes.record_residue(name, per)

    def _restart_engines(self, view: GroupView, edge: Edge, deadline: float) -> None:
        """A SERVING group whose engine is gone or not ours: out of the router first (no
        client reaches whatever answers on the port), STARTING, then each replica that does
        not serve is stopped (a hung engine) and started again. STARTING -> SERVING admits it
        back only once its endpoint proves to be the engine (identity, warm-up).

        Checked again here, and only a replica whose endpoint is proven not its engine now
        (engine.identify False: nothing listening, or an answer without its identity) is
        restarted: a busy engine whose /health or /v1/models is slow, or one the tick saw
        during a blip that has passed, keeps serving and its clients (Superseded, nothing
        done, when none is proven broken any more)."""
        self._still_ours(view)
        replicas = self._replicas(view)
        broken = {r.name for m, r in replicas if self.engine_for(m).identify(r).ours is False}
        if not broken:
            raise Superseded(f"{view.name}: every engine answers as ours again (or cannot be "
                             "told): nothing to repair")
        if self.router is not None:
            for node in self._router_nodes(view):
                self.router.remove(node, self._why.get(view.name, "engine gone: restarting it"))
        self._mark(view, edge.to_phase)
        for model, replica in replicas:
            if replica.name in broken:
                self._call_engine("stop", model, replica, deadline)
        self._start(view, deadline, only=broken)

    def _restore_comment_and_start(self, view: GroupView, edge: Edge, deadline: float) -> None:
        self._mark(view, edge.to_phase)
        for _, replica in self._replicas(view):  # the lend is abandoned: so is its release time
            self._notes.forget_release(replica.name)
        self._restore_comment(view)  # a lend that failed after writing its comment
        self._start(view, deadline)

    def _start_engines(self, view: GroupView, edge: Edge, deadline: float) -> None:
        self._mark(view, edge.to_phase)
        self._start(view, deadline)

    def _restore_comment(self, view: GroupView, powered_down_too: bool = True) -> None:
        """Take our lent marker off the nodes' Comment, leaving the admin's text as it was; a
        Comment that is not ours (or none) is not written at all. Without `powered_down_too`,
        a powered-down node keeps it until it is up (_wait_powered)."""
        for node in view.nodes:
            if powered_down_too or not power_flags(node.node):
                self._restore_node_comment(node)

    def _restore_node_comment(self, node: NodeView) -> None:
        if is_ours(node.node.comment.strip(), self.tag):
            self.slurm.set_comment(node.name, admin_comment(node.node.comment, self.tag))

    def _start(self, view: GroupView, deadline: float, only: set[str] | None = None) -> None:
        """Start the group's engines (or those named in `only`), each once in this tick. A start
        still running at the deadline is not an error: the group is STARTING in Slurm, and the
        next tick re-checks health and re-issues the start (see `_wait_serving`). A start or
        wake that fails is retried with a backoff, then cold, then given up (start_retry.py):
        an error, a wait, or Divert to the admin."""
        from slurm_idle.engine import EngineDeadline

        waits: list[str] = []
        failed: list[str] = []
        for model, replica in self._replicas(view):
            if only is not None and replica.name not in only:
                continue
            given_up = self._retries.given_up(model, replica)
            if given_up is not None:
                raise Divert(Phase.ADMIN, f"{given_up}: handed to the admin", written=Phase.STARTING)
            backing_off = self._retries.backing_off(model, replica)
            if backing_off is not None:
                waits.append(backing_off)
                continue
            self._started.add(replica.name)
            try:
                self._held_before_retry(model, replica)
                self._call_engine("start", model, replica, deadline)
            except EngineDeadline as exc:
                log.warning("%s: %s; stays starting, carried over to the next tick", replica.name, exc)
            except SlurmIdleError as exc:
                after, why = self._retries.failed(model, replica, exc,
                                                  max(MIN_ENGINE_CALL_S, deadline - self.clock()))
                if after is After.GIVE_UP:
                    raise Divert(Phase.ADMIN, f"{why}: handed to the admin",
                                 written=Phase.STARTING) from None
                (waits if after is After.COLD else failed).append(why)
        if failed:
            raise SlurmIdleError("; ".join(failed + waits))
        if waits:
            raise CarryOver("; ".join(waits))

    def _held_before_retry(self, model: str, replica: ReplicaConfig) -> None:
        """A start or wake that failed before is not tried again on a GPU someone holds: the
        first one passed the gate (a reading from before a leftover allocated, or none), and
        each wake into a held GPU fails out of memory and leaks what it mapped. The held GPU
        counts as the next failed attempt, so the retries still end (cold restart, then the
        admin) and the last error names the holder."""
        if not self._gpus.active or self._retries.failures(replica) == 0:
            return
        held = self._gpus.verdict([(model, replica)], fresh_after=None).held
        if held:
            raise SlurmIdleError(f"not tried: GPU memory held: {describe(held)}")

    def _jobs_on(self, node: str) -> list[SlurmJob]:
        return [j for j in self._jobs_poll.get() if node in j.nodes and j.state in ACTIVE_JOB_STATES]

    def _drain_and_requeue(self, view: GroupView, edge: Edge, deadline: float) -> None:
        self._mark(view, edge.to_phase)
        # A powered-down node keeps our lent Comment until it is up (_wait_powered): Slurm
        # clears its Reason when the power-up starts, and the Comment still says it is ours.
        self._restore_comment(view, powered_down_too=False)
        self._drained.add(view.name)
        self._evict(view)
        for node in view.nodes:
            if needs_power_up(node.node):
                # Drained first, so no job lands on it once it is up; the wait is the next step's.
                log.info("%s: powered down by Slurm's power saving; asking for POWER_UP", node.name)
                self.slurm.power_up(node.name)
                self._powered_up.add(node.name)

    def _wait_powered(self, view: GroupView, deadline: float) -> None:
        """Wait until Slurm's power saving has every node of the group up (no power flag left),
        asking for POWER_UP again when nothing is under way (a tick killed before it asked).
        Raise CarryOver at the deadline: the group stays RECLAIMING and the next tick waits on.

        Slurm (22.05) clears a drained node's Reason when it starts powering it up: an empty
        Reason on our drained node is written again, and our lent Comment (kept until now so
        the node reads as ours meanwhile) is taken off once the node is up."""
        views = {v.name: v for v in view.nodes}
        powered = {name for name, v in views.items() if power_flags(v.node)}
        since = view.phase_since if view.phase_since is not None else self.clock()
        waiting: list[SlurmNode] = []

        def all_up() -> bool:
            polled = {n.name: n for n in self._nodes_poll.get() if n.name in views}
            waiting.clear()
            for name, v in views.items():
                node = polled.get(name)
                if node is not None and node.drained and not node.reason.strip() and name in powered:
                    self.slurm.drain(name, format_reason(self.tag, Phase.RECLAIMING, since, view.pinned))
                if node is None or not power_flags(node):
                    if name in powered and node is not None and is_ours(node.comment.strip(), self.tag):
                        self._restore_node_comment(replace(v, node=node))
                        powered.discard(name)
                    continue
                powered.add(name)
                waiting.append(node)
                if needs_power_up(node) and name not in self._powered_up:
                    self.slurm.power_up(name)
                    self._powered_up.add(name)
            return not waiting

        if not self._poll_until(deadline, all_up):
            flags = "+".join(sorted({f for n in waiting for f in power_flags(n)}))
            raise CarryOver(f"powering up ({flags}) at the tick's deadline; stays reclaiming, "
                            "the next tick waits on")

    def _still_on(self, node: str, problems: list[str]) -> str:
        """Why a reclaimed node is not empty yet, naming the jobs: the admin sees which ones
        hold the reclaim up (a foreign job too, though it is cancelled after the grace)."""
        lend_partition = self.config.slurm.lend_partition
        jobs = self._jobs_on(node)
        foreign = self._foreign_on(node)
        ours = [j for j in jobs if j.partition == lend_partition]
        parts = []
        if foreign:
            names = ", ".join(f"job {j.job_id} (partition {j.partition})" for j in foreign)
            done = {"cancel": "cancelled", "requeue": "requeued"}[self.config.slurm.foreign_job_action]
            parts.append(f"waiting for {names}, not ours: signalled, {done} after "
                         "slurm.requeue_grace_s")
        if ours:
            ids = ", ".join(str(j.job_id) for j in ours)
            parts.append(f"{lend_partition} job(s) {ids} still on the node (warned, requeued or "
                         f"cancelled after slurm.requeue_grace_s)")
        parts.extend(problems)
        return "; ".join(parts) or "waiting for the node to empty"

    def _evict(self, view: GroupView, again: bool = False) -> list[str]:
        """One pass of the evictor over the lend partition's jobs on the group's nodes
        (eviction.py): each job warned, then requeued (or cancelled) on its own, once even when
        it spans several nodes of the group. Reads the shared job poll (at most POLL_S old): a
        job that started just before the drain shows up in a later poll of the wait loop and is
        handled there."""
        lend_partition = self.config.slurm.lend_partition
        jobs = {j.job_id: j for v in view.nodes for j in self._jobs_on(v.name)
                if j.partition == lend_partition}
        foreign = {j.job_id: j for v in view.nodes for j in self._foreign_on(v.name)}
        since = None if view.name in self._drained else view.phase_since
        return self._evictor.step(view.name, jobs.values(), since, again=again,
                                  foreign=foreign.values())

    def _foreign_on(self, node: str) -> list[SlurmJob]:
        """Jobs on `node` that are neither the lend partition's nor one of our replica jobs
        (`placement: jobs`, replicajobs.replica_views): a job of the serve partition (which
        outranks the lend partition, so it can take a lent node) or of any other partition.
        The reclaim signals them and cancels (or requeues) them after the grace: a node the
        service needs is never left stuck behind them."""
        from slurm_idle.replicajobs import replica_views
        from slurm_idle.replicatrust import trust_for

        if self.trust is None:
            self.trust = trust_for(self.config, create=False, now=self.clock())
        jobs = self._jobs_poll.get()
        ours = {i for r in replica_views(self.config, jobs, self.trust)
                for i in (r.job_id, *r.duplicates) if i is not None}
        return [j for j in self._jobs_on(node)
                if j.partition != self.config.slurm.lend_partition and j.job_id not in ours]

    def _nodes_empty(self, view: GroupView, deadline: float) -> bool:
        """No job left on the group's nodes (the evictor warned, requeued or cancelled ours)
        and every node powered up."""
        requeued_again = False
        problems: list[str] = []
        busy: list[str] = []

        def empty() -> bool:
            nonlocal problems, busy, requeued_again
            # Also covers a tick killed between the drain and the requeue, and a job that
            # started just before the drain. The grace is waited here, under the deadline.
            problems = self._evict(view)
            busy = [v.name for v in view.nodes if self._jobs_on(v.name)]
            if not busy:
                return True
            if not requeued_again and self._overdue(view, self.clock()):
                # Still not empty long after the requeue: ask again, whatever the state.
                problems = self._evict(view, again=True)
                requeued_again = True
            return False

        if not self._poll_until(deadline, empty):
            raise CarryOver("; ".join(
                self._still_on(name, problems) if len(view.nodes) == 1
                else f"{name}: {self._still_on(name, problems)}" for name in busy))
        self._wait_powered(view, deadline)
        return True

    def _empty_and_gpus_free(self, view: GroupView, deadline: float) -> bool:
        """The group's nodes empty (`_nodes_empty`), then its GPUs free (policy/gpus.py): a
        GPU holding more than its engine may find there, in a reading taken after the nodes
        were seen empty, is a leftover Slurm no longer tracks: Divert to HELD, which waits for
        it under its own timeout. A reading from before (the exporter lags the GPUs) is waited
        on until the tick's deadline, then HELD too."""
        if not self._nodes_empty(view, deadline):
            return False
        empty_at = self.clock() + self.config.gpu.sample_lag_s
        replicas = self._replicas(view)
        verdict = GateVerdict()

        def settled() -> bool:
            nonlocal verdict
            verdict = self._gpus.verdict(replicas, fresh_after=empty_at)
            return verdict.clear or bool(verdict.leftover)

        self._poll_until(deadline, settled)
        self._warn_unobserved(view, verdict)
        if verdict.clear:
            return True
        lag = "" if verdict.leftover else (
            " (in readings taken before the node emptied; waiting for newer ones)")
        raise Divert(Phase.HELD, f"node empty but GPU memory held: {describe(verdict.held)}{lag}")

    def _gpus_free(self, view: GroupView, deadline: float) -> bool:
        """HELD: every GPU of the group back within what its engine may find there."""
        replicas = self._replicas(view)
        verdict = GateVerdict()

        def free() -> bool:
            nonlocal verdict
            verdict = self._gpus.verdict(replicas, fresh_after=None)
            return verdict.clear

        if not self._poll_until(deadline, free):
            raise CarryOver(f"GPU memory held: {describe(verdict.held)}; stays held (past "
                            "timeouts.gpu_free_s it no longer counts as coming back)")
        self._warn_unobserved(view, verdict)
        return True

    def _hand_over(self, view: GroupView, edge: Edge, deadline: float) -> None:
        """Drain every node of the group for the admin with a Reason that says why
        (handover.py): a GPU held past timeouts.gpu_free_s (HELD), or starts that kept
        failing (STARTING)."""
        self._still_ours(view)
        if view.phase is Phase.STARTING:
            self._hand_over_failed_starts(view)
        else:
            self._hand_over_held(view)

    def _hand_over_failed_starts(self, view: GroupView) -> None:
        """Every replica given up is named with its last error; their failures are forgotten
        (the admin's fix starts afresh once the node is resumed and adopted again)."""
        now = self.clock()
        given_up = [(m, r, self._retries.given_up(m, r)) for m, r in self._replicas(view)]
        failing = [(r, why) for m, r, why in given_up if why is not None]
        if not failing:
            raise Superseded(f"{view.name}: no replica given up any more: not handed over")
        replica, why = failing[0]
        for node in view.nodes:
            self.slurm.drain(node.name, handover.format_wake_failed(
                self.tag, node.name, now, replica.name, why.removeprefix(f"{replica.name}: ")))
        for replica, _ in failing:
            self._retries.served(replica)
        log.error("%s handed to the admin: %s", view.name, "; ".join(why for _, why in failing))

    def _hand_over_held(self, view: GroupView) -> None:
        """HELD past timeouts.gpu_free_s: the Reason names its held GPUs and their holder.
        Read fresh: GPUs freed meanwhile (or no reading at all) Divert to STARTING, the
        engine starts in the same step."""
        verdict = self._gpus.verdict(self._replicas(view), fresh_after=view.phase_since)
        if verdict.clear:  # freed meanwhile, or no reading (an outage must not strand it)
            raise Divert(Phase.STARTING, f"{view.name}: its GPUs are free (or not observed): "
                                         "not handed over, the engine starts")
        now = self.clock()
        for node in view.nodes:
            self.slurm.drain(node.name, handover.format_reason(self.tag, node.name, now, verdict.held))
        for _, replica in self._replicas(view):  # the admin's fix starts afresh once resumed
            self._retries.served(replica)
        log.error("%s handed to the admin: %s", view.name, describe(verdict.held))

    def _warn_unobserved(self, view: GroupView, verdict: GateVerdict) -> None:
        if verdict.unobserved:
            log.warning("%s: no GPU readings for %s: its GPUs were not checked before the start "
                        "(see slurm-idle doctor)", view.name, ", ".join(verdict.unobserved))

    def _engines_serving(self, view: GroupView, deadline: float) -> bool:
        """Every replica of the group healthy and awake; a replica that does not get there keeps
        the whole group STARTING, named in the carried-over reason. A replica found down that
        this tick has not started yet is started again (idempotent), never twice in a tick."""
        replicas = self._replicas(view)
        down = {r.name for m, r in replicas
                if r.name not in self._started and not self.engine_for(m).health(r).serving}
        if down:
            # Started by an earlier tick (or one killed between writing STARTING and starting
            # the engine): start() is idempotent, issue it again. Never twice in one tick.
            self._start(view, deadline, only=down)
        coming = {r.name: (m, r) for m, r in replicas}

        def serving() -> bool:
            for name, (model, replica) in list(coming.items()):
                if self.engine_for(model).health(replica).serving:
                    del coming[name]
                    self._retries.served(replica)
            return not coming

        if not self._poll_until(deadline, serving):
            late = list(coming)
            who = f"replica(s) {', '.join(late)}: " if len(replicas) > 1 else ""
            raise CarryOver(f"{who}engine not serving yet at the tick's deadline; stays starting, carried "
                            "over to the next tick, which re-checks health (and re-issues the start)")
        return True

    def _warm_up_and_serve(self, view: GroupView, edge: Edge, deadline: float) -> None:
        """With a router: one real completion per replica, then clients; then SERVING."""
        if self.router is not None:
            # Healthy and awake is not enough: one real completion, then clients.
            for node in self._router_nodes(view):
                try:
                    self.router.warm_up(node)
                except SlurmIdleError as exc:
                    raise CarryOver(f"{exc}; stays starting, the next tick warms it up again") from None
            for node in self._router_nodes(view):
                self.router.add(node, self._why.get(view.name, "serving again"))
        self._mark(view, edge.to_phase)

    def _overdue(self, view: GroupView, now: float) -> bool:
        return overdue(view.phase, view.phase_since, self.config, now)


def action_for_admin(view: NodeView, kind: ActionKind, reason: str) -> Action:
    """The Action an admin's `lend NODE` / `reclaim NODE` stands for, checked against the table."""
    to_phase = {
        ActionKind.LEND: Phase.RETIRING,
        ActionKind.RECLAIM: Phase.RECLAIMING,
    }[kind]
    check_transition(view.phase, to_phase)
    return Action(kind, view.name, view.model, view.phase, to_phase, reason)
