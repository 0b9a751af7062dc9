"""Control of one vLLM replica per node: start/stop (or wake/sleep) and health, three ways.

The agent retires a replica before lending its node and brings it back on reclaim; how is
site policy, chosen by `engine.kind`:
- `command`: admin commands with `{node}`, `{url}`, `{model}`, `{port}`, `{index}` placeholders
  (shell-quoted values; one call per replica, so a node with two replicas gets two);
- `docker`: a named container per replica (`{index}`/`{port}` tell a node's replicas apart) via the docker SDK (`stop(timeout=stop_timeout_s)`);
- `http-sleep`: vLLM sleep mode (`POST /sleep?level=N&mode=wait`, `POST /wake_up`), fastest.
Health is the same for all: `GET /health` 200, awake per `GET /is_sleeping` (dev mode) or the
`vllm:engine_sleep_state` gauge, in-flight requests from `vllm:num_requests_running` plus
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

import json
import re
import shlex
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from prometheus_client.parser import text_string_to_metric_families

from slurm_idle import httpdeadline
from slurm_idle.commands import TIMEOUT_RC, CommandRunner, SubprocessRunner
from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine_version import relied_on, supports, version_from_body
from slurm_idle.errors import CommandError, EngineError
from slurm_idle.httpdeadline import DeadlineClient, HttpClient, HttpResponse
from slurm_idle.logs import get_logger

log = get_logger(__name__)

#: Replies of /health, /metrics, /v1/models, /sleep are small; a bigger body is cut here.
MAX_BODY_BYTES = 8 * 1024 * 1024


class EngineDeadline(EngineError):
    """The caller's time ran out before a start or stop finished. Not a failure of the engine:
    the operation may still be under way (a server going to sleep, a start command's server
    booting), so the caller leaves the node in its phase and asks again next tick."""


class HttpTimeout(EngineError):
    """An HTTP request got no answer within its timeout (the server may still be working on it)."""


def _limit(own_s: float, given_s: float | None) -> tuple[float, bool]:
    """How long a call may wait: its own timeout, or the caller's time if that is shorter.
    The flag says the caller's time set it, so running out is an EngineDeadline."""
    if given_s is None or given_s >= own_s:
        return own_s, False
    return max(given_s, 0.0), True


# --- HTTP ----------------------------------------------------------------------------------


class UrllibClient:
    """The engine's HTTP client: the one client (httpdeadline.DeadlineClient: a total deadline
    for connect, headers and body, bodies cut at MAX_BODY_BYTES, no proxies), its failures as
    EngineErrors: no answer in time is HttpTimeout, no answer at all EngineError."""

    def __init__(self, client: HttpClient | None = None) -> None:
        self.client = client or DeadlineClient(MAX_BODY_BYTES)

    def request(self, method: str, url: str, timeout: float) -> HttpResponse:
        try:
            return self.client.request(method, url, timeout)
        except httpdeadline.DeadlineExceeded:
            raise HttpTimeout(f"{method} {url}: no answer within {timeout:g} s") from None
        except OSError as exc:
            raise EngineError(str(exc)) from None


# --- health --------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineHealth:
    """What a replica's HTTP endpoints say right now."""

    up: bool  # GET /health answered 200
    awake: bool | None  # None: neither /is_sleeping nor the sleep gauge told
    running: float | None = None  # requests in model execution, summed over engines
    error: str | None = None
    waiting: float | None = None  # requests queued for execution, summed over engines
    # Why the endpoint is not the expected engine (another server on the port, our container
    # not running...), None when it proved to be ours: a foreign /health 200 is not serving.
    foreign: str | None = None

    @property
    def serving(self) -> bool:
        return self.up and self.awake is not False and self.foreign is None


@dataclass(frozen=True)
class Identity:
    """Whether a replica's endpoint is the engine we expect: `ours` True when proven, False
    when proven not (`why` says how), None when it could not be told (no answer in time)."""

    ours: bool | None
    why: str = ""


