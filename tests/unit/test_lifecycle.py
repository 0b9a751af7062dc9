"""Phases are written into and read back from Slurm exactly; the edge table is enforced."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_idle.lifecycle import (
    DRAINED_PHASES,
    IllegalTransition,
    allowed,
    check_transition,
    derive_phase,
    format_lent_comment,
    format_reason,
    next_phase,
)
from slurm_idle.model import Phase, SlurmNode

TAG = "slurm-idle"
T0 = 1_796_205_600.0  # 2026-12-02T10:00:00Z


def drained(reason: str, state: str = "idle") -> SlurmNode:
    return SlurmNode(name="gpu1", state=state, flags=frozenset({"DRAIN"}), reason=reason)


@pytest.mark.parametrize("phase", sorted(DRAINED_PHASES))
@pytest.mark.parametrize("pinned", [False, True])
def test_reason_round_trips(phase: Phase, pinned: bool) -> None:
    """A Reason we write reads back as the same phase, start time and pin."""
    info = derive_phase(drained(format_reason(TAG, phase, T0, pinned)), TAG)
    assert (info.phase, info.since, info.pinned) == (phase, T0, pinned)


def test_admin_reason_is_admin() -> None:
    """A drained node whose Reason lacks our tag belongs to the admin."""
    assert derive_phase(drained("admin: disk check"), TAG).phase is Phase.ADMIN


def test_down_node_without_tag_is_admin_and_with_tag_unknown() -> None:
    """DOWN without our tag is the admin's; DOWN with our tag is unknown (we can't act)."""
    down = SlurmNode(name="gpu1", state="down", reason="Not responding")
    assert derive_phase(down, TAG).phase is Phase.ADMIN
    ours = SlurmNode(name="gpu1", state="down", reason=format_reason(TAG, Phase.SERVING, T0))
    assert derive_phase(ours, TAG).phase is Phase.UNKNOWN


def test_lent_comment_makes_lent_and_plain_idle_unknown() -> None:
    """An undrained node is lent only when our comment says so; otherwise never adopted."""
    lent = SlurmNode(name="gpu1", state="mixed", comment=format_lent_comment(TAG, T0))
    info = derive_phase(lent, TAG)
    assert (info.phase, info.since) == (Phase.LENT, T0)
    assert derive_phase(SlurmNode(name="gpu1", state="idle"), TAG).phase is Phase.UNKNOWN


def test_other_tag_is_not_ours() -> None:
    """A Reason with a different tag prefix is not ours."""
    assert derive_phase(drained("slurm-idle-other:serving"), TAG).phase is Phase.ADMIN


def test_illegal_transition_refused() -> None:
    """The single transition check refuses edges outside the table."""
    with pytest.raises(IllegalTransition):
        check_transition(Phase.LENT, Phase.SERVING)
    with pytest.raises(IllegalTransition):
        check_transition(Phase.ADMIN, Phase.RECLAIMING)


def test_forward_chain_reaches_settled_phases() -> None:
    """Following CONTINUE from any transitional phase ends in LENT or SERVING via allowed edges."""
    for start in (Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING, Phase.STARTING):
        phase = start
        while (nxt := next_phase(phase)) is not None:
            assert allowed(phase, nxt)
            phase = nxt
        assert phase in {Phase.LENT, Phase.SERVING}


@given(st.text(max_size=60))
def test_any_foreign_reason_is_never_ours(reason: str) -> None:
    """Whatever an admin writes without our prefix, the node stays theirs."""
    if reason.strip().startswith(f"{TAG}:"):
        return
    assert derive_phase(drained(reason), TAG).phase is Phase.ADMIN


def test_not_responding_right_after_resume_is_still_lent() -> None:
    """Slurm flags a just-RESUMEd node NOT_RESPONDING for a moment: it is lent, not the admin's."""
    node = SlurmNode(name="gpu1", state="idle", flags=frozenset({"NOT_RESPONDING"}),
                     comment=format_lent_comment(TAG, T0))
    assert derive_phase(node, TAG).phase is Phase.LENT


def test_admin_text_kept_after_our_lent_comment_is_not_read_as_ours() -> None:
    """An admin's Comment kept after ours ('<ours> | <theirs>') cannot pin the node."""
    from slurm_idle.lifecycle import derive_phase
    from slurm_idle.model import SlurmNode

    node = SlurmNode(name="gpu1", state="IDLE", flags=frozenset(), reason="",
                     comment="slurm-idle:lent since=2026-12-02T10:00:00Z | psu pinned by vendor",
                     gpus_total=4, gpus_used=0, partitions=("idle",))
    info = derive_phase(node, "slurm-idle")
    assert info.phase.value == "lent" and info.pinned is False
