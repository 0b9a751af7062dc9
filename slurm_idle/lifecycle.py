"""The node lifecycle as data: which phase changes are allowed (one table of `Edge`s), and how a
phase is written into and read back from Slurm.

`EDGES` is the only place the lifecycle is written down. Each edge says why it exists, how long
its from-phase may last (`timeout`, which also makes it the phase's forward step), what must be
observed before it is taken (`ready`) and which adapter calls it makes (`effect`). The driver
(transitions.py) dispatches on `ready` and `effect` and reports a phase past its timeout as
stuck; the planner carries transitional phases on with `next_phase` and stops counting on stuck
ones; the simulator charges each `ready` a latency; `takes_traffic` is the one answer to "does
this replica serve" for wiring, planner and simulator.

The pool's state lives in Slurm, not in a file of ours. A node we hold back for serving is
DRAINed with a Reason carrying our tag (`slurm-idle:serving since=2026-12-02T10:00:00Z`);
transitional phases carry their own word and start time the same way. A lent node is a normal
schedulable node whose Comment says `slurm-idle:lent since=...` (a Reason cannot be set on a
node that is not drained). Anything else drained or down belongs to an admin and is never
touched. Everything here is pure text handling, tested on its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, TypeAlias

from slurm_idle.errors import ExitCode, SlurmIdleError
from slurm_idle.journal import iso
from slurm_idle.model import Phase, SlurmNode
from slurm_idle.powersave import powered_only

if TYPE_CHECKING:
    from slurm_idle.config import Config

#: Phases that are written into a drained node's Reason.
DRAINED_PHASES = frozenset(
    {Phase.SERVING, Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING, Phase.HELD, Phase.STARTING}
)


class Ready(StrEnum):
    """What must be observed before an edge is taken; the driver waits for it (through the
    shared Slurm poll, until the tick's deadline) and the simulator charges its latency."""

    NOW = "now"  # nothing to wait for
    ENGINES_IDLE = "engines_idle"  # no request in flight on any replica, or the drain window over
    NODES_EMPTY = "nodes_empty"  # no job left on the group's nodes, every node powered up
    GPUS_FREE = "gpus_free"  # every GPU of the group holds no more than its engine's own residue
    ENGINES_SERVING = "engines_serving"  # every replica healthy and awake
    JOB_GONE = "job_gone"  # placement jobs: the replica job left the queue
    JOB_RUNNING = "job_running"  # placement jobs: the replica job runs (Slurm placed it)


class Effect(StrEnum):
    """The adapter calls an edge makes once it is ready; the driver dispatches on this name.
    Each writes the new phase into Slurm (before any slow call, so a killed tick resumes)."""

    ROUTER_REMOVE = "router_remove"  # router forgets the replicas; write RETIRING
    ROUTER_ADD = "router_add"  # router knows the replicas again; write SERVING
    WRITE_PHASE = "write_phase"  # only write the new phase
    STOP_ENGINES_AND_RESUME = "stop_engines_and_resume"  # stop engines; lent Comment; RESUME
    START_ENGINES = "start_engines"  # write STARTING; start (or wake) the engines
    RESTORE_COMMENT_AND_START = "restore_comment_and_start"  # as START_ENGINES, lent Comment off
    DRAIN_AND_REQUEUE = "drain_and_requeue"  # write RECLAIMING (DRAIN); warn/requeue; POWER_UP
    WARM_UP_AND_ROUTER_ADD = "warm_up_and_router_add"  # one completion, router add; write SERVING
    RESTART_ENGINES = "restart_engines"  # router remove; write STARTING; stop and start the engines
    CANCEL_JOB = "cancel_job"  # placement jobs: write LENDING into the job's Comment; scancel
    SUBMIT_JOB = "submit_job"  # placement jobs: sbatch the replica job (Comment: RECLAIMING)
    NOTHING = "nothing"  # placement jobs: the new phase is the job's own state, nothing to write
    HAND_OVER = "hand_over"  # drain for the admin with a Reason naming the GPUs and their holder


#: How long the from-phase may last: a key of `config.timeouts` or a function of the config.
Timeout: TypeAlias = str | Callable[["Config"], float] | None


@dataclass(frozen=True)
class Edge:
    """One allowed phase change. An edge with a `timeout` is its from-phase's forward step
    (CONTINUE, `next_phase`); the phase is stuck once older than the timeout."""

    from_phase: Phase
    to_phase: Phase
    why: str
    timeout: Timeout
    ready: Ready
    effect: Effect

    def timeout_s(self, config: Config) -> float | None:
        if self.timeout is None:
            return None
        if isinstance(self.timeout, str):
            return float(getattr(config.timeouts, self.timeout))
        return float(self.timeout(config))


#: Every allowed phase change, with why it exists. `check_transition` refuses anything else.
EDGES: tuple[Edge, ...] = (
    Edge(Phase.SERVING, Phase.RETIRING,
         "load stayed low: let in-flight requests finish before the engine stops",
         None, Ready.NOW, Effect.ROUTER_REMOVE),
    Edge(Phase.RETIRING, Phase.LENDING,
         "no request in flight (or drain timeout): stop or sleep the engine",
         "retire_s", Ready.ENGINES_IDLE, Effect.WRITE_PHASE),
    Edge(Phase.RETIRING, Phase.SERVING,
         "load rose again before the engine stopped: keep serving",
         None, Ready.NOW, Effect.ROUTER_ADD),
    Edge(Phase.LENDING, Phase.LENT,
         "engine stopped: RESUME the node into the idle partition",
         "lend_s", Ready.NOW, Effect.STOP_ENGINES_AND_RESUME),
    Edge(Phase.LENDING, Phase.STARTING,
         "load rose while the engine was stopping: bring it straight back",
         None, Ready.NOW, Effect.RESTORE_COMMENT_AND_START),
    Edge(Phase.LENT, Phase.RECLAIMING,
         "load rises or forecast ramp: DRAIN and requeue the idle jobs",
         None, Ready.NOW, Effect.DRAIN_AND_REQUEUE),
    Edge(Phase.RECLAIMING, Phase.STARTING,
         "node empty: start or wake the engine",
         "reclaim_s", Ready.NODES_EMPTY, Effect.START_ENGINES),
    Edge(Phase.RECLAIMING, Phase.HELD,
         "node empty but a GPU still holds memory that is not the engine's (a process Slurm "
         "no longer tracks): waking on it would fail out of memory",
         None, Ready.NOW, Effect.WRITE_PHASE),
    Edge(Phase.HELD, Phase.STARTING,
         "every GPU free again: start or wake the engine",
         "gpu_free_s", Ready.GPUS_FREE, Effect.START_ENGINES),
    Edge(Phase.HELD, Phase.ADMIN,
         "a GPU still held past timeouts.gpu_free_s: drained for the admin, the Reason naming "
         "the holder; capacity is taken elsewhere",
         None, Ready.NOW, Effect.HAND_OVER),
    Edge(Phase.STARTING, Phase.SERVING,
         "engine healthy and awake: serving again",
         "start_s", Ready.ENGINES_SERVING, Effect.WARM_UP_AND_ROUTER_ADD),
    Edge(Phase.STARTING, Phase.ADMIN,
         "its starts or wakes kept failing (engine.wake_attempts, then a cold restart where one "
         "is configured): drained for the admin with the engine's error",
         None, Ready.NOW, Effect.HAND_OVER),
    Edge(Phase.UNKNOWN, Phase.RECLAIMING,
         "unmanaged pool node: adopt it into serving (service first)",
         None, Ready.NOW, Effect.DRAIN_AND_REQUEUE),
    Edge(Phase.SERVING, Phase.STARTING,
         "engine gone or not ours (nothing answers, or no identity): out of the router, restart it",
         None, Ready.NOW, Effect.RESTART_ENGINES),
)


#: `placement: jobs` (replicajobs.py, jobdriver.py): the same phases and edges, each replica a
#: Slurm job whose Comment (or state) holds the phase. Lending cancels the job; reclaiming
#: submits it and Slurm preempts idle jobs itself, so there is no DRAIN, no engine command, no
#: LENDING -> STARTING shortcut (a cancelled job cannot come back) and no repair of an engine
#: (SERVING -> STARTING: a replica job's engine is its job's). The GPU wait is the job's own:
#: its script checks its GPUs before vLLM starts (STARTING -> HELD -> STARTING), and a hand-over
#: cancels the job after draining its node (HELD -> LENDING).
JOB_EDGES: tuple[Edge, ...] = (
    Edge(Phase.SERVING, Phase.RETIRING,
         "load stayed low: out of the router, let in-flight requests finish",
         None, Ready.NOW, Effect.ROUTER_REMOVE),
    Edge(Phase.RETIRING, Phase.LENDING,
         "no request in flight (or drain timeout): scancel the replica job",
         "retire_s", Ready.ENGINES_IDLE, Effect.CANCEL_JOB),
    Edge(Phase.RETIRING, Phase.SERVING,
         "load rose again before the job was cancelled: keep serving",
         None, Ready.NOW, Effect.ROUTER_ADD),
    Edge(Phase.LENDING, Phase.LENT,
         "the replica job left the queue: its GPUs are the idle partition's",
         "lend_s", Ready.JOB_GONE, Effect.NOTHING),
    Edge(Phase.LENT, Phase.RECLAIMING,
         "load rises or forecast ramp: submit the replica job (Slurm preempts idle jobs)",
         None, Ready.NOW, Effect.SUBMIT_JOB),
    Edge(Phase.RECLAIMING, Phase.STARTING,
         "the replica job runs: its engine starts",
         "reclaim_s", Ready.JOB_RUNNING, Effect.NOTHING),
    Edge(Phase.STARTING, Phase.HELD,
         "the job's script found a GPU of the job holding memory that is not its own: it "
         "waits before vLLM starts and says `held` in the job's Comment",
         None, Ready.NOW, Effect.NOTHING),
    Edge(Phase.HELD, Phase.STARTING,
         "every GPU of the job free again: the script starts vLLM (its Comment back to starting)",
         "gpu_free_s", Ready.GPUS_FREE, Effect.NOTHING),
    Edge(Phase.HELD, Phase.LENDING,
         "a GPU still held past timeouts.gpu_free_s: the node drained for the admin, the Reason "
         "naming the holder, and the job cancelled (the replica is submitted again elsewhere)",
         None, Ready.NOW, Effect.HAND_OVER),
    Edge(Phase.STARTING, Phase.SERVING,
         "engine healthy and awake: serving again",
         "start_s", Ready.ENGINES_SERVING, Effect.WARM_UP_AND_ROUTER_ADD),
)


class IllegalTransition(SlurmIdleError):
    """A phase change that is not in the edge table: the lifecycle's safety rule refused it
    (exit 3, like any refusal), nothing was changed."""

    exit_code = ExitCode.REFUSED


class Lifecycle:
    """What the edge table implies, worked out once: every consumer (driver, planner,
    simulator, metrics) asks this object, so the table is the only place a phase change is
    written down. Tests build one from a reduced table to see who depends on an edge."""

    def __init__(self, edges: Iterable[Edge]) -> None:
        self.edges: tuple[Edge, ...] = tuple(edges)
        self.by_key: dict[tuple[Phase, Phase], Edge] = {}
        self.forward: dict[Phase, Edge] = {}
        for e in self.edges:
            if (e.from_phase, e.to_phase) in self.by_key:
                raise ValueError(f"edge {e.from_phase.value} -> {e.to_phase.value} given twice")
            self.by_key[(e.from_phase, e.to_phase)] = e
            if e.timeout is not None:
                if e.from_phase in self.forward:
                    raise ValueError(f"{e.from_phase.value} has two timed (forward) edges")
                self.forward[e.from_phase] = e
        # A replica takes traffic in the phase its engines come up into (the to-phase of the
        # edge that waits for them serving) and in a phase that waits for its requests to end
        # (it still finishes what it has while it drains): SERVING and RETIRING.
        self.traffic: frozenset[Phase] = frozenset(
            {e.to_phase for e in self.edges if e.ready is Ready.ENGINES_SERVING}
            | {e.from_phase for e in self.edges if e.ready is Ready.ENGINES_IDLE})
        # A phase is on its way back to serving when its forward steps reach a traffic phase
        # without settling first (RECLAIMING, HELD, STARTING; RETIRING and LENDING settle in
        # LENT): the replicas it brings back count as supply until it is stuck.
        self.arriving: frozenset[Phase] = frozenset(
            p for p in self.forward if self._reaches_traffic(p))
        # The lent side: the timed phases whose forward steps settle outside traffic (RETIRING,
        # LENDING) and the phase they settle in (LENT). policy.max_lent_fraction counts the
        # replicas in these phases.
        settles = {p: self._settles_in(p) for p in self.forward}
        leaving = {p for p, end in settles.items() if end not in self.traffic}
        self.lent: frozenset[Phase] = frozenset(leaving | {settles[p] for p in leaving})

    def _settles_in(self, phase: Phase) -> Phase:
        seen: set[Phase] = set()
        while phase in self.forward and phase not in seen:
            seen.add(phase)
            phase = self.forward[phase].to_phase
        return phase

    def _reaches_traffic(self, phase: Phase) -> bool:
        seen: set[Phase] = set()
        while phase in self.forward and phase not in seen:
            seen.add(phase)
            phase = self.forward[phase].to_phase
            if phase in self.traffic:
                return True
        return False


#: The lifecycle of the running process. Read through the functions below (never copied at
#: import), so a test may swap it for a reduced table.
LIFECYCLE = Lifecycle(EDGES)
#: The lifecycle of `placement: jobs` replicas (JOB_EDGES), read by jobdriver and policy/jobs.
JOB_LIFECYCLE = Lifecycle(JOB_EDGES)


def job_edge_for(from_phase: Phase, to_phase: Phase) -> Edge:
    """The `placement: jobs` edge from -> to, or raise IllegalTransition."""
    try:
        return JOB_LIFECYCLE.by_key[(from_phase, to_phase)]
    except KeyError:
        raise IllegalTransition(
            f"replica job transition {from_phase.value} -> {to_phase.value} is not allowed"
        ) from None


def job_next_phase(phase: Phase) -> Phase | None:
    """The forward step of a replica job's transitional phase, None for a settled one."""
    edge = JOB_LIFECYCLE.forward.get(phase)
    return edge.to_phase if edge is not None else None


def edges() -> tuple[Edge, ...]:
    """Every allowed edge, in table order."""
    return LIFECYCLE.edges


def edge_for(from_phase: Phase, to_phase: Phase) -> Edge:
    """The edge from -> to, or raise IllegalTransition."""
    try:
        return LIFECYCLE.by_key[(from_phase, to_phase)]
    except KeyError:
        raise IllegalTransition(
            f"transition {from_phase.value} -> {to_phase.value} is not allowed"
        ) from None


def allowed(from_phase: Phase, to_phase: Phase) -> bool:
    """Whether from -> to is an edge of the table."""
    return (from_phase, to_phase) in LIFECYCLE.by_key


def check_transition(from_phase: Phase, to_phase: Phase) -> str:
    """Return why the edge exists, or raise IllegalTransition."""
    return edge_for(from_phase, to_phase).why


def forward_edge(phase: Phase) -> Edge | None:
    """The timed edge a transitional phase moves on by (CONTINUE), None for a settled one."""
    return LIFECYCLE.forward.get(phase)


def next_phase(phase: Phase) -> Phase | None:
    """The forward step of a transitional phase (CONTINUE), None for a settled one."""
    edge = LIFECYCLE.forward.get(phase)
    return edge.to_phase if edge is not None else None


def timed_phases() -> frozenset[Phase]:
    """The phases that move on by themselves and can be stuck (RETIRING, LENDING, RECLAIMING,
    HELD, STARTING)."""
    return frozenset(LIFECYCLE.forward)


def arriving_phases() -> frozenset[Phase]:
    """The phases on their way back to serving (RECLAIMING, HELD, STARTING): their replicas
    count as coming back until the phase is stuck past its timeout."""
    return LIFECYCLE.arriving


def job_arriving_phases() -> frozenset[Phase]:
    """`placement: jobs`: the replica job phases on their way back to serving."""
    return JOB_LIFECYCLE.arriving


def lent_phases() -> frozenset[Phase]:
    """The phases of a lend under way or done (RETIRING, LENDING, LENT): what
    policy.max_lent_fraction counts."""
    return LIFECYCLE.lent


def job_lent_phases() -> frozenset[Phase]:
    """`placement: jobs`: the replica job phases of a lend under way or done."""
    return JOB_LIFECYCLE.lent


def job_overdue(phase: Phase, since: float | None, config: Config, now: float) -> bool:
    """A replica job's timed phase entered at `since` and older than its JOB_EDGES timeout."""
    edge = JOB_LIFECYCLE.forward.get(phase)
    limit = edge.timeout_s(config) if edge is not None else None
    return limit is not None and since is not None and now - since > limit


def phase_timeout_s(phase: Phase, config: Config) -> float | None:
    """How long `phase` may last before it is stuck, None for a settled phase."""
    edge = LIFECYCLE.forward.get(phase)
    return edge.timeout_s(config) if edge is not None else None


def overdue(phase: Phase, since: float | None, config: Config, now: float) -> bool:
    """A timed phase entered at `since` and older than its timeout at `now` (stuck)."""
    if since is None:
        return False
    limit = phase_timeout_s(phase, config)
    return limit is not None and now - since > limit


def takes_traffic(phase: Phase) -> bool:
    """Whether a replica in `phase` serves requests (SERVING, and RETIRING while it drains)."""
    return phase in LIFECYCLE.traffic


@dataclass(frozen=True)
class PhaseInfo:
    """What a node's Slurm state says about our lifecycle."""

    phase: Phase
    since: float | None = None
    pinned: bool = False


_SINCE = re.compile(r"\bsince=(\S+)")
#: The exact shape `iso()` writes, read without strptime (its locale checks cost ~10 us a node).
_ISO_Z = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})Z")


