"""Slurm hostlist expressions (`gpu[1-4,7]`, `a[01-03]b`) expanded to node names.

Pure text handling, kept apart from anything that runs commands.
"""

from __future__ import annotations

import re

_BRACKET = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")


def _split_top_level(expr: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if current:
        parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(expr: str) -> list[str]:
    match = _BRACKET.match(expr)
    if not match:
        return [expr]
    prefix, ranges, suffix = match.groups()
    names: list[str] = []
    for item in ranges.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                names.append(f"{prefix}{i:0{width}d}")
        else:
            names.append(f"{prefix}{item}")
    return [full for name in names for full in _expand_one(name + suffix)]


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression into the list of node names, in order."""
    result: list[str] = []
    for part in _split_top_level(expr):
        result.extend(_expand_one(part))
    return result
