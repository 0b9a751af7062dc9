"""vLLM versions: the feature table, the emulator's configurable version, and the engines'
fallback (drain by in-flight count first) for servers without `/sleep?mode=wait`."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine import HttpSleepEngine
from slurm_idle.engine_version import (
    SHUTDOWN_TIMEOUT,
    SLEEP_MODE_WAIT,
    parse_version,
    supports,
    version_from_body,
    version_warning,
)
from slurm_idle.testing.emulator import DEFAULT_VLLM_VERSION, Emulator
from slurm_idle.testing.emulator_http import serve_in_thread
from slurm_idle.testing.engine_model import EngineModel


@pytest.mark.parametrize(("text", "parsed"), [
    ("0.17.1", (0, 17, 1)), ("0.16.0rc2.dev45+g1234abc", (0, 16, 0)), ("v0.18", (0, 18, 0)),
    ("0.25.1", (0, 25, 1)), ("", None), ("dev", None), (None, None),
])
def test_parse_version(text: str | None, parsed: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == parsed


def test_feature_table() -> None:
    """mode=wait from 0.17, --shutdown-timeout from 0.18; an unknown version supports nothing."""
    assert not supports("0.16.2", SLEEP_MODE_WAIT) and supports("0.17.0", SLEEP_MODE_WAIT)
    assert not supports("0.17.1", SHUTDOWN_TIMEOUT) and supports("0.18.0", SHUTDOWN_TIMEOUT)
    assert not supports(None, SLEEP_MODE_WAIT)
    assert version_from_body(b'{"version": "0.17.1"}') == "0.17.1"
    assert version_from_body(b"not json") is None and version_from_body(b"{}") is None


def test_warnings_name_the_feature_the_engine_kind_relies_on() -> None:
    """http-sleep relies on mode=wait, command/docker on --shutdown-timeout."""
    sleep, command = EngineConfig(kind="http-sleep"), EngineConfig(kind="docker")
    assert version_warning("0.17.0", sleep) is None
    assert "/sleep?mode=wait" in (version_warning("0.16.0", sleep) or "")
    assert "--shutdown-timeout" in (version_warning("0.17.0", command) or "")
    assert version_warning("0.18.0", command) is None
    assert "version unknown" in (version_warning(None, sleep) or "")


@pytest.fixture
def emulator(request: Any, tmp_path: Path) -> Iterator[tuple[ReplicaConfig, Emulator]]:
    emu = Emulator(EngineModel("m"), "gpu1", tmp_path, None, vllm_version=request.param)
    port, stop = serve_in_thread(emu)
    threading.Thread(target=emu.run, daemon=True).start()
    yield ReplicaConfig(node="gpu1", url=f"http://127.0.0.1:{port}"), emu
    emu.stop.set()
    stop()


def _post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=30) as r:
        text = r.read()
    return json.loads(text) if text else {}


def in_flight_completion(replica: ReplicaConfig, emu: Emulator) -> dict[str, Any]:
    """Start a 40-token completion (~0.8 s) and return its result holder once it runs."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(
        _post(replica.url + "/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 40})))
    thread.start()
    result["_thread"] = thread
    probe = HttpSleepEngine(EngineConfig(kind="http-sleep"))
    for _ in range(500):  # until /metrics shows it (the gauges follow the simulation step)
        if probe.in_flight(replica):
            break
        threading.Event().wait(0.01)
    return result


@pytest.mark.parametrize("emulator", [DEFAULT_VLLM_VERSION, "0.16.0"], indirect=True)
def test_emulator_reports_its_version(emulator: tuple[ReplicaConfig, Emulator]) -> None:
    replica, emu = emulator
    with urllib.request.urlopen(replica.url + "/version", timeout=5) as r:
        assert json.loads(r.read()) == {"version": emu.vllm_version}


@pytest.mark.parametrize("emulator", ["0.16.0"], indirect=True)
def test_old_emulator_aborts_in_flight_requests_whatever_the_mode(
        emulator: tuple[ReplicaConfig, Emulator]) -> None:
    """Like vLLM before 0.17: `/sleep?mode=wait` is taken as abort."""
    replica, emu = emulator
    job = in_flight_completion(replica, emu)
    _post(replica.url + "/sleep?level=1&mode=wait")
    job["_thread"].join(30)
    assert job["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize("emulator", ["0.16.0", DEFAULT_VLLM_VERSION], indirect=True)
def test_sleep_engine_keeps_in_flight_requests_on_any_version(
        emulator: tuple[ReplicaConfig, Emulator]) -> None:
    """A lend through the http-sleep engine loses no request: on 0.16 the driver drains by
    in-flight count before POST /sleep (the fallback), on 0.18 the server's mode=wait does it."""
    import time
    from dataclasses import replace

    from slurm_idle.config import parse_config
    from slurm_idle.lifecycle import format_reason
    from slurm_idle.model import Action, ActionKind, NodeView, Phase
    from slurm_idle.testing.fakes import FakeSlurm
    from slurm_idle.transitions import NodeDriver

    replica, emu = emulator
    config = parse_config(f"""
engine: {{kind: http-sleep, drain_timeout_s: 30, stop_timeout_s: 10}}
models: [{{name: m, nodes: gpu1, url: "{replica.url}"}}]
""")
    engine = HttpSleepEngine(config.engine_for("m"))
    slurm = FakeSlurm.with_nodes(["gpu1"])
    now = time.time()
    node = slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}),
                                            reason=format_reason("slurm-idle", Phase.LENDING, now))
    driver = NodeDriver(config, slurm, lambda model: engine, time.time, time.sleep)
    job = in_flight_completion(replica, emu)
    view = NodeView(node=node, model="m", phase=Phase.LENDING, phase_since=now)
    action = Action(ActionKind.CONTINUE, "gpu1", "m", Phase.LENDING, Phase.LENT, "lend")
    [step] = driver.drive(view, action, deadline=time.time() + 60)
    assert step.outcome == "ok", step
    job["_thread"].join(30)
    assert job["choices"][0]["finish_reason"] == "length"
    assert engine.health(replica).awake is False


