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
