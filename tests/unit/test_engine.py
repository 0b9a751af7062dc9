"""Engine control: health/sleep parsing against an in-process HTTP server, commands, and the
probes the driver polls (each call one bounded request: the engine never waits itself)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from slurm_idle.commands import CompletedResult
from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine import (
    CommandEngine,
    DockerEngine,
    EngineDeadline,
    EngineHealth,
    HttpDisconnected,
    HttpResponse,
    HttpSleepEngine,
    HttpTimeout,
    UrllibClient,
    container_name,
    format_command,
    is_idle,
    make_engine,
    parse_is_sleeping,
    parse_metrics,
)
from slurm_idle.errors import CommandError, EngineError

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:engine_sleep_state Engine sleep state
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} %s
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} %s
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 10.0
"""


@dataclass
class FakeVllm:
    """State of the fake server; the handler reads and changes it."""

    health_status: int = 200
    sleeping: bool = False
    dev_mode: bool = True  # /is_sleeping, /sleep, /wake_up exist
    running: float = 0.0
    posts: list[str] = field(default_factory=list)
    version: str | None = "0.18.0"  # GET /version; None: an endpoint that is not there
    sleep_gauge: bool = True  # False: an older vLLM without vllm:engine_sleep_state
    gets: list[str] = field(default_factory=list)

    def metrics(self) -> str:
        awake = 0.0 if self.sleeping else 1.0
        page = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        )
        return page + (
            "# TYPE vllm:engine_sleep_state gauge\n"
            f'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="awake"}} {awake}\n'
            f'vllm:engine_sleep_state{{engine="0",sleep_state="weights_offloaded"}} {1 - awake}\n'
        ) if self.sleep_gauge else page


def _handler(state: FakeVllm) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            state.gets.append(self.path)
            if self.path == "/health":
                self._send(state.health_status)
            elif self.path == "/is_sleeping" and state.dev_mode:
                self._send(200, json.dumps({"is_sleeping": state.sleeping}))
            elif self.path == "/metrics":
                self._send(200, state.metrics())
            elif self.path == "/version" and state.version is not None:
                self._send(200, json.dumps({"version": state.version}))
            else:
                self._send(404, '{"detail": "Not Found"}')

        def do_POST(self) -> None:
            state.posts.append(self.path)
            if not state.dev_mode:
                self._send(404, '{"detail": "Not Found"}')
            elif self.path.startswith("/sleep"):
                state.sleeping = True
                self._send(200)
            elif self.path == "/wake_up":
                state.sleeping = False
                self._send(200)
            else:
                self._send(404)

    return Handler


@pytest.fixture()
def vllm() -> Iterator[tuple[FakeVllm, ReplicaConfig]]:
    state = FakeVllm()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield state, ReplicaConfig(node="gpu1", url=f"http://127.0.0.1:{server.server_port}/")
    finally:
        server.shutdown()
        server.server_close()


def sleep_engine(**kw: Any) -> HttpSleepEngine:
    return HttpSleepEngine(EngineConfig(kind="http-sleep", stop_timeout_s=2, start_timeout_s=2), **kw)


def closed_port_replica() -> ReplicaConfig:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return ReplicaConfig(node="gpu9", url=f"http://127.0.0.1:{port}")


# --- parsing -------------------------------------------------------------------------------


def test_parse_metrics_sums_engines_and_reads_awake() -> None:
    """Running requests are summed over engines; awake comes from the sleep-state gauge."""
    reading = parse_metrics(METRICS % ("1.0", "0.0"))
    assert reading.running == 3.0 and reading.awake is True
    assert parse_metrics(METRICS % ("0.0", "1.0")).awake is False


def test_parse_metrics_without_gauges() -> None:
    """A page without vLLM gauges yields unknowns, not zeros."""
    reading = parse_metrics("# TYPE up gauge\nup 1\n")
    assert reading.running is None and reading.awake is None


