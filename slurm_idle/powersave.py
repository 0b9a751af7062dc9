"""Slurm power saving as slurm-idle sees it: which node flags mean "powered off", and which
pool nodes Slurm may suspend although they serve.

With `SuspendProgram` set, Slurm suspends nodes idle for `SuspendTime`. A lent node that Slurm
powered down is still ours (its Comment says so): reclaim powers it up first
(`scontrol update nodename=X state=POWER_UP`). A *serving* node is DRAINed and, to Slurm, idle:
unless the site excludes it (`SuspendExcNodes`, `SuspendExcParts`, or `SuspendExcStates=DRAIN`
from 23.02), Slurm may power off the machine vLLM serves from. Pure functions over the parsed
`scontrol show config` and the nodes; `doctor` and `status` report what they find.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from slurm_idle.hostlist import expand_hostlist
from slurm_idle.model import SlurmNode
from slurm_idle.slurm.text import is_unset, parse_duration_s

#: Flags of a node that is (going) off or on its way back (22.05 `state_flags`, 24.11 `state`).
#: POWER_DOWN / POWER_UP are the requested-but-not-started forms.
POWER_FLAGS = frozenset(
    {"POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "POWER_DOWN", "POWER_UP"}
)


def power_flags(node: SlurmNode) -> frozenset[str]:
    """The node's power-saving flags (empty for a node that is simply on)."""
    return node.flags & POWER_FLAGS


def powered_only(node: SlurmNode) -> bool:
    """Off, going off or coming back by power saving, and nothing worse: no DOWN/FAIL base
    state or flag (a node whose power-up timed out is DOWN with Slurm's own Reason)."""
    return bool(power_flags(node)) and node.state not in {"down", "fail", "future", "unknown"} \
        and not node.flags & {"DOWN", "FAIL"}


def needs_power_up(node: SlurmNode) -> bool:
    """Off or going off, and no power-up asked for or under way yet."""
    flags = power_flags(node)
    return bool(flags) and not flags & {"POWERING_UP", "POWER_UP"}


def power_saving_enabled(cfg: Mapping[str, str]) -> bool:
    """Slurm can power nodes down: a SuspendProgram is configured."""
    return not is_unset(cfg.get("SuspendProgram"))


def automatic_suspend(cfg: Mapping[str, str]) -> bool:
    """Idle nodes are suspended on their own (a finite SuspendTime), not only on request."""
    return power_saving_enabled(cfg) and parse_duration_s(cfg.get("SuspendTime")) is not None


def _csv(value: str | None) -> list[str]:
    return [] if is_unset(value) else [v.strip() for v in (value or "").split(",") if v.strip()]


def excluded_nodes(cfg: Mapping[str, str]) -> tuple[frozenset[str], frozenset[str]]:
    """Nodes SuspendExcNodes always keeps up, and those it keeps up only in part (`gpu[1-8]:2`
    means any two of them, so none is certain)."""
    value = cfg.get("SuspendExcNodes")
    if is_unset(value):
        return frozenset(), frozenset()
    whole: set[str] = set()
    partial: set[str] = set()
    # Groups are separated by commas outside brackets; a `:N` count ends a group.
    depth, current, groups = 0, list[str](), list[str]()
    for ch in value or "":
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            groups.append("".join(current))
            current = []
        else:
            current.append(ch)
    groups.append("".join(current))
    for group in (g.strip() for g in groups if g.strip()):
        names, sep, count = group.partition(":")
        target = partial if sep and count.strip() else whole
        target.update(expand_hostlist(names))
    return frozenset(whole), frozenset(partial - whole)


def exclusion_warning(cfg: Mapping[str, str], serving: Iterable[SlurmNode]) -> str | None:
    """One line for `status` when Slurm may power down nodes that serve, else None."""
    gaps = unprotected(cfg, serving)
    if not gaps:
        return None
    return (f"Slurm power saving may suspend serving node(s) {', '.join(gaps)}: add them to "
            "SuspendExcNodes (or SuspendExcStates=DRAIN on 23.02+); see `slurm-idle doctor`")


def unprotected(cfg: Mapping[str, str], nodes: Iterable[SlurmNode]) -> list[str]:
    """Names of `nodes` (the drained, serving ones) that Slurm may power down: power saving
    is on and neither SuspendExcNodes, SuspendExcParts nor SuspendExcStates keeps them up.
    Our serving and transitional phases are all DRAINed, so `SuspendExcStates=DRAIN` covers
    them all (23.02+; 22.05 has no such key)."""
    if not power_saving_enabled(cfg):
        return []
    states = {s.upper() for s in _csv(cfg.get("SuspendExcStates"))}
    if "DRAIN" in states or "DRAINED" in states:
        return []
    whole, _partial = excluded_nodes(cfg)
    parts = set(_csv(cfg.get("SuspendExcParts")))
    return sorted(
        n.name for n in nodes if n.name not in whole and not parts.intersection(n.partitions)
    )