@pytest.mark.parametrize("emulator", ["0.16.0"], indirect=True)
def test_status_and_doctor_warn_of_an_old_serving_replica(emulator: tuple[ReplicaConfig, Emulator]) -> None:
    """status names the serving replica whose vLLM lacks mode=wait; doctor's engine check warns."""
    from slurm_idle.commands import ReplayRunner
    from slurm_idle.config import parse_config
    from slurm_idle.doctor import _engine_facts, status_warnings
    from slurm_idle.doctor.checks import SiteFacts, check_engines
    from slurm_idle.engine import UrllibClient
    from slurm_idle.lifecycle import format_reason
    from slurm_idle.model import NodeView, Observation, Phase, SlurmNode

    replica, _ = emulator
    cfg = parse_config(f"engine: {{kind: http-sleep}}\nmodels: [{{name: m, replicas: "
                       f"[{{node: gpu1, url: '{replica.url}'}}]}}]")
    node = SlurmNode("gpu1", "idle", frozenset({"DRAIN"}), format_reason("slurm-idle", Phase.SERVING, 0))
    obs = Observation(now=0.0, nodes=(NodeView(node, "m", Phase.SERVING),))
    runner = ReplayRunner({("scontrol", "show", "config"): "SuspendProgram = (null)\n"})
    [line] = status_warnings(cfg, obs, runner)
    assert line.startswith("gpu1: vLLM 0.16.0") and "mode=wait" in line
    facts = _engine_facts(cfg, UrllibClient())("gpu1", "m", cfg.engine_for("m"))
    [check] = check_engines(SiteFacts(engines=(facts,)), cfg)
    assert check.status == "warn" and "0.16.0" in check.detail


def test_command_engine_drains_an_old_server_before_its_stop_command() -> None:
    """A vLLM without --shutdown-timeout (0.17) is drained by in-flight count (by the driver,
    under the tick's deadline), then stopped; the stop command runs only once nothing is in
    flight."""
    from slurm_idle.commands import CompletedResult
    from slurm_idle.engine import CommandEngine, HttpResponse

    readings = [b"vllm:num_requests_running 2\n", b"vllm:num_requests_running 1\n",
                b"vllm:num_requests_running 0\n"]
    events: list[str] = []

    class Http:
        def request(self, method: str, url: str, timeout: float) -> HttpResponse:
            if url.endswith("/version"):
                return HttpResponse(200, b'{"version": "0.17.1"}')
            if url.endswith("/metrics"):
                body = readings.pop(0) if len(readings) > 1 else readings[0]
                events.append(body.decode().split()[-1])
                return HttpResponse(200, body)
            return HttpResponse(200, b"")

    class Runner:
        def run(self, argv: Any, input: Any = None, timeout: Any = None) -> CompletedResult:
            events.append("stop")
            return CompletedResult(tuple(argv), 0, "", "")

    from dataclasses import replace

    from slurm_idle.config import parse_config
    from slurm_idle.lifecycle import format_reason
    from slurm_idle.model import Action, ActionKind, NodeView, Phase
    from slurm_idle.testing.fakes import FakeSlurm
    from slurm_idle.transitions import NodeDriver

    config = parse_config("""
engine: {kind: command, start_command: "true", stop_command: "true", drain_timeout_s: 60}
models: [{name: m, nodes: gpu1, url: "http://x"}]
""")
    engine = CommandEngine(config.engine_for("m"), runner=Runner(), http=Http())
    now = [0.0]
    slurm = FakeSlurm.with_nodes(["gpu1"])
    node = slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}),
                                            reason=format_reason("slurm-idle", Phase.LENDING, 0.0))
    driver = NodeDriver(config, slurm, lambda model: engine, lambda: now[0],
                        lambda s: now.__setitem__(0, now[0] + s))
    view = NodeView(node=node, model="m", phase=Phase.LENDING, phase_since=0.0)
    action = Action(ActionKind.CONTINUE, "gpu1", "m", Phase.LENDING, Phase.LENT, "lend")
    [step] = driver.drive(view, action, deadline=50.0)
    assert step.outcome == "ok"
    assert events == ["2", "1", "0", "stop"]
