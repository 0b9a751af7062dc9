"""Engine kind `command`: admin shell commands start and stop a replica (one run each, killed at
the caller's time left), with `{node}`, `{url}`, `{model}`, `{port}`, `{index}`, `{name}` filled,
and `{identity}`: the replica's secret served name (engine/identity.py), which a start command
that uses it hands to vLLM (`--served-model-name {model} {identity}`); the endpoint is then
ours only if its `/v1/models` lists that name too.
"""

from __future__ import annotations

import re
import shlex

from slurm_idle.commands import TIMEOUT_RC, CommandRunner, SubprocessRunner
from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine.identity import IdentityStore
from slurm_idle.engine.probe import (
    EngineDeadline,
    HttpProbe,
    UrllibClient,
    _HttpHealth,
    _limit,
)
from slurm_idle.errors import CommandError, EngineError
from slurm_idle.httpdeadline import HttpClient

_PLACEHOLDER = re.compile(r"\{(node|url|model|port|index|name|identity)\}")
#: The placeholder that gives the engine its identity name.
IDENTITY = "{identity}"


def format_command(
    template: str, node: str, url: str, model: str, port: int | None = None, index: int = 0,
    name: str = "", identity: str = "",
) -> str:
    """Fill `{node}`, `{url}`, `{model}`, `{port}`, `{index}`, `{name}`, `{identity}` (the
    replica's) with shell-quoted values; other braces stay as they are."""
    values = {"node": node, "url": url, "model": model, "port": "" if port is None else str(port),
              "index": str(index), "name": name or node, "identity": identity}
    return _PLACEHOLDER.sub(lambda m: shlex.quote(values[m.group(1)]), template)


class CommandEngine(_HttpHealth):
    """Admin-supplied shell commands start and stop the replica."""

    def __init__(
        self,
        config: EngineConfig,
        model: str = "",
        runner: CommandRunner | None = None,
        http: HttpClient | None = None,
        identities: IdentityStore | None = None,
    ) -> None:
        if not (config.start_command and config.stop_command):
            raise EngineError("engine kind 'command' needs start_command and stop_command")
        self.config = config
        self.model = model
        self.runner = runner or SubprocessRunner()
        self.probe = HttpProbe(http or UrllibClient(), config.http_timeout_s)
        # Only a start command that passes the name on makes an engine that can show it.
        self.identities = identities if IDENTITY in config.start_command else None

    def _shell(
        self, what: str, template: str, replica: ReplicaConfig, own_s: float, given_s: float | None,
        identity: str = "",
    ) -> None:
        command = format_command(template, replica.node, replica.url, self.model, replica.port,
                                 replica.index, replica.name, identity)
        limit, cut = _limit(own_s, given_s)
        try:
            self.runner.run(["sh", "-c", command], timeout=limit)
        except CommandError as exc:
            if cut and exc.rc == TIMEOUT_RC:
                # Killed at the caller's deadline: start/stop commands are idempotent, so the
                # next tick simply runs it again with a fresh budget.
                raise EngineDeadline(
                    f"{replica.node}: {what} command still running after {limit:g} s (the tick's "
                    "time left); killed it, the next tick runs it again"
                ) from None
            raise EngineError(f"{replica.node}: {exc}") from None

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        key = replica.name or replica.node
        if self.identities is not None:
            if self.identities.current(key) is None and self.health(replica).serving:
                # Serving under the model's name and never named by us: an engine started
                # before identities, met at the adoption of a running pool. It may be in the
                # router with clients on it: taken as it is, checked by the model's name until
                # its next stop, which names it (a restart here would cut those requests).
                return
            self.identities.issue(key)  # the name first: the health check below asks for it
        health = self.health(replica)
        if health.serving:
            return
        if self.identities is not None and health.up and self.identify(replica).ours is False:
            # Something answers but is proven not this replica's engine: ours started without
            # the name (before identities, or by hand; a start command is a no-op on a running
            # unit), or a squatter. Stop ours first (nothing to a squatter's process), so that
            # the start below runs it with the name.
            self.stop(replica, timeout_s)
        identity = self.identities.issue(key) if self.identities is not None else ""
        assert self.config.start_command
        self._shell("start", self.config.start_command, replica, self.config.start_timeout_s, timeout_s,
                    identity)

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        # Always run: an admin stop command is idempotent, and a hung server whose /health
        # no longer answers still has to be stopped (a down server has nothing to drain).
        assert self.config.stop_command
        self._shell("stop", self.config.stop_command, replica, self.config.stop_timeout_s + 30, timeout_s)
        if self.identities is not None:
            # The engine is gone: its name, which clients may have read through the router's
            # /v1/models, is never valid again; the next start gets a fresh one.
            self.identities.rotate(replica.name or replica.node)

    def released(self, replica: ReplicaConfig) -> bool:
        """The stop command's exit is the stop: once it returned, the replica is stopped."""
        return True
