"""The router as the agent sees it: one adapter per model's router config, the calls the
lifecycle makes (leave before RETIRING, join after STARTING), and the reconcile of each tick.

Each tick reads the router's state back and compares it with the phases in Slurm: a SERVING
replica must be in, a replica on its way out, lent or coming back must be out. Admin-held and
unknown nodes are not ours and are left as the router has them. A tick killed between a
router call and the phase write therefore leaves nothing wrong for longer than one tick.
Every call is journaled (`event: router`, for `explain`); failures are counted per tick for
the textfile metrics and never raise out of the reconcile.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from slurm_idle.config import Config, RouterConfig
from slurm_idle.errors import RouterError, SlurmIdleError
from slurm_idle.httpdeadline import DeadlineClient
from slurm_idle.journal import RouterOutcome, RouterRecord
from slurm_idle.logs import get_logger
from slurm_idle.model import JobReplica, Observation, Phase
from slurm_idle.router import (
    IN,
    MISSING,
    OUT,
    UNKNOWN,
    Router,
    RouterTarget,
    make_router,
    target_for,
    targets_headed,
)

log = get_logger(__name__)

#: Phases whose replica must be out of the router: it drains, stops, is lent or comes back.
OUT_PHASES = frozenset({Phase.RETIRING, Phase.LENDING, Phase.LENT, Phase.RECLAIMING,
                        Phase.HELD, Phase.STARTING})


def desired(phase: Phase) -> str | None:
    """Where the router should have a replica in `phase`; None: not ours to say."""
    if phase is Phase.SERVING:
        return IN
    return OUT if phase in OUT_PHASES else None


def job_target(r: JobReplica) -> RouterTarget:
    """A replica job as a router target: named `model#index`, `{index}` its replica index (two
    replica jobs on one node stay apart: haproxy's `server: "{model}-{index}"`), on its head
    node (url and node empty while it runs nowhere: routers know targets by name)."""
    return RouterTarget(name=r.name, model=r.model, url=r.url, node=r.nodes[0] if r.nodes else "",
                        port=r.port, index=r.index, moves=True)


Post = Callable[[str, bytes, float], int]
#: A warm-up answer is one token: a bigger body is cut here.
_WARM_UP_CLIENT = DeadlineClient(max_bytes=1024 * 1024)


def urllib_post(url: str, body: bytes, timeout_s: float) -> int:
    """POST a JSON body with the one HTTP client (httpdeadline: total deadline, bounded answer,
    no proxies: the replica is on the cluster network); the status, any status."""
    try:
        resp = _WARM_UP_CLIENT.request("POST", url, timeout_s, body=body,
                                       headers={"Content-Type": "application/json"})
    except OSError as exc:
        raise RouterError(f"warm-up request to {url}: {exc}") from None
    return resp.status


def warm_up(target: RouterTarget, prompt: str, timeout_s: float, post: Post = urllib_post) -> None:
    """One completion (max_tokens 1) straight to the replica: it must answer 200 before the
    router sends it clients (a sleeping or still-loading vLLM fails it)."""
    body = json.dumps({"model": target.model, "prompt": prompt, "max_tokens": 1}).encode()
    status = post(target.url.rstrip("/") + "/v1/completions", body, timeout_s)
    if status != 200:
        raise RouterError(f"{target.name}: warm-up request answered {status}")


@dataclass
class RouterSet:
    """The routers of a pool (one per distinct router config), and the journal of calls."""

    config: Config
    journal: Callable[[RouterRecord], None] = field(default=lambda record: None)
    make: Callable[[RouterConfig], Router] = make_router
    clock: Callable[[], float] = time.time
    post: Post = urllib_post

    def __post_init__(self) -> None:
        self._routers: dict[str, Router] = {}
        self._lock = threading.Lock()
        self.errors = 0  # failed router calls since the last take_errors()

    def router(self, model: str) -> Router:
        cfg = self.config.router_for(model)
        key = cfg.model_dump_json()
        with self._lock:
            if key not in self._routers:
                self._routers[key] = self.make(cfg)
            return self._routers[key]

    @property
    def active(self) -> bool:
        """False when every model's router is `none` (nothing to tell, nothing to read)."""
        return any(self.config.router_for(m.name).kind != "none" for m in self.config.models)

    def take_errors(self) -> int:
        with self._lock:
            n, self.errors = self.errors, 0
        return n

    def _call(self, op: str, key: str, reason: str) -> None:
        """`key`: a replica's name (a whole-node replica's is its node's), or a node's."""
        self.call_target(op, target_for(self.config, key), reason)

    def call_target(self, op: str, target: RouterTarget, reason: str) -> None:
        """`remove` or `add` one target (a replica job's, `placement: jobs`, is in no
        `replicas:` of the config); journaled; RouterError when the router could not be told."""
        router = self.router(target.model)
        if router.kind == "none":
            return
        started = self.clock()
        node = target.node
        record = RouterRecord(ts=started, node=node, model=target.model, router=router.kind,
                              call=op, reason=reason, outcome=RouterOutcome.OK,
                              # one of several replicas on the node
                              replica=target.name if target.name != node else None)
        try:
            getattr(router, op)(target)
        except SlurmIdleError as exc:
            with self._lock:
                self.errors += 1
            self.journal(replace(record, outcome=RouterOutcome.ERROR, error=str(exc)))
            log.warning("%s: router %s failed: %s", target.name, op, exc)
            raise RouterError(f"router {op} failed: {exc}") from None
        self.journal(replace(record, duration_s=self.clock() - started))
        log.info("%s: router %s (%s)", target.name, op, reason)

    def remove(self, replica: str, reason: str) -> None:
        """Take the replica (by name; a node: its first replica) out of its router;
        RouterError when it could not."""
        self._call("remove", replica, reason)

    def add(self, replica: str, reason: str) -> None:
        """Put the replica (by name; a node: its first replica) (back) into its router;
        RouterError when it could not."""
        self._call("add", replica, reason)

    def warm_up(self, replica: str) -> None:
        self.warm_up_target(target_for(self.config, replica))

    def warm_up_target(self, target: RouterTarget) -> None:
        cfg = self.config.router_for(target.model)
        if cfg.warmup_prompt:
            warm_up(target, cfg.warmup_prompt, cfg.warmup_timeout_s, self.post)

    def states(self, keys: Sequence[str], extra: Sequence[RouterTarget] = ()) -> dict[str, str]:
        """What the router says now of each replica (by name; a node: its first replica) and
        of each `extra` target, keyed by replica name (`unknown` where it cannot be read)."""
        by_router: dict[int, tuple[Router, list[RouterTarget]]] = {}
        for target in [*(target_for(self.config, key) for key in keys), *extra]:
            router = self.router(target.model)
            by_router.setdefault(id(router), (router, []))[1].append(target)
        out: dict[str, str] = {}
        for router, targets in by_router.values():
            try:
                out.update(router.state(targets))
            except SlurmIdleError as exc:
                with self._lock:
                    self.errors += 1
                log.warning("router state unreadable: %s", exc)
                out.update({t.name: UNKNOWN for t in targets})
        return out

    def reconcile(self, obs: Observation) -> list[dict[str, Any]]:
        """Make the routers match the observed phases; returns what was changed (or failed)."""
        if not self.active:
            return []
        # Per replica: every replica headed on a node is a target of its own (two on an
        # 8-GPU node are two servers); a node a replica only spans has none.
        pairs = [(v, t) for v in obs.nodes if desired(v.phase) is not None
                 for t in targets_headed(self.config, v.name)]
        # `placement: jobs` replicas, unplaced ones too: a replica job that died while serving
        # is LENT now, and must leave.
        jobs = {r.name: (r, job_target(r)) for r in obs.replica_jobs if desired(r.phase) is not None}
        states = self.states([t.name for _, t in pairs], [t for _, t in jobs.values()])
        done: list[dict[str, Any]] = []
        for name, (r, target) in jobs.items():
            want, have = desired(r.phase), states.get(name, UNKNOWN)
            if have in (UNKNOWN, want) or (want == OUT and have == MISSING):
                continue
            op = "add" if want == IN else "remove"
            try:
                self.call_target(op, target, f"reconcile: {name} is {r.phase.value} in Slurm "
                                             f"but {have} in the router")
                done.append({"node": name, "call": op, "outcome": "ok"})
            except RouterError as exc:
                done.append({"node": name, "call": op, "outcome": "error", "error": str(exc)})
        for v, t in pairs:
            want, have = desired(v.phase), states.get(t.name, UNKNOWN)
            if have == UNKNOWN or have == want:
                continue
            op = "add" if want == IN else "remove"
            why = (f"reconcile: {t.name} is {v.phase.value} in Slurm but {have} in the router")
            change: dict[str, Any] = {"node": v.name, "call": op}
            if t.name != v.name:
                change["replica"] = t.name
            try:
                self._call(op, t.name, why)
                done.append({**change, "outcome": "ok"})
            except RouterError as exc:
                done.append({**change, "outcome": "error", "error": str(exc)})
        return done