def parse_model_ids(body: bytes) -> list[str] | None:
    """The model ids of an OpenAI `/v1/models` answer (`{"data": [{"id": ...}]}`), or None
    when the body is not such a list."""
    try:
        doc = json.loads(body or b"null")
    except ValueError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    return [str(item["id"]) for item in data if isinstance(item, dict) and "id" in item]


@dataclass(frozen=True)
class MetricsReading:
    running: float | None
    awake: bool | None
    waiting: float | None = None

    @property
    def in_flight(self) -> float | None:
        """Running plus waiting requests; None when the page has neither gauge."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


def parse_metrics(text: str) -> MetricsReading:
    """Requests running and waiting (each summed over engines) and awake state from a vLLM
    /metrics page.

    Awake is True only if every engine's `sleep_state="awake"` sample is 1, None without
    the gauge (older vLLM).
    """
    running: float | None = None
    waiting: float | None = None
    awake_values: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                running = (running or 0.0) + sample.value
            elif sample.name == "vllm:num_requests_waiting":
                waiting = (waiting or 0.0) + sample.value
            elif sample.name == "vllm:engine_sleep_state" and sample.labels.get("sleep_state") == "awake":
                awake_values.append(sample.value)
    awake = all(v >= 1 for v in awake_values) if awake_values else None
    return MetricsReading(running, awake, waiting)


def parse_is_sleeping(body: bytes) -> bool | None:
    """`{"is_sleeping": true}` -> True; anything unreadable -> None."""
    try:
        value = json.loads(body or b"null")
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("is_sleeping"), bool):
        return bool(value["is_sleeping"])
    return None


def _endpoint(replica: ReplicaConfig, path: str) -> str:
    return replica.url.rstrip("/") + path


class HttpProbe:
    """Reads /health, /is_sleeping, /metrics and /v1/models of a replica."""

    def __init__(self, http: HttpClient, timeout_s: float) -> None:
        self.http = http
        self.timeout_s = timeout_s

    def identify(self, replica: ReplicaConfig, model: str) -> Identity:
        """Whether the endpoint serves `model` (its `/v1/models` lists it). vLLM lists its
        served model names there; anything else answering on the port (a job's leftover
        server, a fake exporter) does not, or not in that shape."""
        if not model:
            return Identity(True, "no model name to check")
        try:
            resp = self.get(replica, "/v1/models")
        except EngineError as exc:
            return Identity(None, f"/v1/models did not answer ({exc})")
        if resp.status != 200:
            return Identity(False, f"/v1/models answered HTTP {resp.status}")
        ids = parse_model_ids(resp.body)
        if ids is None:
            return Identity(False, "/v1/models is not an OpenAI model list")
        if model not in ids:
            listed = ", ".join(ids[:3]) or "nothing"
            return Identity(False, f"/v1/models lists {listed}, not {model}")
        return Identity(True)

    def get(self, replica: ReplicaConfig, path: str) -> HttpResponse:
        return self.http.request("GET", _endpoint(replica, path), self.timeout_s)

    def is_sleeping(self, replica: ReplicaConfig) -> bool | None:
        try:
            resp = self.get(replica, "/is_sleeping")
        except EngineError:
            return None
        return parse_is_sleeping(resp.body) if resp.status == 200 else None

    def version(self, replica: ReplicaConfig) -> str | None:
        """The server's vLLM version from `GET /version`, None when it does not say."""
        try:
            resp = self.get(replica, "/version")
        except EngineError:
            return None
        return version_from_body(resp.body) if resp.status == 200 else None

    def metrics(self, replica: ReplicaConfig) -> MetricsReading | None:
        try:
            resp = self.get(replica, "/metrics")
        except EngineError:
            return None
        if resp.status != 200:
            return None
        try:
            return parse_metrics(resp.body.decode(errors="replace"))
        except ValueError:
            return None

    def health(self, replica: ReplicaConfig) -> EngineHealth:
        try:
            resp = self.get(replica, "/health")
        except EngineError as exc:
            return EngineHealth(up=False, awake=None, error=str(exc))
        if resp.status != 200:
            return EngineHealth(up=False, awake=None, error=f"/health answered {resp.status}")
        sleeping = self.is_sleeping(replica)
        reading = self.metrics(replica)
        awake = (not sleeping) if sleeping is not None else (reading.awake if reading else None)
        return EngineHealth(up=True, awake=awake, running=reading.running if reading else None,
                            waiting=reading.waiting if reading else None)


