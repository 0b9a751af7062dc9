"""Pure readers of Slurm's scalar values (numbers that may be `{set, infinite, number}` objects,
timestamps, texts with Slurm's empty markers, versions) and of its GRES/TRES strings, for the
node, job and accounting parsers (parse.py) of both JSON shapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from slurm_idle.errors import SlurmIdleError

_EMPTY = {"", "(null)", "N/A", "none", "None", "None assigned"}


class SlurmJsonError(SlurmIdleError, ValueError):
    """The document is not Slurm JSON of a shape we know."""


def number(value: Any) -> float | None:
    """A Slurm number: plain, or `{set, infinite, number}` (None when unset or infinite)."""
    if type(value) is int:  # the common case first (bool is a subclass, not this type)
        return float(value)
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        return number(value.get("number"))
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def timestamp(value: Any) -> float | None:
    """A unix time, None when unset or 0 (Slurm's "never")."""
    ts = number(value)
    return ts if ts else None


def text(value: Any) -> str:
    """A Slurm string: plain, or an object with a `description` (24.11 sinfo reasons)."""
    if type(value) is str:  # the common case first
        return value
    if value is None:
        return ""
    if isinstance(value, Mapping):
        return text(value.get("description", ""))
    return str(value)


def meta_release(doc: Mapping[str, Any]) -> str | None:
    """The Slurm release a JSON document was made by (`meta.Slurm` in 22.05, `meta.slurm` later)."""
    meta = doc.get("meta") or {}
    slurm = meta.get("Slurm") or meta.get("slurm") or {}
    release = slurm.get("release")
    if release:
        return str(release)
    version = slurm.get("version") or {}
    if "major" in version:
        return f"{int(version['major'])}.{int(version['minor']):02d}.{int(version.get('micro', 0))}"
    return None


def parse_version_output(output: str) -> str:
    """`sinfo --version` ("slurm 22.05.8", "slurm-wlm 24.11.5") -> "22.05.8"."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", output)
    if not match:
        raise SlurmJsonError(f"cannot read a Slurm version from {output.strip()!r}")
    major, minor, micro = match.groups()
    return f"{int(major)}.{int(minor):02d}.{int(micro or 0)}"


def major_minor(version: str) -> tuple[int, int]:
    """ "24.11.5" -> (24, 11)."""
    parts = re.findall(r"\d+", version)
    if len(parts) < 2:
        raise SlurmJsonError(f"not a Slurm version: {version!r}")
    return int(parts[0]), int(parts[1])


# --- GRES / TRES strings -------------------------------------------------------------------


def _split_outside_parens(s: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def gres_count(gres: Any, name: str = "gpu") -> int:
    """Count of one GRES in a node/job GRES string.

    Handles `gpu:4`, `gpu:tesla:4(S:0)`, `gpu:2(IDX:0-1)`, `gpu:(null):0(IDX:N/A)`,
    `gpu` (one), lists of several types (summed) and other GRES (ignored).
    """
    return _gres_count_text(text(gres), name)


@lru_cache(maxsize=1024)  # a fleet repeats a handful of GRES strings over thousands of records
def _gres_count_text(gres: str, name: str) -> int:
    total = 0
    for item in _split_outside_parens(gres):
        if item in _EMPTY:
            continue
        fields = re.sub(r"\([^()]*\)$", "", item).split(":")
        if fields[0].strip() != name:
            continue
        last = fields[-1].strip()
        # "gpu" and "gpu:tesla" mean one; "gpu:(null):0" and "gpu:tesla:4" carry a count.
        count = int(last) if len(fields) > 1 and last.isdigit() else int(len(fields) <= 2)
        total += count
    return total


def gres_list_count(details: Any, name: str = "gpu") -> int:
    """Sum of a GRES over a per-node list such as a job's `gres_detail`."""
    if isinstance(details, str):
        return gres_count(details, name)
    return sum(gres_count(d, name) for d in details or ())


def gres_indexes(detail: Any, name: str = "gpu") -> tuple[int, ...]:
    """The indexes of one GRES in one node's allocation detail: `gpu:4(IDX:0-3)` -> (0, 1, 2,
    3), `gpu:a100:2(IDX:1,5)` -> (1, 5), `gpu:(null):0(IDX:N/A)` and anything else -> ()."""
    out: list[int] = []
    for item in _split_outside_parens(text(detail)):
        m = re.fullmatch(r"([^:(]+)(?::[^()]*)?\(IDX:([0-9,-]+)\)", item)
        if m is None or m.group(1).strip() != name:
            continue
        for part in m.group(2).split(","):
            first, _, last = part.partition("-")
            if first.isdigit() and (not last or last.isdigit()):
                out += range(int(first), int(last or first) + 1)
    return tuple(out)


def tres_count(tres: Any, name: str = "gpu") -> int:
    """Count of `gres/<name>` in a TRES string: `gres/gpu:2`, `gres:gpu:2`, `gres/gpu=4`,
    `gres/gpu:a100=4`, `gres:gpu:a100:2` (typed entries count only when no untyped total is
    given, since Slurm lists both the total and its typed parts)."""
    return _tres_count_text(text(tres), name)


@lru_cache(maxsize=1024)
def _tres_count_text(tres: str, name: str) -> int:
    untyped: int | None = None
    typed = 0
    for item in _split_outside_parens(tres):
        if not item.startswith(("gres/", "gres:")):
            continue
        body = item[5:]
        if "=" in body:
            left, _, right = body.partition("=")
            fields, count = left.split(":"), int(right) if right.isdigit() else 0
        else:
            fields = body.split(":")
            if len(fields) > 1 and fields[-1].isdigit():
                count, fields = int(fields[-1]), fields[:-1]
            else:
                count = 1
        if fields[0] != name:
            continue
        if len(fields) == 1:
            untyped = (untyped or 0) + count
        else:
            typed += count
    return untyped if untyped is not None else typed
