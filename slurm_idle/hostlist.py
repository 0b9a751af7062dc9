"""Slurm hostlist expressions (`gpu[1-4,7]`, `a[01-03]b`) expanded to node names.

Pure text handling, kept apart from anything that runs commands.
"""

from __future__ import annotations

import re

_BRACKET = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")
#: No pool or job spans more nodes; `gpu[1-100000000]` must fail in microseconds, not allocate.
MAX_NAMES = 100_000


def _split_top_level(expr: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
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


def _count(expr: str) -> int:
    """How many names `expr` expands to, computed without expanding it."""
    match = _BRACKET.match(expr)
    if not match:
        return 1
    _, ranges, suffix = match.groups()
    total = 0
    for item in ranges.split(","):
        lo, _, hi = (x.strip() for x in item.partition("-"))
        if hi and lo.isdigit() and hi.isdigit() and len(lo) < 12 and len(hi) < 12:
            total += max(0, int(hi) - int(lo) + 1)
        elif hi:
            total += 1 if len(lo) < 12 and len(hi) < 12 else MAX_NAMES + 1
        else:
            total += 1
    return total * _count(suffix)


def _expand_one(expr: str) -> list[str]:
    if _count(expr) > MAX_NAMES:
        raise ValueError(
            f"hostlist {expr[:60]!r} names more than {MAX_NAMES} nodes: write the real range"
        )
    match = _BRACKET.match(expr)
    if not match:
        return [expr]
    prefix, ranges, suffix = match.groups()
    names: list[str] = []
    for item in ranges.split(","):
        if "-" in item:
            lo, hi = (x.strip() for x in item.split("-", 1))
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"malformed hostlist range [{item}]: want [low-high], e.g. [1-4]")
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                names.append(f"{prefix}{i:0{width}d}")
        else:
            names.append(f"{prefix}{item}")
    return [full for name in names for full in _expand_one(name + suffix)]


_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def expand_hostlist(expr: str, strict: bool = False) -> list[str]:
    """Expand a Slurm hostlist expression into the list of node names, in order.

    `strict` (the config's `nodes:`) raises ValueError on a malformed expression (unbalanced
    brackets, a range that is not low-high numbers, characters no node name has), so a typo
    fails `config check` instead of becoming a pool node Slurm has never heard of. What Slurm
    itself prints is expanded leniently.
    """
    if not strict:
        return [name for part in _split_top_level(expr) for name in _expand_one(part)]
    depth = 0
    for ch in expr:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"malformed hostlist {expr!r}: unbalanced or nested brackets")
    if depth:
        raise ValueError(f"malformed hostlist {expr!r}: unbalanced brackets")
    result: list[str] = []
    for part in _split_top_level(expr):
        result.extend(_expand_one(part))
        if len(result) > MAX_NAMES:
            raise ValueError(f"hostlist names more than {MAX_NAMES} nodes: write the real range")
    for name in result:
        if not _NAME.match(name):
            raise ValueError(f"malformed hostlist {expr!r}: {name!r} is not a node name")
    return result