# --- the protocol --------------------------------------------------------------------------


@runtime_checkable
class Engine(Protocol):
    """Start/stop one replica and read its state; start and stop are idempotent signals.

    `timeout_s` bounds the call (see the module docstring); none of them waits for a state,
    the caller polls `released` (the stop took effect) and `health` (serving again).
    `in_flight` counts the requests running *and* waiting (stopping would drop either); None
    when the replica is down or its metrics unreadable. The fake in `slurm_idle.testing.fakes`
    implements it too.
    """

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None: ...

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None: ...

    def released(self, replica: ReplicaConfig) -> bool: ...

    def stop_drops_requests(self, replica: ReplicaConfig) -> str | None: ...

    def health(self, replica: ReplicaConfig) -> EngineHealth: ...

    def in_flight(self, replica: ReplicaConfig) -> float | None: ...

    def identify(self, replica: ReplicaConfig) -> Identity: ...


#: The protocol's earlier name, kept for callers outside the package.
EngineControl = Engine


class _HttpHealth:
    """health(), identify(), in_flight() and the old-vLLM check shared by every engine kind."""

    probe: HttpProbe
    model: str
    config: EngineConfig

    def identify(self, replica: ReplicaConfig) -> Identity:
        """Whether the endpoint is this model's engine (see HttpProbe.identify)."""
        return self.probe.identify(replica, self.model)

    def health(self, replica: ReplicaConfig) -> EngineHealth:
        """/health, awake, in flight; and a 200 counts as serving only from the expected
        engine: an endpoint not proven ours is `foreign` (a start is then still issued)."""
        health = self.probe.health(replica)
        if not health.up:
            return health
        identity = self.identify(replica)
        if identity.ours:
            return health
        return replace(health, foreign=identity.why or "not confirmed to be the expected engine")

    def version(self, replica: ReplicaConfig) -> str | None:
        return self.probe.version(replica)

    def stop_drops_requests(self, replica: ReplicaConfig) -> str | None:
        """Why a stop (or sleep) now would drop the requests in flight: the server's vLLM
        lacks what this engine kind relies on to keep them (`mode=wait` < 0.17,
        `--shutdown-timeout` < 0.18) or does not say its version. None when it keeps them; the
        driver then stops at once, else it first waits for `is_idle`, up to
        engine.drain_timeout_s (as RETIRING's own drain does)."""
        feature = relied_on(self.config)
        version = self.version(replica)
        if supports(version, feature):
            return None
        return f"vLLM {version or '(version unknown)'} lacks {feature.name}"

    def in_flight(self, replica: ReplicaConfig) -> float | None:
        """Requests running or waiting now; None when the replica is down or its metrics
        unreadable. A waiting request is in flight too: stopping would drop it."""
        reading = self.probe.metrics(replica)
        return reading.in_flight if reading else None


_PLACEHOLDER = re.compile(r"\{(node|url|model|port|index|name)\}")


def format_command(
    template: str, node: str, url: str, model: str, port: int | None = None, index: int = 0,
    name: str = "",
) -> str:
    """Fill `{node}`, `{url}`, `{model}`, `{port}`, `{index}`, `{name}` (the replica's) with
    shell-quoted values; other braces stay as they are."""
    values = {"node": node, "url": url, "model": model, "port": "" if port is None else str(port),
              "index": str(index), "name": name or node}
    return _PLACEHOLDER.sub(lambda m: shlex.quote(values[m.group(1)]), template)


