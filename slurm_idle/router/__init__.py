"""The request router in front of the replicas: told first when a replica leaves, last when
it comes back (issue 14).

One small protocol per seam: `Router` (one router), `PoolRouters` (the routers of a pool as
the core calls them, `router.sync.RouterSet`); one module per kind (`haproxy`, `file`, `command`, `none`). Each adapter
takes a `RouterTarget` (one replica) and answers `state()` from the router itself, so a tick
reconciles what the router really does with the phases in Slurm instead of assuming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from slurm_idle.config import Config, RouterConfig
from slurm_idle.errors import ConfigError

if TYPE_CHECKING:
    from slurm_idle.model import Observation

#: What `state()` says of a replica: taking new requests, held out, not known to the router,
#: or the router cannot tell (none, a command router without `state_command`, an error).
IN, OUT, MISSING, UNKNOWN = "in", "out", "missing", "unknown"


@dataclass(frozen=True)
class RouterTarget:
    """One replica as a router sees it: `name` is the replica's (the node's for a whole-node
    replica, `node:port` for one of several on a node), `node` its head, `index` its place
    among the replicas headed there (`{index}`: `server: "{node}-{index}"` names both
    replicas of an 8-GPU node apart)."""

    name: str
    model: str
    url: str
    node: str
    port: int
    index: int = 0
    # A replica job (placement jobs): where it runs changes with each job, so a router that
    # keeps addresses (haproxy) is given this one on every add.
    moves: bool = False

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or self.node

    def fields(self) -> dict[str, str]:
        """The placeholders of every router template."""
        return {"name": self.name, "model": self.model, "url": self.url, "node": self.node,
                "host": self.host, "port": str(self.port), "index": str(self.index)}


def target_for(config: Config, key: str) -> RouterTarget:
    """The router target of a replica, by its name, or of the first replica headed on a node
    (by node name: a whole-node replica's name is its node's)."""
    found = next(((m, r) for m in config.models for r in m.replicas if r.name == key), None)
    if found is None:
        model, replica = config.model_of_node(key), config.replica(key)
        if model is None or replica is None:
            raise ConfigError(f"{key} is not a pool node or replica in the config")
        found = (model, replica)
    model, replica = found
    parts = urlsplit(replica.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return RouterTarget(name=replica.name or replica.node, model=model.name, url=replica.url,
                        node=replica.node, port=port, index=replica.index)


def targets_headed(config: Config, node: str) -> list[RouterTarget]:
    """The router targets of every replica headed on `node` (none for a node a replica only
    spans: it has no endpoint of its own)."""
    return [target_for(config, r.name) for m in config.models for r in m.replicas if r.node == node]


def all_targets(config: Config) -> list[RouterTarget]:
    return [target_for(config, r.name) for m in config.models for r in m.replicas]


class Router(Protocol):
    """Tell the router a replica leaves or joins; read back what it does. `remove` and `add`
    are idempotent and raise RouterError when the router could not be told."""

    kind: str

    def remove(self, target: RouterTarget) -> None: ...

    def add(self, target: RouterTarget) -> None: ...

    def state(self, targets: Sequence[RouterTarget]) -> dict[str, str]: ...


@runtime_checkable
class PoolRouters(Protocol):
    """The routers of a pool as the tick and the drivers use them (`router.sync.RouterSet`;
    the fake: `slurm_idle.testing.fake_router.FakeRouterSet`). A replica is named by its
    replica name (a node: its first replica). `remove`, `add`, `call_target`, `warm_up` and
    `warm_up_target` raise RouterError when the router could not be told; `reconcile` makes
    every router match the observed phases and returns what it changed; `states` reads what the
    routers do now (`unknown` where they cannot tell); `take_errors` counts the failed calls
    since it was last asked."""

    def remove(self, replica: str, reason: str) -> None: ...

    def add(self, replica: str, reason: str) -> None: ...

    def warm_up(self, replica: str) -> None: ...

    def warm_up_target(self, target: RouterTarget) -> None: ...

    def call_target(self, op: str, target: RouterTarget, reason: str) -> None: ...

    def states(self, keys: Sequence[str], extra: Sequence[RouterTarget] = ()) -> dict[str, str]: ...

    def reconcile(self, obs: Observation) -> list[dict[str, Any]]: ...

    def take_errors(self) -> int: ...


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
           "make_router", "target_for", "targets_headed"]
