"""A router in memory that conforms to `slurm_idle.router.Router`, for tests of the lifecycle
and the reconcile: it records every call (in a log it may share with a FakeSlurm, so a test can
check the order of router calls and Slurm writes) and fails on demand. `FakeRouterSet` stands
for a pool's routers (`slurm_idle.router.PoolRouters`) where a test needs no router at all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slurm_idle.errors import RouterError
from slurm_idle.router import IN, MISSING, OUT, UNKNOWN, RouterTarget

if TYPE_CHECKING:
    from slurm_idle.model import Observation


@dataclass
class FakeRouter:
    kind: str = "fake"
    members: dict[str, str] = field(default_factory=dict)  # name -> in | out
    log: list[tuple[str, ...]] = field(default_factory=list)
    fail_on: set[str] = field(default_factory=set)  # "remove", "add", "state"
    # The servers the router is configured with: a call naming another fails, and its state
    # reads missing, as with HAProxy (None: every name is accepted).
    servers: set[str] | None = None

    def _call(self, op: str, name: str = "") -> None:
        self.log.append(("router_" + op, name) if name else ("router_" + op,))
        if op in self.fail_on:
            raise RouterError(f"{op} failed (injected)")
        if name and self.servers is not None and name not in self.servers:
            raise RouterError(f"fake router: no server {name!r}")

    def remove(self, target: RouterTarget) -> None:
        self._call("remove", target.name)
        self.members[target.name] = OUT

    def add(self, target: RouterTarget) -> None:
        self._call("add", target.name)
        self.members[target.name] = IN

    def state(self, targets: Sequence[RouterTarget]) -> dict[str, str]:
        self._call("state")
        known = self.servers
        return {t.name: MISSING if known is not None and t.name not in known
                else self.members.get(t.name, MISSING if known is None else IN)
                for t in targets}


@dataclass
class FakeRouterSet:
    """A pool's routers in memory: records each call as (op, replica or target name, reason),
    fails the ops named in `fail_on` with RouterError, and reconciles nothing."""

    log: list[tuple[str, ...]] = field(default_factory=list)
    fail_on: set[str] = field(default_factory=set)  # "remove", "add", "warm_up"
    errors: int = 0

    def _call(self, op: str, *args: str) -> None:
        self.log.append((op, *args))
        if op in self.fail_on:
            self.errors += 1
            raise RouterError(f"router {op} failed (injected)")

    def remove(self, replica: str, reason: str) -> None:
        self._call("remove", replica, reason)

    def add(self, replica: str, reason: str) -> None:
        self._call("add", replica, reason)

    def warm_up(self, replica: str) -> None:
        self._call("warm_up", replica)

    def warm_up_target(self, target: RouterTarget) -> None:
        self._call("warm_up", target.name)

    def call_target(self, op: str, target: RouterTarget, reason: str) -> None:
        self._call(op, target.name, reason)

    def states(self, keys: Sequence[str], extra: Sequence[RouterTarget] = ()) -> dict[str, str]:
        """Every replica and target `unknown`: this fake routes nothing."""
        self.log.append(("states",))
        return dict.fromkeys([*keys, *(t.name for t in extra)], UNKNOWN)

    def reconcile(self, obs: Observation) -> list[dict[str, Any]]:
        self.log.append(("reconcile",))
        return []

    def take_errors(self) -> int:
        n, self.errors = self.errors, 0
        return n
