"""Contract tests of engine control against the sandbox: its emulators and its dockerd.

CommandEngine runs the generated config's start/stop commands; HttpSleepEngine drives an
emulator's dev-mode sleep API; DockerEngine starts and stops a real (busybox) container.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from slurm_idle.config import EngineConfig, ReplicaConfig, load_config
from slurm_idle.engine import (
    CommandEngine,
    DockerEngine,
    HttpSleepEngine,
    is_idle,
    make_engine,
)
from slurm_idle.errors import EngineError
from slurm_idle.testing.procs import wait_for

pytestmark = pytest.mark.sandbox


def test_command_engine_stops_and_starts_emulator(sandbox: Any) -> None:
    """The sandbox config's commands stop the replica (down) and start it (serving again)."""
    config = load_config(sandbox.config_path)
    model = config.models[0].name
    engine = make_engine(config.engine_for(model), model)
    assert isinstance(engine, CommandEngine)
    replica = config.replica("gpu4")
    assert replica is not None
    wait_for(lambda: engine.health(replica).serving, 30, "serving")
    try:
        engine.stop(replica)
        engine.stop(replica)  # already stopped: harmless
        health = engine.health(replica)
        assert not health.up and health.error
        assert engine.in_flight(replica) is None
        assert engine.released(replica) and is_idle(engine, replica)  # drops nothing
        t0 = time.monotonic()
        engine.start(replica)
        wait_for(lambda: engine.health(replica).serving, 30, "serving", interval_s=0.2)
        print(f"emulator start -> serving in {time.monotonic() - t0:.2f}s")
        engine.start(replica)  # serving: a no-op
        assert engine.in_flight(replica) is not None
    finally:
        engine.start(replica)
        wait_for(lambda: engine.health(replica).serving, 30, "serving")


def test_http_sleep_engine_sleeps_and_wakes_emulator(sandbox: Any) -> None:
    """POST /sleep (wait mode) makes the emulator up but asleep; /wake_up makes it serve again."""
    config = load_config(sandbox.config_path)
    replica = config.replica("gpu3")
    assert replica is not None
    engine = HttpSleepEngine(EngineConfig(kind="http-sleep", stop_timeout_s=10, start_timeout_s=10))
    # A module run before this one on the same worker (the suite is sharded) may have left
    # gpu3's engine stopped or asleep: launch it (a no-op when running), then wake it.
    sandbox.engine_start("gpu3")
    wait_for(lambda: engine.health(replica).up, 30, "up")
    engine.start(replica)
    wait_for(lambda: engine.health(replica).serving, 30, "serving")
    try:
        engine.stop(replica)
        wait_for(lambda: engine.released(replica), 10, "asleep")
        health = engine.health(replica)
        assert health.up and health.awake is False and not health.serving
        engine.stop(replica)  # asleep already: no second request needed
        engine.start(replica)
        wait_for(lambda: engine.health(replica).serving, 10, "awake")
        health = engine.health(replica)
        assert health.serving and health.awake is True
        assert health.running is not None
    finally:
        engine.start(replica)


@pytest.fixture()
def docker_client(sandbox: Any) -> Iterator[Any]:
    docker = pytest.importorskip("docker")
    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=60)
    yield client
    client.close()


CONTAINER_TEMPLATE = "contract-vllm-{node}"


def test_docker_engine_stops_and_starts_container(sandbox: Any, docker_client: Any) -> None:
    """stop/start of the node's container (named by the template) are real and idempotent."""
    from slurm_idle.testing.images import import_busybox

    image = import_busybox(docker_client)
    name = CONTAINER_TEMPLATE.format(node="gpu1")
    for old in docker_client.containers.list(all=True, filters={"name": name}):
        old.remove(force=True)
    container = docker_client.containers.create(
        image, ["sleep", "3600"], name=name, init=True, network_mode="none")
    config = EngineConfig(kind="docker", container=CONTAINER_TEMPLATE,
                          docker_host=sandbox.docker_host, stop_timeout_s=5)
    engine = make_engine(config, "sandbox-model")
    assert isinstance(engine, DockerEngine)
    replica = ReplicaConfig(node="gpu1", url="http://127.0.0.1:9")  # no HTTP server inside
    try:
        engine.start(replica)
        assert engine.status(replica) == "running"
        engine.start(replica)
        assert engine.status(replica) == "running"
        t0 = time.monotonic()
        engine.stop(replica)
        took = time.monotonic() - t0
        # Bounded by the stop timeout: SIGKILL once it is out (a container just started may
        # not handle SIGTERM yet: its init had not set up its handlers when the stop came, once
        # in a CI lane, 5.5 s). How fast a SIGTERM ends it is the image's business.
        assert engine.status(replica) == "exited" and engine.released(replica)
        assert took < config.stop_timeout_s + 10, took
        engine.stop(replica)  # stopped already: a no-op
        engine.start(replica)
        assert engine.status(replica) == "running"
    finally:
        container.remove(force=True)


def test_docker_engine_missing_container(sandbox: Any, docker_client: Any) -> None:
    """A container that does not exist is an EngineError saying to create it."""
    config = EngineConfig(kind="docker", container="contract-missing-{node}",
                          docker_host=sandbox.docker_host)
    engine = DockerEngine(config, client=docker_client)
    with pytest.raises(EngineError, match="does not exist"):
        engine.start(ReplicaConfig(node="gpu9", url="http://127.0.0.1:9"))
