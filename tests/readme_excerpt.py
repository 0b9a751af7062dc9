"""The README's quote of what `scripts/demo` prints, and how a run's output is matched against it.

The README shows lines of a real demo run between `<!-- demo-excerpt -->` and
`<!-- /demo-excerpt -->`. A run's times, loads and node choices differ from run to run, so the
quote keeps only what every run prints: the `[  12.3s]` time prefix is ignored on both sides,
and `...` in a quoted line stands for any text (a node name, a number, a reason's variable
tail). The e2e story test checks that every quoted line appears in the story's output, in
order; the unit tests check this matcher and the README's links and wording.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- demo-excerpt -->", "<!-- /demo-excerpt -->"
TIME_PREFIX = re.compile(r"^\s*\[\s*\d+(?:\.\d+)?s\]")
WILDCARD = "..."


def excerpt(readme: str) -> list[str]:
    """The quoted lines between the markers, without the code fence and blank lines."""
    if START not in readme or END not in readme:
        raise ValueError(f"README has no {START} ... {END} block")
    block = readme.split(START, 1)[1].split(END, 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("```")]


def strip_time(line: str) -> str:
    """The line without its `[  12.3s]` prefix and surrounding blanks."""
    return TIME_PREFIX.sub("", line).strip()


def line_pattern(quoted: str) -> re.Pattern[str]:
    """A quoted line as a pattern: literal text, `...` for any text, the whole line."""
    parts = strip_time(quoted).split(WILDCARD)
    return re.compile(".*".join(re.escape(part) for part in parts), re.DOTALL)


def missing_lines(quoted: list[str], output: list[str]) -> list[str]:
    """The quoted lines not found in the output in order (empty when all are).

    Each quoted line takes the first output line after the previous match that fits it; the
    earliest fit never loses a later match, so this finds an in-order match whenever one exists.
    """
    lines = [strip_time(line) for line in output]
    at = 0
    for i, quote in enumerate(quoted):
        pattern = line_pattern(quote)
        hit = next((j for j in range(at, len(lines)) if pattern.fullmatch(lines[j])), None)
        if hit is None:
            return quoted[i:]
        at = hit + 1
    return []
