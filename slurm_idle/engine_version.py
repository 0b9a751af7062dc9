"""vLLM versions and the features slurm-idle relies on. Pure.

Two behaviours of a retiring replica depend on the server's version (checked in vLLM's own
history, see docs/vllm-versions.md):
- `POST /sleep?mode=wait` (let in-flight requests finish, then sleep) exists from vLLM 0.17
  (PR #34528 added the pause mode to sleep); older servers ignore `mode` and abort whatever is
  in flight, as `mode=abort`, the default, still does;
- `--shutdown-timeout N` (SIGTERM drains in-flight requests for up to N s) exists from 0.18
  (PR #34730, re-landed as #36666); older servers, and newer ones at its default 0, abort them.
When a replica's version lacks the feature its engine kind relies on, or cannot be read, the
driver drains it by in-flight count before it stops or sleeps the server
(`Engine.stop_drops_requests`, transitions.py), and
`status`/`doctor` say so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from slurm_idle.config import EngineConfig


@dataclass(frozen=True)
class Feature:
    """A vLLM behaviour slurm-idle uses, and the first release that has it."""

    name: str
    since: tuple[int, int]
    without: str  # what happens on an older server

    @property
    def since_text(self) -> str:
        return f"{self.since[0]}.{self.since[1]}"


SLEEP_MODE_WAIT = Feature(
    "/sleep?mode=wait", (0, 17),
    "older servers ignore mode and abort in-flight requests when they sleep")
SHUTDOWN_TIMEOUT = Feature(
    "--shutdown-timeout", (0, 18),
    "older servers abort in-flight requests on SIGTERM")


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    """ "0.17.1", "0.16.0rc2.dev45+g1234", "v0.18.0" -> (major, minor, micro); None if unreadable."""
    if not text:
        return None
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        return None
    major, minor, micro = match.groups()
    return int(major), int(minor), int(micro or 0)


def version_from_body(body: bytes) -> str | None:
    """The `version` of vLLM's `GET /version` answer (`{"version": "0.17.1"}`)."""
    try:
        doc = json.loads(body or b"null")
    except ValueError:
        return None
    value = doc.get("version") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value else None


def supports(version: str | None, feature: Feature) -> bool:
    """True only for a known version at or after the feature's release (unknown: no)."""
    parsed = parse_version(version)
    return parsed is not None and parsed[:2] >= feature.since


def relied_on(engine: EngineConfig) -> Feature:
    """The version-dependent feature a kind of engine control relies on to keep requests."""
    return SLEEP_MODE_WAIT if engine.kind == "http-sleep" else SHUTDOWN_TIMEOUT


def version_warning(version: str | None, engine: EngineConfig) -> str | None:
    """One line when the replica's vLLM lacks (or may lack) what its engine kind relies on."""
    feature = relied_on(engine)
    if supports(version, feature):
        return None
    seen = f"vLLM {version}" if version else "vLLM version unknown (no /version)"
    return (f"{seen}: {feature.name} needs vLLM >= {feature.since_text} ({feature.without}); "
            "slurm-idle drains by in-flight count before it stops the server; upgrade vLLM")