def _parse_since(text: str) -> float | None:
    match = _SINCE.search(text)
    if not match:
        return None
    exact = _ISO_Z.fullmatch(match.group(1))
    try:
        if exact:
            y, mo, d, h, mi, sec = map(int, exact.groups())
            return datetime(y, mo, d, h, mi, sec, tzinfo=UTC).timestamp()
        return datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def format_reason(tag: str, phase: Phase, since: float, pinned: bool = False) -> str:
    """The Reason we write on a drained node, e.g. `slurm-idle:serving since=... pinned`."""
    if phase not in DRAINED_PHASES:
        raise ValueError(f"phase {phase.value} is not written into a Reason")
    return f"{tag}:{phase.value} since={iso(since)}" + (" pinned" if pinned else "")


#: Between our lent marker and an admin's own text in a node's Comment (see transitions).
COMMENT_SEP = " | "


def format_lent_comment(tag: str, since: float) -> str:
    """The Comment we write on a node we lend."""
    return f"{tag}:lent since={iso(since)}"


def is_ours(text: str, tag: str) -> bool:
    return text.startswith(f"{tag}:")


def _our_words(text: str, tag: str) -> tuple[str, float, bool] | None:
    """(phase word, since, pinned) of text in exactly the shape we write, else None.

    `<tag>:<word> since=<ISO-8601Z>[ pinned]` and nothing else: a Reason or Comment that
    merely starts with our tag (`slurm-idle:serving since=garbage`, `slurm-idle:lent` as a
    Reason) was written by someone else, and a node someone else marked is theirs.
    """
    if not is_ours(text, tag):
        return None
    words = text[len(tag) + 1 :].split(" ")
    pinned = words[-1] == "pinned" and len(words) == 3
    if len(words) != 2 + pinned or not words[1].startswith("since="):
        return None
    if not _ISO_Z.fullmatch(words[1][len("since=") :]):
        return None
    since = _parse_since(text)
    if since is None:
        return None
    return words[0], since, pinned


