"""The request router in front of the replicas: told first when a replica leaves, last when
it comes back (issue 14).

One small protocol, one module per kind (`haproxy`, `file`, `command`, `none`). Each adapter
takes a `RouterTarget` (one replica) and answers `state()` from the router itself, so a tick
reconciles what the router really does with the phases in Slurm instead of assuming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from slurm_idle.config import Config, RouterConfig
from slurm_idle.errors import ConfigError

#: What `state()` says of a replica: taking new requests, held out, not known to the router,
#: or the router cannot tell (none, a command router without `state_command`, an error).
IN, OUT, MISSING, UNKNOWN = "in", "out", "missing", "unknown"


@dataclass(frozen=True)
class RouterTarget:
    """One replica as a router sees it. Maps onto the coming `Replica` (name, model, url,
    nodes): today one replica per node, so `name` is the node's name."""

    name: str
    model: str
    url: str
    node: str
    port: int

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or self.node

    def fields(self) -> dict[str, str]:
        """The placeholders of every router template."""
        return {"name": self.name, "model": self.model, "url": self.url, "node": self.node,
                "host": self.host, "port": str(self.port)}


def target_for(config: Config, node: str) -> RouterTarget:
    """The router target of a pool node (one replica per node, from today's config)."""
    model = config.model_of_node(node)
    replica = config.replica(node)
    if model is None or replica is None:
        raise ConfigError(f"{node} is not a pool node in the config")
    parts = urlsplit(replica.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return RouterTarget(name=node, model=model.name, url=replica.url, node=node, port=port)


def all_targets(config: Config) -> list[RouterTarget]:
    return [target_for(config, r.node) for m in config.models for r in m.replicas]


class Router(Protocol):
    """Tell the router a replica leaves or joins; read back what it does. `remove` and `add`
    are idempotent and raise RouterError when the router could not be told."""

    kind: str

    def remove(self, target: RouterTarget) -> None: ...

    def add(self, target: RouterTarget) -> None: ...

    def state(self, targets: Sequence[RouterTarget]) -> dict[str, str]: ...


def fill(template: str, target: RouterTarget) -> str:
    """A router template with the target's placeholders filled (other braces kept)."""
    out = template
    for key, value in target.fields().items():
        out = out.replace("{" + key + "}", value)
    return out


def make_router(config: RouterConfig, all_of: Sequence[RouterTarget] = ()) -> Router:
    """The adapter `config.kind` names. `all_of`: every target this router serves (the file
    kind writes the whole serving set, so it must know which entries are its own)."""
    if config.kind == "haproxy":
        from slurm_idle.router.haproxy import HaproxyRouter

        return HaproxyRouter(config)
    if config.kind == "file":
        from slurm_idle.router.file import FileRouter

        return FileRouter(config)
    if config.kind == "command":
        from slurm_idle.router.command import CommandRouter

        return CommandRouter(config)
    from slurm_idle.router.none import NoRouter

    return NoRouter()


__all__ = ["IN", "MISSING", "OUT", "UNKNOWN", "Router", "RouterTarget", "all_targets", "fill",
           "make_router", "target_for"]
