"""`router: file`: the serving set written to a file the router reads, then `reload_command`.

Covers an nginx upstream include (`format: template` + `nginx -s reload`, see
etc/router/), the vLLM production-stack router's dynamic config, and static-file service
discovery (`format: json|yaml`). The file is replaced atomically (temp file, fsync, rename),
so the router never reads half of it. What the router was last told successfully is kept
beside it (`PATH.slurm-idle.json`), written only after the reload worked: a failed reload puts
the previous file back and leaves the recorded state as it was, so the next tick sees the
difference and tries again.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from slurm_idle.agent_metrics import atomic_write
from slurm_idle.commands import CommandRunner, SubprocessRunner
from slurm_idle.config import RouterConfig
from slurm_idle.errors import CommandError, RouterError
from slurm_idle.router import IN, MISSING, OUT, RouterTarget, fill

#: One lock per file: the agent drives several nodes at once, each a read-modify-write.
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock(path: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(path, threading.Lock())


def render(config: RouterConfig, entries: Sequence[dict[str, str]]) -> str:
    """The file's text for a serving set (pure). Entries are sorted by name: the same set
    always gives the same bytes, and an unchanged file needs no reload."""
    rows = sorted(entries, key=lambda e: e["name"])
    if config.format == "json":
        return json.dumps({"replicas": rows}, indent=2) + "\n"
    if config.format == "yaml":
        return str(yaml.safe_dump({"replicas": rows}, sort_keys=False))
    targets = [RouterTarget(e["name"], e["model"], e["url"], e["node"], int(e["port"])) for e in rows]
    return config.header + "".join(fill(config.line, t) for t in targets) + config.footer


class FileRouter:
    kind = "file"

    def __init__(self, config: RouterConfig, runner: CommandRunner | None = None,
                 before_replace: Callable[[str], None] | None = None) -> None:
        assert config.path is not None  # the config validator requires it
        self.config = config
        # Called with the complete temp file just before the final rename (tests look at it).
        self.before_replace = before_replace
        self.path = Path(config.path)
        self.state_path = self.path.with_name(self.path.name + ".slurm-idle.json")
        self.runner = runner or SubprocessRunner()

    def _recorded(self) -> dict[str, dict[str, str]]:
        try:
            data: Any = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise RouterError(f"router file state {self.state_path}: {exc}") from None
        rows = data.get("replicas", []) if isinstance(data, dict) else []
        return {str(r["name"]): {k: str(v) for k, v in r.items()} for r in rows
                if isinstance(r, dict) and "name" in r}

    def _write(self, entries: dict[str, dict[str, str]]) -> None:
        text = render(self.config, list(entries.values()))
        try:
            old: str | None = self.path.read_text()
        except FileNotFoundError:
            old = None
        except OSError as exc:
            raise RouterError(f"router file {self.path}: {exc.strerror}") from None
        if old != text:
            try:
                atomic_write(self.path, text, before_replace=self.before_replace)
            except OSError as exc:
                raise RouterError(f"router file {self.path}: {exc.strerror or exc}") from None
            try:
                self._reload()
            except RouterError:
                if old is not None:
                    atomic_write(self.path, old, before_replace=self.before_replace)  # the old set still runs
                raise
        state = {"replicas": sorted(entries.values(), key=lambda e: e["name"])}
        atomic_write(self.state_path, json.dumps(state, indent=2) + "\n")

    def _reload(self) -> None:
        if not self.config.reload_command:
            return
        try:
            self.runner.run(["sh", "-c", self.config.reload_command], timeout=self.config.timeout_s)
        except CommandError as exc:
            raise RouterError(f"router reload: {exc}") from None

    def remove(self, target: RouterTarget) -> None:
        with _lock(str(self.path)):
            entries = self._recorded()
            entries.pop(target.name, None)
            self._write(entries)

    def add(self, target: RouterTarget) -> None:
        with _lock(str(self.path)):
            entries = self._recorded()
            entries[target.name] = target.fields()
            self._write(entries)

    def state(self, targets: Sequence[RouterTarget]) -> dict[str, str]:
        recorded = self._recorded()
        if not recorded and not self.path.exists():
            return {t.name: MISSING for t in targets}
        return {t.name: IN if t.name in recorded else OUT for t in targets}
