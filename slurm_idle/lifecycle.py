"""The node lifecycle as data: how a phase is written into and read back from Slurm, and
which phase changes are allowed.

The pool's state lives in Slurm, not in a file of ours. A node we hold back for serving is
DRAINed with a Reason carrying our tag (`slurm-idle:serving since=2026-12-02T10:00:00Z`);
transitional phases carry their own word and start time the same way. A lent node is a normal
schedulable node whose Comment says `slurm-idle:lent since=...` (a Reason cannot be set on a
node that is not drained). Anything else drained or down belongs to an admin and is never
touched. Everything here is pure text handling, tested on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import iso
from slurm_idle.model import Phase, SlurmNode
from slurm_idle.powersave import powered_only

#: Phases that are written into a drained node's Reason.
DRAINED_PHASES = frozenset(
    {Phase.SERVING, Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING, Phase.STARTING}
)

#: Every allowed phase change, with why it exists. `apply` refuses anything else.
TRANSITIONS: dict[tuple[Phase, Phase], str] = {
    (Phase.SERVING, Phase.RETIRING): "load stayed low: let in-flight requests finish before the engine stops",
    (Phase.RETIRING, Phase.LENDING): "no request in flight (or drain timeout): stop or sleep the engine",
    (Phase.RETIRING, Phase.SERVING): "load rose again before the engine stopped: keep serving",
    (Phase.LENDING, Phase.LENT): "engine stopped: RESUME the node into the idle partition",
    (Phase.LENDING, Phase.STARTING): "load rose while the engine was stopping: bring it straight back",
    (Phase.LENT, Phase.RECLAIMING): "load rises or forecast ramp: DRAIN and requeue the idle jobs",
    (Phase.RECLAIMING, Phase.STARTING): "node empty: start or wake the engine",
    (Phase.STARTING, Phase.SERVING): "engine healthy and awake: serving again",
    (Phase.UNKNOWN, Phase.RECLAIMING): "unmanaged pool node: adopt it into serving (service first)",
}


class IllegalTransition(SlurmIdleError):
    """A phase change that is not in TRANSITIONS."""


def check_transition(from_phase: Phase, to_phase: Phase) -> str:
    """Return why the edge exists, or raise IllegalTransition."""
    try:
        return TRANSITIONS[(from_phase, to_phase)]
    except KeyError:
        raise IllegalTransition(
            f"transition {from_phase.value} -> {to_phase.value} is not allowed"
        ) from None


def next_phase(phase: Phase) -> Phase | None:
    """The forward step of a transitional phase (CONTINUE), None for a settled one."""
    return {
        Phase.RETIRING: Phase.LENDING,
        Phase.LENDING: Phase.LENT,
        Phase.RECLAIMING: Phase.STARTING,
        Phase.STARTING: Phase.SERVING,
    }.get(phase)


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


def derive_phase(node: SlurmNode, tag: str) -> PhaseInfo:
    """Read our phase back from what Slurm shows; never claim a node an admin holds.

    Power saving: a node Slurm powered down (or is powering down or up) carries no Reason of
    its own, so its power flags alone do not make it an admin's. A lent node stays LENT
    whatever its power state (its Comment says so; reclaim powers it up), and a node we are
    reclaiming stays RECLAIMING while it powers up. A powered-off node in any other phase of
    ours has no engine to serve from: UNKNOWN, as a dead node with our Reason.
    """
    reason = node.reason.strip()
    powered = powered_only(node)
    down = node.down and not powered
    if node.drained or down:
        if not is_ours(reason, tag):
            return PhaseInfo(Phase.ADMIN)
        word = reason[len(tag) + 1 :].split(" ", 1)[0]
        pinned = " pinned" in reason
        since = _parse_since(reason)
        if down:
            # Our reason on a dead node: we cannot act on it until it answers again.
            return PhaseInfo(Phase.UNKNOWN, since, pinned)
        try:
            phase = Phase(word)
        except ValueError:
            return PhaseInfo(Phase.UNKNOWN, since, pinned)
        if phase not in DRAINED_PHASES or (powered and phase is not Phase.RECLAIMING):
            return PhaseInfo(Phase.UNKNOWN, since, pinned)
        return PhaseInfo(phase, since, pinned)
    # A lend keeps an admin's Comment after ours (`<ours> | <theirs>`): read only our part, so
    # their text can never look like our "pinned" or "since=".
    comment = node.comment.strip().split(COMMENT_SEP, 1)[0]
    if is_ours(comment, tag) and comment[len(tag) + 1 :].startswith("lent"):
        return PhaseInfo(Phase.LENT, _parse_since(comment), " pinned" in comment)
    return PhaseInfo(Phase.UNKNOWN)
