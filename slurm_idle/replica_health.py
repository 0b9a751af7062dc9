"""Why a replica that should be serving is not healthy, named by its failing part.

`status` and `doctor` share these words so that both name the engine by its URL
(`engine not answering GET http://127.0.0.1:8001/health (connection refused)`) rather than a
symptom two steps downstream (stale series, "check the scrape config"). The verdicts are pure
functions of an engine's `/health` answer (engine.EngineHealth) and the tick's metrics;
`probe_serving` asks the engines, in parallel, only for the replicas meant to take traffic (a
lent replica's engine is stopped on purpose). Nothing here acts: a dead engine on a SERVING
replica is the agent's to repair at its next tick (policy's REPAIR), `status` only says so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.lifecycle import takes_traffic
from slurm_idle.model import Observation, ReplicaLoad
from slurm_idle.topology import group_views

if TYPE_CHECKING:
    from slurm_idle.engine import Engine, EngineHealth

#: /health requests in flight at once (threads that mostly wait on loopback or the LAN).
MAX_PROBES = 32

_STATUS = re.compile(r"/health answered (\d+)")
_ERRNO = re.compile(r"^\[Errno \d+\]\s*")


@dataclass(frozen=True)
class Unhealthy:
    """One replica's problem: `summary` for the `attention:` line, `detail` with its URL."""

    summary: str
    detail: str


def health_url(url: str) -> str:
    return url.rstrip("/") + "/health"


def _cause(error: str, target: str) -> str:
    """`GET http://h:1/health: [Errno 111] Connection refused` -> `connection refused`: the
    URL is said once, by the caller, and errno numbers mean nothing to an admin."""
    text = error.removeprefix(f"GET {target}: ")
    text = _ERRNO.sub("", text).strip() or "no answer"
    return text[0].lower() + text[1:]


def engine_down(url: str, health: EngineHealth) -> Unhealthy | None:
    """Why `/health` did not answer 200 (None when it did)."""
    if health.up:
        return None
    target = health_url(url)
    error = health.error or ""
    status = _STATUS.search(error)
    if status:
        return Unhealthy(f"/health answered {status.group(1)}", f"GET {target} answered {status.group(1)}")
    return Unhealthy("engine not answering /health",
                     f"engine not answering GET {target} ({_cause(error, target)})")


def unhealthy(url: str, health: EngineHealth | None, load: ReplicaLoad | None) -> Unhealthy | None:
    """Why a replica meant to serve does not: its engine down, not ours, asleep, or its
    metrics missing; None when nothing is wrong. `health` None: /health was not asked.
    The engine's own answer comes first: it is the cause of the others (a dead engine is
    also "not ours" to the identity check and has no fresh series)."""
    if health is not None:
        down = engine_down(url, health)
        if down is not None:
            return down
        if health.foreign is not None and health.foreign_proven:
            # Only a proof: an identity this user cannot read (the store is the agent's, 0700)
            # or a /v1/models slow to answer tells nothing (observe counts it the same way).
            return Unhealthy("endpoint is not the expected engine",
                             f"{url} is not the expected engine ({health.foreign})")
    if load is not None and load.foreign:
        return Unhealthy("endpoint is not the expected engine", f"{url} is not the expected engine")
    if health is None and load is not None and load.healthy is False and not load.sleeping:
        return Unhealthy("engine failing its health check",
                         f"engine at {url} failed the tick's probe ({health_url(url)}, awake)")
    if (health is not None and health.awake is False) or (load is not None and load.sleeping):
        return Unhealthy("engine asleep", f"engine at {url} is asleep")
    if load is None or not load.known:
        answers = f" (GET {health_url(url)} answers 200)" if health is not None else ""
        return Unhealthy("no fresh metrics", f"no fresh metrics{answers}: see `slurm-idle doctor`")
    return None


def unhealthy_names(obs: Observation, config: Config) -> list[str]:
    """The replicas meant to serve that a tick's own view (metrics, identity checks; no
    /health asked) finds unhealthy, both placements: what unhealthy_since remembers."""
    names = [r.name for g in group_views(obs, config) if takes_traffic(g.phase)
             for r in g.group.replicas if r.url and unhealthy(r.url, None, g.load(r))]
    names += [j.name for j in obs.replica_jobs if takes_traffic(j.phase) and j.url
              and unhealthy(j.url, None, j.load)]
    return names


def serving_replicas(obs: Observation, config: Config) -> list[tuple[str, ReplicaConfig]]:
    """(model, replica) of every replica whose phase takes traffic, both placements."""
    from slurm_idle.jobdriver import probe_config

    serving = {r.name for g in group_views(obs, config) if takes_traffic(g.phase)
               for r in g.group.replicas}
    out = [(m.name, r) for m in config.models for r in m.replicas if r.name in serving and r.url]
    out += [(j.model, probe_config(j)) for j in obs.replica_jobs
            if takes_traffic(j.phase) and j.nodes and j.url]
    return out


def probe_serving(obs: Observation, config: Config,
                  engine_for: Callable[[str], Engine]) -> dict[str, EngineHealth]:
    """Replica name -> its engine's `/health` answer now, for the replicas meant to serve;
    a probe that raises is an engine that did not answer."""
    from slurm_idle.engine import EngineHealth

    targets = serving_replicas(obs, config)
    if not targets:
        return {}

    def ask(model: str, replica: ReplicaConfig) -> EngineHealth:
        try:
            return engine_for(model).health(replica)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding itself
            return EngineHealth(up=False, awake=None, error=str(exc))

    with ThreadPoolExecutor(max_workers=min(len(targets), MAX_PROBES)) as pool:
        answers = list(pool.map(lambda t: ask(*t), targets))
    return {r.name: h for (_, r), h in zip(targets, answers, strict=True)}


def attention(rows: Sequence[Mapping[str, object]]) -> list[str]:
    """`status`'s summary: one `NAME what` per replica needing attention, in row order."""
    return [f"{r['name']} {r['health_summary']}" for r in rows if r.get("health_summary")]