def test_parse_is_sleeping() -> None:
    """The dev-mode answer is read; anything else is unknown."""
    assert parse_is_sleeping(b'{"is_sleeping": true}') is True
    assert parse_is_sleeping(b'{"is_sleeping": false}') is False
    assert parse_is_sleeping(b"<html>") is None
    assert parse_is_sleeping(b"{}") is None


def test_health_serving_property() -> None:
    """Serving means up and awake; an unknown sleep state counts as awake only for an engine
    that never puts its server to sleep."""
    assert EngineHealth(up=True, awake=None).serving
    assert not EngineHealth(up=True, awake=None, may_sleep=True).serving
    assert EngineHealth(up=True, awake=True, may_sleep=True).serving
    assert not EngineHealth(up=True, awake=False).serving
    assert not EngineHealth(up=False, awake=True).serving


def test_an_unknown_sleep_state_is_not_serving_where_the_engine_sleeps(
        vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """No /is_sleeping (no dev mode) and no sleep gauge (an older vLLM): the http-sleep engine,
    which puts servers to sleep, cannot count the server as serving, neither in its health nor
    in the tick's check; a command engine, whose server nobody puts to sleep, counts it."""
    state, replica = vllm
    state.dev_mode, state.sleep_gauge = False, False
    sleeper, command = sleep_engine(), CommandEngine(command_config(), runner=Recorder())
    for health in (sleeper.health(replica), sleeper.check(replica)):
        assert health.up and health.awake is None and not health.live and not health.serving
    for health in (command.health(replica), command.check(replica)):
        assert health.up and health.live and health.serving


def test_the_ticks_check_reads_no_load_and_the_sleep_state_only_where_it_matters(
        vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """check() is the tick's cheap probe: /health alone for a command engine, /health and
    /is_sleeping for http-sleep (the gauge of /metrics only when /is_sleeping cannot tell)."""
    state, replica = vllm
    command = CommandEngine(command_config(), runner=Recorder())
    assert command.check(replica).serving and state.gets == ["/health"]
    state.gets.clear()
    assert sleep_engine().check(replica).serving and state.gets == ["/health", "/is_sleeping"]
    state.gets.clear()
    state.dev_mode = False
    assert sleep_engine().check(replica).serving and state.gets == ["/health", "/is_sleeping", "/metrics"]


def test_the_ticks_check_of_a_failing_or_gone_engine(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """/health 503: not live, not proven foreign (no repair on it); nothing listening: proven
    gone by the identity request alone, the one a repair acts on."""
    state, replica = vllm
    state.health_status = 503
    failing = sleep_engine().check(replica)
    assert not failing.live and not failing.foreign_proven and "503" in (failing.error or "")
    gone = HttpSleepEngine(EngineConfig(kind="http-sleep"), model="m").check(closed_port_replica())
    assert not gone.live and gone.foreign_proven and "nothing listens" in (gone.foreign or "")


# --- health over HTTP ----------------------------------------------------------------------


def test_health_up_awake_running(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """A live awake server is up, awake, and reports its running requests."""
    state, replica = vllm
    state.running = 4.0
    health = sleep_engine().health(replica)
    assert health == EngineHealth(up=True, awake=True, running=5.0, error=None, may_sleep=True)
    assert health.serving


def test_health_asleep_via_is_sleeping(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """/is_sleeping true makes the replica up but not serving."""
    state, replica = vllm
    state.sleeping = True
    health = sleep_engine().health(replica)
    assert health.up and health.awake is False and not health.serving


def test_health_falls_back_to_gauge(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """Without dev mode (/is_sleeping 404) the sleep-state gauge decides awake."""
    state, replica = vllm
    state.dev_mode = False
    state.sleeping = True
    assert sleep_engine().health(replica).awake is False


def test_health_503_is_down(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """/health 503 (dead engine) is not up and says why."""
    state, replica = vllm
    state.health_status = 503
    health = sleep_engine().health(replica)
    assert not health.up and health.error and "503" in health.error


def test_health_unreachable() -> None:
    """A closed port is down with the connection error, and in_flight is unknown."""
    replica = closed_port_replica()
    engine = sleep_engine()
    health = engine.health(replica)
    assert not health.up and health.error
    assert engine.in_flight(replica) is None


def test_urllib_client_returns_error_statuses(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """HTTP error statuses come back as responses, not exceptions."""
    _, replica = vllm
    resp = UrllibClient().request("GET", replica.url + "nope", 2)
    assert resp.status == 404


# --- http-sleep engine ---------------------------------------------------------------------


def test_sleep_stop_posts_wait_mode(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """stop() sleeps the engine with mode=wait at the configured level, once."""
    state, replica = vllm
    engine = sleep_engine()
    engine.stop(replica)
    assert engine.released(replica)
    engine.stop(replica)
    assert state.posts == ["/sleep?level=1&mode=wait"] and state.sleeping


def test_sleep_start_wakes(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """start() wakes a sleeping engine and is a no-op on a serving one."""
    state, replica = vllm
    state.sleeping = True
    engine = sleep_engine()
    engine.start(replica)
    engine.start(replica)
    assert state.posts == ["/wake_up"] and not state.sleeping


def test_sleep_start_on_dead_server_says_so() -> None:
    """Waking a server that is not running raises with what to do."""
    with pytest.raises(EngineError, match="only wakes a running server"):
        sleep_engine().start(closed_port_replica())


def test_sleep_stop_on_silent_server_refuses_to_lend() -> None:
    """Sleeping a server that does not answer raises: a hung vLLM may still hold the GPUs."""
    with pytest.raises(EngineError, match="cannot confirm it released the GPUs"):
        sleep_engine().stop(closed_port_replica())


def test_sleep_without_dev_mode_hints(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """A 404 on /sleep names the vLLM flags that enable sleep mode."""
    state, replica = vllm
    state.dev_mode = False
    with pytest.raises(EngineError, match="enable-sleep-mode"):
        sleep_engine().stop(replica)


# --- command engine ------------------------------------------------------------------------


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.argvs: list[list[str]] = []
        self.timeouts: list[float | None] = []
        self.fail = fail

    def run(self, argv: Any, input: str | None = None, timeout: float | None = None) -> CompletedResult:
        self.argvs.append(list(argv))
        self.timeouts.append(timeout)
        if self.fail:
            raise CommandError(argv, 5, "unit failed")
        return CompletedResult(tuple(argv), 0, "", "")


def command_config() -> EngineConfig:
    return EngineConfig(kind="command", start_command="start {node} {url} {model} | awk '{print}'",
                        stop_command="stop {node}", start_timeout_s=9, stop_timeout_s=4)


def test_format_command_quotes_values() -> None:
    """Placeholders get shell-quoted values; other braces are left alone."""
    out = format_command("x {node} {model} '{print}'", "gpu1", "u", "meta/L 70B")
    assert out == "x gpu1 'meta/L 70B' '{print}'"


def test_command_engine_start_and_stop() -> None:
    """start runs the start command (down replica), stop always runs the stop command."""
    runner = Recorder()
    engine = CommandEngine(command_config(), "m x", runner=runner)
    replica = closed_port_replica()
    engine.start(replica)
    engine.stop(replica)
    assert runner.argvs[0] == ["sh", "-c", f"start gpu9 {replica.url} 'm x' | awk '{{print}}'"]
    assert runner.argvs[1] == ["sh", "-c", "stop gpu9"]
    assert runner.timeouts == [9, 34]


def test_command_engine_start_noop_when_serving(vllm: tuple[FakeVllm, ReplicaConfig]) -> None:
    """start on a healthy awake replica runs nothing."""
    _, replica = vllm
    runner = Recorder()
    CommandEngine(command_config(), runner=runner).start(replica)
    assert runner.argvs == []


def test_command_failure_is_engine_error() -> None:
    """A failing command becomes EngineError naming the node and the command's error."""
    engine = CommandEngine(command_config(), runner=Recorder(fail=True))
    with pytest.raises(EngineError, match="gpu9.*unit failed"):
        engine.stop(closed_port_replica())


def test_make_engine_kinds() -> None:
    """make_engine returns the control the kind names."""
    assert isinstance(make_engine(command_config()), CommandEngine)
    assert isinstance(make_engine(EngineConfig(kind="http-sleep")), HttpSleepEngine)
    assert type(make_engine(EngineConfig(kind="docker"))).__name__ == "DockerEngine"


def test_container_name_template() -> None:
    """The container template takes the node and a name-safe model."""
    assert container_name("vllm-{node}", "gpu1") == "vllm-gpu1"
    assert container_name("{model}-{node}", "gpu1", "meta/Llama 3") == "meta-Llama-3-gpu1"


# --- waiting -------------------------------------------------------------------------------


@dataclass
class ScriptedEngine:
    """in_flight/health answers follow a script, one entry per call."""

    running: list[float | None]
    up: bool = True
    polls: int = 0

    def in_flight(self, replica: ReplicaConfig) -> float | None:
        value = self.running[min(self.polls, len(self.running) - 1)]
        self.polls += 1
        return value

    def health(self, replica: ReplicaConfig) -> EngineHealth:
        return EngineHealth(up=self.up, awake=True)


REPLICA = ReplicaConfig(node="gpu1", url="http://x")


def test_is_idle_when_nothing_is_in_flight() -> None:
    """Idle once no request runs or waits; requests in flight are not idle."""
    assert is_idle(ScriptedEngine(running=[0]), REPLICA)
    assert not is_idle(ScriptedEngine(running=[2]), REPLICA)


def test_a_down_replica_is_idle() -> None:
    """A replica that is down runs nothing: idle."""
    assert is_idle(ScriptedEngine(running=[None], up=False), REPLICA)


def test_unknown_in_flight_on_a_live_replica_is_not_idle() -> None:
    """Unreadable metrics on a live replica are not taken as idle."""
    assert not is_idle(ScriptedEngine(running=[None]), REPLICA)


# --- waiting requests are in flight too ------------------------------------------------------------


class RouteHttp:
    """An in-memory HttpClient: (method, path) -> a response or an exception; records calls."""

    def __init__(self, routes: dict[tuple[str, str], Any]) -> None:
        self.routes = routes
        self.calls: list[tuple[str, str, float]] = []

    def request(self, method: str, url: str, timeout: float) -> HttpResponse:
        from urllib.parse import urlsplit

        path = urlsplit(url).path
        self.calls.append((method, path, timeout))
        answer = self.routes.get((method, path), HttpResponse(404, b""))
        if isinstance(answer, Exception):
            raise answer
        return answer


QUEUED = b"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
"""


def test_parse_metrics_reads_waiting_requests() -> None:
    """Waiting requests are summed over engines and count as in flight with the running ones."""
    reading = parse_metrics(QUEUED.decode())
    assert reading.running == 0.0 and reading.waiting == 3.0 and reading.in_flight == 3.0
    assert parse_metrics(METRICS % ("1.0", "0.0")).in_flight == 3.0  # no waiting gauge: running
    assert parse_metrics("# TYPE up gauge\nup 1\n").in_flight is None


def test_a_queued_request_keeps_the_replica_from_idling() -> None:
    """Nothing running but requests waiting in the queue: not idle, the retire keeps waiting."""
    http = RouteHttp({("GET", "/metrics"): HttpResponse(200, QUEUED), ("GET", "/health"): HttpResponse(200, b"")})
    engine = CommandEngine(command_config(), runner=Recorder(), http=http)
    assert engine.in_flight(REPLICA) == 3.0
    assert not is_idle(engine, REPLICA)


# --- start/stop bounded by the caller's time ----------------------------------------------------


class TimingOutRunner(Recorder):
    def run(self, argv: Any, input: str | None = None, timeout: float | None = None) -> CompletedResult:
        self.argvs.append(list(argv))
        self.timeouts.append(timeout)
        raise CommandError(argv, -1, f"timed out after {timeout:g} s")


def test_command_engine_waits_no_longer_than_the_caller_gives() -> None:
    """A start/stop command gets min(own timeout, caller's time); killed at the caller's
    deadline it is an EngineDeadline (ask again later), at its own timeout an EngineError."""
    runner = TimingOutRunner()
    engine = CommandEngine(command_config(), runner=runner)  # start 9 s, stop 4+30 s
    replica = closed_port_replica()
    with pytest.raises(EngineDeadline, match="still running after 3 s"):
        engine.stop(replica, timeout_s=3)
    with pytest.raises(EngineDeadline):
        engine.start(replica, timeout_s=2)
    with pytest.raises(EngineError) as own:
        engine.start(replica, timeout_s=100)
    assert not isinstance(own.value, EngineDeadline)
    assert runner.timeouts == [3, 2, 9]


def sleepy_routes() -> dict[tuple[str, str], Any]:
    return {("GET", "/health"): HttpResponse(200, b""),
            ("GET", "/is_sleeping"): HttpResponse(200, b'{"is_sleeping": false}'),
            ("POST", "/sleep"): HttpResponse(200, b""), ("POST", "/wake_up"): HttpResponse(200, b""),
            ("GET", "/version"): HttpResponse(200, b'{"version": "0.18.0"}')}


def test_sleep_stop_is_one_request_bounded_by_the_callers_time() -> None:
    """stop() is POST /sleep within the caller's time (not drain+stop = 180 s) and returns: it
    does not wait for the server to be asleep (the driver polls `released`)."""
    http = RouteHttp(sleepy_routes())  # the server never reports asleep
    engine = HttpSleepEngine(EngineConfig(kind="http-sleep", drain_timeout_s=120, stop_timeout_s=60),
                             http=http)
    engine.stop(REPLICA, timeout_s=3)
    assert [t for m, p, t in http.calls if m == "POST"] == [3]
    assert [p for m, p, t in http.calls].count("/is_sleeping") == 1  # health's, no polling
    assert not engine.released(REPLICA)
    http.calls.clear()
    engine.stop(REPLICA)
    assert [t for m, p, t in http.calls if m == "POST"] == [180]


def test_an_old_server_is_named_as_dropping_requests() -> None:
    """A server older than what the engine kind relies on (or without a version) is named, so
    the driver drains it by in-flight count before the stop; a current one is not."""
    routes = sleepy_routes()
    engine = HttpSleepEngine(EngineConfig(kind="http-sleep"), http=RouteHttp(routes))
    assert engine.stop_drops_requests(REPLICA) is None
    routes[("GET", "/version")] = HttpResponse(200, b'{"version": "0.16.0"}')
    assert "0.16.0 lacks" in (engine.stop_drops_requests(REPLICA) or "")
    routes[("GET", "/version")] = HttpResponse(404, b"")
    assert "version unknown" in (engine.stop_drops_requests(REPLICA) or "")


def test_an_unanswered_post_at_the_deadline_is_carried_over() -> None:
    """A wake_up/sleep the server has not answered by the caller's deadline may still be under
    way: EngineDeadline when the caller's time ran out, a plain error at the engine's own timeout."""
    routes = sleepy_routes()
    routes[("POST", "/wake_up")] = HttpTimeout("POST /wake_up: no answer")
    routes[("GET", "/is_sleeping")] = HttpResponse(200, b'{"is_sleeping": true}')
    engine = HttpSleepEngine(EngineConfig(kind="http-sleep", start_timeout_s=60), http=RouteHttp(routes))
    with pytest.raises(EngineDeadline):
        engine.start(REPLICA, timeout_s=5)
    with pytest.raises(HttpTimeout):
        engine.start(REPLICA)


class DroppingHttp(RouteHttp):
    """RouteHttp whose POST /wake_up drops the connection `drops` times, then answers."""

    def __init__(self, routes: dict[tuple[str, str], Any], drops: int) -> None:
        super().__init__(routes)
        self.drops = drops

    def request(self, method: str, url: str, timeout: float) -> HttpResponse:
        if url.endswith("/wake_up") and self.drops > 0:
            self.drops -= 1
            self.calls.append((method, "/wake_up", timeout))
            raise HttpDisconnected(f"{method} {url}: Remote end closed connection without response")
        return super().request(method, url, timeout)


def test_a_wake_up_dropped_before_any_answer_is_asked_once_more() -> None:
    """A reclaim's /wake_up whose connection the server dropped unanswered is sent once more
    (it is idempotent): one drop, the start succeeds with two POSTs; two drops, the error
    stands; a wake_up that timed out is not repeated (the server may still be working on it)."""
    routes = sleepy_routes()
    routes[("GET", "/is_sleeping")] = HttpResponse(200, b'{"is_sleeping": true}')
    config = EngineConfig(kind="http-sleep", start_timeout_s=60)
    once = DroppingHttp(routes, drops=1)
    HttpSleepEngine(config, http=once).start(REPLICA, timeout_s=30)
    assert [c[:2] for c in once.calls].count(("POST", "/wake_up")) == 2
    twice = DroppingHttp(routes, drops=2)
    with pytest.raises(HttpDisconnected, match="closed connection"):
        HttpSleepEngine(config, http=twice).start(REPLICA, timeout_s=30)
    assert [c[:2] for c in twice.calls].count(("POST", "/wake_up")) == 2
    routes[("POST", "/wake_up")] = HttpTimeout("POST /wake_up: no answer")
    timed_out = RouteHttp(routes)
    with pytest.raises(HttpTimeout):
        HttpSleepEngine(config, http=timed_out).start(REPLICA)
    assert [c[:2] for c in timed_out.calls].count(("POST", "/wake_up")) == 1


def test_urllib_client_says_a_dropped_connection_is_one() -> None:
    """A server that accepts, reads and closes without a word: HttpDisconnected (the real
    client, a real socket), which the sleep engine may ask again."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def drop() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    server = threading.Thread(target=drop, daemon=True)
    server.start()
    try:
        port = listener.getsockname()[1]
        with pytest.raises(HttpDisconnected, match="closed connection"):
            UrllibClient().request("POST", f"http://127.0.0.1:{port}/wake_up", 5.0)
    finally:
        server.join(5)
        listener.close()


def test_urllib_client_names_a_timeout() -> None:
    """A server that accepts but never answers raises HttpTimeout (an EngineError)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        with pytest.raises(HttpTimeout, match="no answer within"):
            UrllibClient().request("GET", f"http://127.0.0.1:{listener.getsockname()[1]}/health", 0.2)
    finally:
        listener.close()


class FakeContainer:
    name = "vllm-gpu1"
    status = "running"

    def __init__(self) -> None:
        self.stops: list[int] = []

    def stop(self, timeout: int) -> None:
        self.stops.append(timeout)


class FakeDocker:
    def __init__(self, container: FakeContainer) -> None:
        self.containers = self
        self._container = container

    def get(self, name: str) -> FakeContainer:
        return self._container


def test_docker_stop_grace_is_cut_to_the_callers_time() -> None:
    """SIGTERM-to-SIGKILL grace is stop_timeout_s, or the caller's time left if shorter."""
    container = FakeContainer()
    engine = DockerEngine(EngineConfig(kind="docker", stop_timeout_s=60), client=FakeDocker(container))
    engine.stop(REPLICA)
    engine.stop(REPLICA, timeout_s=12.5)
    engine.stop(REPLICA, timeout_s=600)
    assert container.stops == [60, 12, 60]
