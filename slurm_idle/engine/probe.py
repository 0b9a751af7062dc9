"""What every engine kind shares: its HTTP client, reading a replica's endpoints (/health,
/is_sleeping, /metrics, /v1/models, /version) into health and identity, the caller's-time
limit, and the engine errors. Each read is one request bounded by engine.http_timeout_s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from slurm_idle import httpdeadline
from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine.identity import PREFIX, IdentityStore
from slurm_idle.engine_version import relied_on, supports, version_from_body
from slurm_idle.errors import EngineError
from slurm_idle.httpdeadline import DeadlineClient, HttpClient, HttpResponse

#: Replies of /health, /metrics, /v1/models, /sleep are small; a bigger body is cut here.
MAX_BODY_BYTES = 8 * 1024 * 1024


class EngineDeadline(EngineError):
    """The caller's time ran out before a start or stop finished. Not a failure of the engine:
    the operation may still be under way (a server going to sleep, a start command's server
    booting), so the caller leaves the node in its phase and asks again next tick."""


class HttpTimeout(EngineError):
    """An HTTP request got no answer within its timeout (the server may still be working on it)."""


class HttpDisconnected(EngineError):
    """The server dropped the connection before any answer (httpdeadline.Disconnected)."""


class HttpRefused(EngineError):
    """Nothing listens on the port (httpdeadline.Refused): the engine is not there."""


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
        except httpdeadline.Disconnected as exc:
            raise HttpDisconnected(str(exc)) from None
        except httpdeadline.Refused as exc:
            raise HttpRefused(str(exc)) from None
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
    # True when the endpoint proved not to be ours (an answer not our engine's); False when it
    # only could not be confirmed (no answer in time, the identity store unreadable to this
    # user). Both keep it out of service; only a proof makes `status` call it another server.
    foreign_proven: bool = False
    # The engine kind puts its server to sleep (http-sleep): an unknown sleep state may then
    # be a sleeping server, which serves nothing. A server nobody puts to sleep is awake.
    may_sleep: bool = False

    @property
    def live(self) -> bool:
        """/health answered 200 and the server is awake, or, for an engine that is never put
        to sleep, not known to be asleep: a live engine, whoever it proves to be."""
        return self.up and (self.awake is True or (self.awake is None and not self.may_sleep))

    @property
    def serving(self) -> bool:
        return self.live and self.foreign is None


#: Answers of /v1/models that say nothing of who serves (an --api-key server refuses us).
UNTOLD_STATUS = frozenset({401, 403})


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

    def identify(self, replica: ReplicaConfig, model: str, secret: str | None = None) -> Identity:
        """Whether the endpoint serves `model` (its `/v1/models` lists it) and, with `secret`
        (the replica's identity name, engine/identity.py), that name too. vLLM lists every
        served model name there; anything else answering on the port (a job's leftover
        server, a squatter listing the right model) cannot know the secret one.

        Proven not ours (False, which makes a SERVING replica repaired: restarted) only by
        nothing listening (connection refused), or an answer that is not our engine's (no
        model list, or one without the model or this replica's name). Anything a busy, slow
        or briefly unreachable engine could give leaves it untold (None): no answer in time,
        a dropped connection, any other transport error, HTTP 5xx, and 401/403 (a server run
        with --api-key). Untold is never admitted to the router either (health's `foreign`)."""
        if not model and not secret:
            return Identity(True, "no model name to check")
        try:
            resp = self.get(replica, "/v1/models")
        except HttpRefused as exc:
            return Identity(False, f"nothing listens on the port ({exc})")
        except EngineError as exc:
            return Identity(None, f"/v1/models did not answer ({exc})")
        if resp.status in UNTOLD_STATUS or resp.status >= 500:
            return Identity(None, f"/v1/models answered HTTP {resp.status}")
        if resp.status != 200:
            return Identity(False, f"/v1/models answered HTTP {resp.status}")
        ids = parse_model_ids(resp.body)
        if ids is None:
            return Identity(False, "/v1/models is not an OpenAI model list")
        if model and model not in ids:
            # Never echo an identity name (ours or a replayed one) into logs and the journal.
            listed = ", ".join(i for i in ids[:3] if not i.startswith(PREFIX)) or "nothing"
            return Identity(False, f"/v1/models lists {listed}, not {model}")
        if secret and secret not in ids:
            return Identity(False, f"/v1/models lists {model or 'the model'} but not this "
                                   "replica's identity name: another process holds the port")
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

    def health(self, replica: ReplicaConfig, *, load: bool = True, sleep: bool = True) -> EngineHealth:
        """/health, then (`sleep`) whether it is awake: /is_sleeping, else the sleep gauge of
        /metrics; and (`load`) the requests in flight from /metrics. Without `sleep` the
        state is not asked (awake None); without `load` /metrics is read only for the gauge."""
        try:
            resp = self.get(replica, "/health")
        except EngineError as exc:
            return EngineHealth(up=False, awake=None, error=str(exc))
        if resp.status != 200:
            return EngineHealth(up=False, awake=None, error=f"/health answered {resp.status}")
        sleeping = self.is_sleeping(replica) if sleep else None
        reading = self.metrics(replica) if load or (sleep and sleeping is None) else None
        awake = (not sleeping) if sleeping is not None else (reading.awake if reading else None)
        return EngineHealth(up=True, awake=awake, running=reading.running if reading else None,
                            waiting=reading.waiting if reading else None)


class _HttpHealth:
    """health(), identify(), in_flight() and the old-vLLM check shared by every engine kind."""

    def cold_restart(self, replica: ReplicaConfig, timeout_s: float | None = None) -> bool:
        """Nothing to do: this kind's start is already a cold start (see Engine)."""
        return False

    probe: HttpProbe
    model: str
    config: EngineConfig
    #: The replicas' identity names, when the engine is started with one (`{identity}` in
    #: the start command); None: the model name is all there is to check.
    identities: IdentityStore | None = None
    #: This engine kind puts servers to sleep (EngineHealth.may_sleep).
    may_sleep: bool = False

    def identify(self, replica: ReplicaConfig) -> Identity:
        """Whether the endpoint is this model's engine (see HttpProbe.identify): with
        identities, the replica's secret name must be listed too (once one was issued)."""
        secret = None
        if self.identities is not None:
            try:
                secret = self.identities.current(replica.name or replica.node)
            except EngineError as exc:
                return Identity(None, str(exc))
        return self.probe.identify(replica, self.model, secret)

    def health(self, replica: ReplicaConfig) -> EngineHealth:
        """/health, awake, in flight; and a 200 counts as serving only from the expected
        engine: an endpoint not proven ours is `foreign` (a start is then still issued)."""
        health = replace(self.probe.health(replica), may_sleep=self.may_sleep)
        if not health.up:
            return health
        return _with_identity(health, self.identify(replica))

    def check(self, replica: ReplicaConfig) -> EngineHealth:
        """A tick's probe of a serving replica: whether its endpoint is ours (/v1/models, asked
        first: a refused connection proves the engine gone in one request, and nothing more is
        asked of an endpoint proven not ours, read as not up), whether /health answers 200, and
        for an engine that sleeps whether it is awake. No load is read (the metrics source has
        it), so an engine nobody puts to sleep costs two requests."""
        identity = self.identify(replica)
        if identity.ours is False:
            return EngineHealth(up=False, awake=None, error=identity.why, foreign=identity.why,
                                foreign_proven=True, may_sleep=self.may_sleep)
        health = self.probe.health(replica, load=False, sleep=self.may_sleep)
        return _with_identity(replace(health, may_sleep=self.may_sleep), identity)

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


def _with_identity(health: EngineHealth, identity: Identity) -> EngineHealth:
    """`health` of an endpoint as `identity` found it: one not proven ours is `foreign` (a
    /health 200 from it is not serving; only a proof makes it another server)."""
    if identity.ours:
        return health
    return replace(health, foreign=identity.why or "not confirmed to be the expected engine",
                   foreign_proven=identity.ours is False)
