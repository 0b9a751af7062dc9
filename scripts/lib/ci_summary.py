"""The last screen of `.ci/run`: per lane its exit code, time and counts, then every failed or
errored test of every lane with its first error line, in at most ~30 lines.

Why: a red run must say why on the screen a reader sees last. Before this, a failure of the
first lane sat hundreds of lines above the end, under the whole second lane's log (issue 36).

Usage (stdlib only: it runs on the host's python3 before or without the venv):
    python3 scripts/lib/ci_summary.py NAME:RC:SECONDS:JUNIT_XML:LOG [...]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

MAX_FAILURES = 10  # listed in full; more are counted (their ids are in the logs)
LINE = 150  # characters of an error line


@dataclass
class Lane:
    name: str
    rc: int
    seconds: int
    junit: Path
    log: Path
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[str, str, str]] = field(default_factory=list)  # kind, test id, error
    read: bool = False


def test_id(classname: str, name: str) -> str:
    """pytest's id from junit's dotted classname: the longest prefix that is a test file."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if Path(path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            line = " ".join(line.split())
            return line if len(line) <= LINE else line[: LINE - 3] + "..."
    return "(no message)"


def read_junit(lane: Lane) -> None:
    try:
        root = ET.parse(lane.junit).getroot()
    except (OSError, ET.ParseError):
        return
    lane.read = True
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "FAILED" if child.tag == "failure" else "ERROR"
                message = child.get("message") or child.text
                lane.failures.append((kind, test_id(case.get("classname", ""),
                                                    case.get("name", "")), first_line(message)))
                outcome = "failed" if child.tag == "failure" else "errors"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        counts[outcome] += 1
    lane.counts = counts


def log_tail(path: Path, n: int = 3) -> list[str]:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ["(no log)"]
    return [first_line(ln) for ln in lines[-n:]]


def summary(lanes: list[Lane]) -> list[str]:
    out = ["ci: ==================== summary ===================="]
    for lane in lanes:
        read_junit(lane)
        counts = ", ".join(f"{v} {k}" for k, v in lane.counts.items() if v) if lane.read \
            else "no test report (the lane ended before or outside pytest)"
        out.append(f"ci: {lane.name:<20} exit {lane.rc:<3} {lane.seconds:>5} s  {counts}")
    listed = 0
    for lane in lanes:
        if lane.rc != 0 and not lane.failures:
            out.append(f"ci: {lane.name} failed without a failed test; its log ends:")
            out += [f"ci:     {ln}" for ln in log_tail(lane.log)]
        for kind, tid, error in lane.failures:
            listed += 1
            if listed > MAX_FAILURES:
                continue
            out.append(f"ci: {kind} [{lane.name}] {tid}")
            out.append(f"ci:     {error}")
    if listed > MAX_FAILURES:
        out.append(f"ci: ... and {listed - MAX_FAILURES} more failed or errored tests (see the logs)")
    out.append("ci: full logs: " + " ".join(str(lane.log) for lane in lanes))
    red = [lane.name for lane in lanes if lane.rc != 0]
    out.append(f"ci: RED: {', '.join(red)}" if red else "ci: GREEN: every lane passed")
    return out


def parse(arg: str) -> Lane:
    name, rc, seconds, junit, log = arg.split(":", 4)
    return Lane(name, int(rc), int(seconds), Path(junit), Path(log))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(summary([parse(a) for a in argv])), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
