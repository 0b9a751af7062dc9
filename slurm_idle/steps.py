"""What both drivers (transitions.NodeDriver for nodes, jobdriver.JobDriver for replica jobs)
share: a step's journaled result, the errors that carry a step over or skip it, the Slurm poll
their threads share, the job states that occupy a node, and our marker in a node's Comment
(kept in front of the admin's text, never replacing it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import StepOutcome, TransitionRecord
from slurm_idle.lifecycle import (
    COMMENT_SEP,
    format_lent_comment,
    is_ours,
)
from slurm_idle.model import (
    Phase,
)

T = TypeVar("T")

#: Job states that still occupy a node.
ACTIVE_JOB_STATES = frozenset(
    {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED"}
)

POLL_S = 1.0

#: An engine start or stop gets at least this long even when the tick's deadline is nearer (or
#: past), so a quick one (an emulator's, well under a second) still completes in the tick that
#: asked; a tick overruns its budget by at most this much.
MIN_ENGINE_CALL_S = 5.0


class Superseded(SlurmIdleError):
    """Someone else (an admin) took the node while we were waiting: leave it alone."""


class CarryOver(SlurmIdleError):
    """A step that cannot finish in this tick, and why. The node stays in its phase (written in
    Slurm) for the next tick; journaled as `waiting`, or `stuck` past the phase's timeout."""


class Divert(CarryOver):
    """A step that cannot finish, and the table's side edge that is the way on instead: a
    reclaimed node that is empty but whose GPU someone still holds goes RECLAIMING -> HELD,
    where it waits under its own timeout. Journaled as `waiting`, like CarryOver; the driver
    then takes the edge to `phase`."""

    def __init__(self, phase: Phase, why: str, written: Phase | None = None) -> None:
        super().__init__(why)
        self.phase = phase
        # The phase the step wrote before it diverted (a start writes STARTING first), which
        # the edge leaves from; None: the step's own from-phase.
        self.written = written


def admin_comment(comment: str, tag: str) -> str:
    """The admin's part of a node Comment: all of it when it is not ours, what follows our
    marker when it is (nothing for a marker alone)."""
    text = comment.strip()
    if not is_ours(text, tag):
        return text
    _, sep, rest = text.partition(COMMENT_SEP)
    return rest.strip() if sep else ""


def lent_comment(tag: str, since: float, current: str) -> str:
    """The Comment of a node we lend: our marker first (what `derive_phase` reads), then the
    admin's text the node had, if any, so a lend never loses it."""
    marker = format_lent_comment(tag, since)
    kept = admin_comment(current, tag)
    return f"{marker}{COMMENT_SEP}{kept}" if kept else marker


class SharedPoll(Generic[T]):
    """One Slurm query shared by every node thread per poll interval, so that acting on many
    nodes at once stays a handful of `squeue`/`sinfo` calls, not one per node per second."""

    def __init__(self, fetch: Callable[[], T], max_age_s: float, clock: Callable[[], float]) -> None:
        self._fetch, self._max_age_s, self._clock = fetch, max_age_s, clock
        self._lock = threading.Lock()
        self._value: T | None = None
        self._at = float("-inf")

    def get(self) -> T:
        with self._lock:
            now = self._clock()
            if self._value is None or now - self._at >= self._max_age_s:
                self._value = self._fetch()
                self._at = now
            return self._value


@dataclass(frozen=True)
class StepResult:
    """One attempted phase change, as journaled."""

    node: str
    model: str
    action: str
    from_phase: Phase
    to_phase: Phase
    reason: str
    outcome: StepOutcome
    started: float
    duration_s: float
    error: str | None = None
    detail: str | None = None  # why a step is still waiting (carried over to the next tick)
    nodes: tuple[str, ...] = ()  # every node of a multi-node lend group (`node` is its key)

    def __post_init__(self) -> None:
        # A caller's plain string ("ok") becomes the member, so `is StepOutcome.OK` holds.
        object.__setattr__(self, "outcome", StepOutcome(self.outcome))

    def to_record(self) -> TransitionRecord:
        return TransitionRecord(
            ts=self.started, node=self.node, model=self.model, action=self.action,
            from_phase=self.from_phase.value, to_phase=self.to_phase.value, reason=self.reason,
            outcome=self.outcome, duration_s=self.duration_s, error=self.error,
            detail=self.detail, nodes=self.nodes,
        )

    def record(self) -> dict[str, Any]:
        """The journal's transition record (also `tick --json`'s steps)."""
        return self.to_record().to_json()