class CommandEngine(_HttpHealth):
    """Admin-supplied shell commands start and stop the replica."""

    def __init__(
        self,
        config: EngineConfig,
        model: str = "",
        runner: CommandRunner | None = None,
        http: HttpClient | None = None,
    ) -> None:
        if not (config.start_command and config.stop_command):
            raise EngineError("engine kind 'command' needs start_command and stop_command")
        self.config = config
        self.model = model
        self.runner = runner or SubprocessRunner()
        self.probe = HttpProbe(http or UrllibClient(), config.http_timeout_s)

    def _shell(
        self, what: str, template: str, replica: ReplicaConfig, own_s: float, given_s: float | None
    ) -> None:
        command = format_command(template, replica.node, replica.url, self.model, replica.port,
                                 replica.index, replica.name)
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
        if self.health(replica).serving:
            return
        assert self.config.start_command
        self._shell("start", self.config.start_command, replica, self.config.start_timeout_s, timeout_s)

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        # Always run: an admin stop command is idempotent, and a hung server whose /health
        # no longer answers still has to be stopped (a down server has nothing to drain).
        assert self.config.stop_command
        self._shell("stop", self.config.stop_command, replica, self.config.stop_timeout_s + 30, timeout_s)

    def released(self, replica: ReplicaConfig) -> bool:
        """The stop command's exit is the stop: once it returned, the replica is stopped."""
        return True


def container_name(
    template: str, node: str, model: str = "", index: int = 0, port: int | None = None
) -> str:
    """The container of a replica: `{node}`, `{model}` (made name-safe), `{index}` and `{port}`
    (for several replicas on one node) filled in."""
    safe_model = re.sub(r"[^a-zA-Z0-9_.-]", "-", model)
    return (template.replace("{node}", node).replace("{model}", safe_model)
            .replace("{index}", str(index)).replace("{port}", "" if port is None else str(port)))


#: Container states in which the replica still holds its GPUs.
_HOLDING = frozenset({"running", "restarting", "paused"})