def derive_phase(node: SlurmNode, tag: str) -> PhaseInfo:
    """Read our phase back from what Slurm shows; never claim a node an admin holds.

    Power saving: a node Slurm powered down (or is powering down or up) carries no Reason of
    its own, so its power flags alone do not make it an admin's. A lent node stays LENT
    whatever its power state (its Comment says so; reclaim powers it up), and a node we are
    reclaiming stays RECLAIMING while it powers up. A powered-off node in any other phase of
    ours has no engine to serve from: UNKNOWN, as a dead node with our Reason. Slurm 22.05
    clears a drained node's Reason when it starts powering it up; reclaim keeps our lent
    Comment until the node is up, so such a node (drained, no Reason, our lent Comment) is
    still ours: RECLAIMING.
    """
    reason = node.reason.strip()
    powered = powered_only(node)
    down = node.down and not powered
    if node.drained or down:
        ours = _our_words(reason, tag)
        if ours is None and powered and not reason and _lent_marker(node, tag):
            # 22.05 clears a drained node's Reason when its power-up starts: our lent marker
            # is still in the Comment, so this is our reclaim waiting for the node.
            return PhaseInfo(Phase.RECLAIMING)
        if down and is_ours(reason, tag):
            # Our reason on a dead node: we cannot act on it until it answers again.
            return PhaseInfo(Phase.UNKNOWN, ours[1] if ours else None, bool(ours and ours[2]))
        if ours is None:
            return PhaseInfo(Phase.ADMIN)
        word, since, pinned = ours
        try:
            phase = Phase(word)
        except ValueError:
            return PhaseInfo(Phase.ADMIN)
        if phase not in DRAINED_PHASES:
            return PhaseInfo(Phase.ADMIN)  # e.g. `lent` as a Reason: we never write that
        if powered and phase is not Phase.RECLAIMING:
            return PhaseInfo(Phase.UNKNOWN, since, pinned)
        return PhaseInfo(phase, since, pinned)
    # A lend keeps an admin's Comment after ours (`<ours> | <theirs>`): read only our part, so
    # their text can never look like our "pinned" or "since=".
    comment = node.comment.strip().split(COMMENT_SEP, 1)[0]
    if is_ours(comment, tag):
        ours = _our_words(comment, tag)
        if ours is None or ours[0] != Phase.LENT.value:
            return PhaseInfo(Phase.ADMIN)
        return PhaseInfo(Phase.LENT, ours[1], ours[2])
    return PhaseInfo(Phase.UNKNOWN)


def _lent_marker(node: SlurmNode, tag: str) -> str:
    """Our lent marker at the head of the node's Comment, or "". A lend keeps an admin's
    Comment after ours (`<ours> | <theirs>`): only our part is read, so their text can never
    look like our "pinned" or "since="."""
    comment = node.comment.strip().split(COMMENT_SEP, 1)[0]
    ours = _our_words(comment, tag)
    return comment if ours is not None and ours[0] == Phase.LENT.value else ""
