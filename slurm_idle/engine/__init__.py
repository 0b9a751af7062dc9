"""Control of one vLLM replica per node: start/stop (or wake/sleep) and health, three ways.

The agent retires a replica before lending its node and brings it back on reclaim; how is
site policy, chosen by `engine.kind`:
- `command`: admin commands with `{node}`, `{url}`, `{model}`, `{port}`, `{index}` placeholders
  (shell-quoted values; one call per replica, so a node with two replicas gets two), and
  `{identity}`, the replica's secret served name that proves its endpoint is the engine;
- `docker`: a named container per replica (`{index}`/`{port}` tell a node's replicas apart) via the docker SDK (`stop(timeout=stop_timeout_s)`);
- `http-sleep`: vLLM sleep mode (`POST /sleep?level=N&mode=wait`, `POST /wake_up`), fastest.
One module per kind (command, container, sleep), what they share in probe; this one holds the
protocol, the factory and what the driver polls. Health is the same for all: `GET /health` 200, awake per `GET /is_sleeping` (dev mode) or the
`vllm:engine_sleep_state` gauge (an http-sleep server that tells neither is not serving: it
may be asleep), in-flight requests from `vllm:num_requests_running` plus
`vllm:num_requests_waiting` (a queued request is as much in flight as a running one).
HTTP, commands, docker client and the clock are injected so tests replace them, not patch them.

Every call is one request or command, bounded by its own timeout: nothing here waits for a
state. `start` and `stop` signal (a command, `docker start`/`stop`, `POST /wake_up`/`/sleep`)
and take an optional `timeout_s`, the time the caller (a tick, whose cron successor is locked
out while it runs) can still give: the call is cut to it and raises `EngineDeadline` when the
caller's time, not its own timeout, ran out (the operation may still be under way and is asked
again later). The driver (transitions.py) does the waiting, through its one poll loop under the
tick's deadline: for no request in flight (`is_idle`, and first, on a server too old to keep
in-flight requests through a stop, `stop_drops_requests`), for the stop to take effect
(`released`) and for the replica to serve (`health`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from slurm_idle.commands import CommandRunner
from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine.command import CommandEngine, format_command
from slurm_idle.engine.container import DockerEngine, container_name
from slurm_idle.engine.identity import IdentityStore, identity_dir
from slurm_idle.engine.probe import (
    MAX_BODY_BYTES,
    EngineDeadline,
    EngineHealth,
    HttpDisconnected,
    HttpProbe,
    HttpTimeout,
    Identity,
    MetricsReading,
    UrllibClient,
    parse_is_sleeping,
    parse_metrics,
    parse_model_ids,
)
from slurm_idle.engine.sleep import HttpSleepEngine
from slurm_idle.httpdeadline import HttpClient, HttpResponse

__all__ = [
    "MAX_BODY_BYTES",
    "CommandEngine",
    "DockerEngine",
    "Drainable",
    "Engine",
    "EngineControl",
    "EngineDeadline",
    "EngineHealth",
    "HttpDisconnected",
    "HttpProbe",
    "HttpResponse",
    "HttpSleepEngine",
    "HttpTimeout",
    "Identity",
    "IdentityStore",
    "IdleTwice",
    "MetricsReading",
    "UrllibClient",
    "container_name",
    "format_command",
    "identity_dir",
    "is_idle",
    "make_engine",
    "parse_is_sleeping",
    "parse_metrics",
    "parse_model_ids",
]


# --- the protocol --------------------------------------------------------------------------


@runtime_checkable
class Engine(Protocol):
    """Start/stop one replica and read its state; start and stop are idempotent signals.

    `timeout_s` bounds the call (see the module docstring); none of them waits for a state,
    the caller polls `released` (the stop took effect) and `health` (serving again).
    `in_flight` counts the requests running *and* waiting (stopping would drop either); None
    when the replica is down or its metrics unreadable. `check` is a tick's cheap probe of a
    serving replica (identity, /health, and the sleep state where the engine sleeps), no load.
    `cold_restart` stops the server and starts a fresh one where the kind has a start besides
    its wake (http-sleep with start_command/stop_command), True once issued; False, nothing
    done, where a start is already cold (command, docker) or no command is configured. The fake in `slurm_idle.testing.fakes`
    implements it too.
    """

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None: ...

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None: ...

    def released(self, replica: ReplicaConfig) -> bool: ...

    def stop_drops_requests(self, replica: ReplicaConfig) -> str | None: ...

    def health(self, replica: ReplicaConfig) -> EngineHealth: ...

    def in_flight(self, replica: ReplicaConfig) -> float | None: ...

    def identify(self, replica: ReplicaConfig) -> Identity: ...

    def cold_restart(self, replica: ReplicaConfig, timeout_s: float | None = None) -> bool: ...

    def check(self, replica: ReplicaConfig) -> EngineHealth: ...


#: The protocol's earlier name, kept for callers outside the package.
EngineControl = Engine


def make_engine(
    config: EngineConfig,
    model: str = "",
    *,
    runner: CommandRunner | None = None,
    http: HttpClient | None = None,
    docker_client: Any = None,
    identities: IdentityStore | None = None,
) -> Engine:
    """The engine control `config.kind` names, for the replicas of `model`; `identities`:
    where a `command` engine's identity names live (engine/identity.py)."""
    if config.kind == "command":
        return CommandEngine(config, model, runner=runner, http=http, identities=identities)
    if config.kind == "docker":
        return DockerEngine(config, model, client=docker_client, http=http)
    return HttpSleepEngine(config, http=http, model=model)


# --- what the driver polls ------------------------------------------------------------------


class Drainable(Protocol):
    """What waiting for a replica to drain reads: requests in flight and health."""

    def health(self, replica: ReplicaConfig) -> EngineHealth: ...

    def in_flight(self, replica: ReplicaConfig) -> float | None: ...


def is_idle(engine: Drainable, replica: ReplicaConfig) -> bool:
    """No request in flight, running or waiting (or the replica is down: it can drop none)."""
    running = engine.in_flight(replica)
    return running == 0 or (running is None and not engine.health(replica).up)


class IdleTwice:
    """A drain's end, for every placement: `idle()` true at two readings at least `gap_s`
    apart (a poll) with none busy between. A request the router forwarded just before it took
    the replica out can still be on its way (connected, not yet parsed), and an engine counts
    a request only once it has queued it: one idle reading right after the removal stopped an
    engine under such a request (the sandbox's story once saw a client request aborted so).
    Two readings close together (a wait cut short by the tick's deadline) are one: the drain
    then carries over to the next tick."""

    def __init__(self, idle: Callable[[], bool], clock: Callable[[], float], gap_s: float) -> None:
        self.idle, self.clock, self.gap_s = idle, clock, gap_s
        self.idle_since: float | None = None
        self.was_idle = False  # the last reading's

    def __call__(self) -> bool:
        self.was_idle = self.idle()
        now = self.clock()
        if not self.was_idle:
            self.idle_since = None
            return False
        if self.idle_since is None:
            self.idle_since = now
        return now - self.idle_since >= self.gap_s