class DockerEngine(_HttpHealth):
    """A pre-created container per node, started and stopped through the docker SDK."""

    def __init__(
        self,
        config: EngineConfig,
        model: str = "",
        client: Any = None,
        http: HttpClient | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self._client = client
        self.probe = HttpProbe(http or UrllibClient(), config.http_timeout_s)

    @property
    def client(self) -> Any:
        if self._client is None:
            import docker

            timeout = int(self.config.stop_timeout_s + 30)
            try:
                if self.config.docker_host:
                    self._client = docker.DockerClient(base_url=self.config.docker_host, timeout=timeout)
                else:
                    self._client = docker.from_env(timeout=timeout)
            except docker.errors.DockerException as exc:
                raise EngineError(f"cannot reach the container engine: {exc}") from None
        return self._client

    def container(self, replica: ReplicaConfig) -> Any:
        import docker

        name = container_name(self.config.container, replica.node, self.model, replica.index,
                              replica.port)
        try:
            container = self.client.containers.get(name)
        except docker.errors.NotFound:
            raise EngineError(
                f"{replica.node}: container {name!r} does not exist; create it once "
                "(docker create --name ...) or fix engine.container"
            ) from None
        except docker.errors.DockerException as exc:
            raise EngineError(f"{replica.node}: container {name!r}: {exc}") from None
        return container

    def status(self, replica: ReplicaConfig) -> str:
        """The container's state: running, exited, created, ..."""
        return str(self.container(replica).status)

    def identify(self, replica: ReplicaConfig) -> Identity:
        """Ours only while our container runs and its endpoint lists the model: whatever
        answers on the port while the container is stopped is someone else's."""
        try:
            container = self.container(replica)
        except EngineError as exc:
            return Identity(False, str(exc))
        if container.status != "running":
            return Identity(False, f"container {container.name} is {container.status}, so what "
                                   "answers on the port is not it")
        return super().identify(replica)

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        # `docker start` returns once the process runs; health is waited for by the caller.
        import docker

        container = self.container(replica)
        if container.status == "running":
            return
        try:
            container.start()
        except docker.errors.DockerException as exc:
            raise EngineError(f"{replica.node}: cannot start {container.name}: {exc}") from None

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        import docker

        container = self.container(replica)
        if container.status not in _HOLDING:
            return
        # SIGTERM, then SIGKILL after the grace: the server's clean exit. The grace is cut to
        # the caller's time left, so a stop never holds the tick past its deadline; in-flight
        # requests were already drained while RETIRING, and the kernel frees the GPUs either way.
        grace, _ = _limit(self.config.stop_timeout_s, timeout_s)
        try:
            container.stop(timeout=int(grace))
        except docker.errors.DockerException as exc:
            raise EngineError(f"{replica.node}: cannot stop {container.name}: {exc}") from None

    def released(self, replica: ReplicaConfig) -> bool:
        """The container no longer runs (`docker stop` returns once it exited)."""
        return str(self.container(replica).status) not in _HOLDING


class HttpSleepEngine(_HttpHealth):
    """vLLM sleep mode: the server keeps running, its weights leave the GPUs while lent."""

    def __init__(self, config: EngineConfig, http: HttpClient | None = None, model: str = "") -> None:
        self.config = config
        self.model = model
        self.http = http or UrllibClient()
        self.probe = HttpProbe(self.http, config.http_timeout_s)

    def _post(self, replica: ReplicaConfig, path: str, own_s: float, given_s: float | None) -> None:
        limit, cut = _limit(own_s, given_s)
        try:
            resp = self.http.request("POST", _endpoint(replica, path), limit)
        except HttpTimeout:
            if cut:
                # vLLM carries on with a request whose client went away: the next tick finds
                # the server asleep (or awake) and has nothing more to ask, or asks again.
                raise EngineDeadline(
                    f"{replica.node}: POST {path.split('?')[0]} not answered within the tick's "
                    f"time left ({limit:g} s); the next tick checks and asks again"
                ) from None
            raise
        if resp.status != 200:
            detail = resp.body.decode(errors="replace").strip()[:200]
            hint = " (is the server run with VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode?)" \
                if resp.status == 404 else ""
            raise EngineError(f"{replica.node}: POST {path} answered {resp.status} {detail}{hint}")

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        health = self.health(replica)
        if health.serving:
            return
        if not health.up:
            raise EngineError(
                f"{replica.node}: vLLM at {replica.url} is not running; the http-sleep engine "
                "only wakes a running server (start it, or use engine kind command/docker)"
            )
        self._post(replica, "/wake_up", self.config.start_timeout_s, timeout_s)

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        health = self.health(replica)
        if health.up and health.awake is False:
            return  # already asleep: the weights have left the GPUs
        if not health.up:
            # A server that does not answer may be hung with the GPUs still full: lending on
            # that guess could hand jobs occupied GPUs. Stay LENDING; the next tick retries,
            # and a lend stuck past its timeout is reported for an admin to look at.
            raise EngineError(
                f"{replica.node}: vLLM at {replica.url} does not answer ({health.error or 'no /health'}); "
                "cannot confirm it released the GPUs, not lending"
            )
        # mode=wait lets in-flight requests finish (vLLM's default, abort, would drop them);
        # a server older than 0.17 ignores it: the driver drains it by in-flight count first.
        timeout = self.config.drain_timeout_s + self.config.stop_timeout_s
        self._post(replica, f"/sleep?level={self.config.sleep_level}&mode=wait", timeout, timeout_s)

    def released(self, replica: ReplicaConfig) -> bool:
        """The server says it is asleep: its weights have left the GPUs."""
        return self.probe.is_sleeping(replica) is True


def make_engine(
    config: EngineConfig,
    model: str = "",
    *,
    runner: CommandRunner | None = None,
    http: HttpClient | None = None,
    docker_client: Any = None,
) -> Engine:
    """The engine control `config.kind` names, for the replicas of `model`."""
    if config.kind == "command":
        return CommandEngine(config, model, runner=runner, http=http)
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
