"""One set of protocol checks, run on each shipped fake and on its real adapter alike.

The core talks to Slurm, the engines, the metrics source and the router only through the
protocols in slurm_idle.slurm.protocol, slurm_idle.engine, slurm_idle.metrics and
slurm_idle.router; unit tests drive it with the fakes of slurm_idle.testing. Every test here is
parametrized over `fake` and `real` (the sandbox's Slurm through CliBackend, a vLLM emulator
through HttpSleepEngine, the sandbox's Prometheus through PrometheusSource, a HAProxy through
HaproxyRouter), so a fake that answers differently from the real thing fails here, next to
the real adapter's answer. (mypy proves the signatures: slurm_idle/testing/conformance.py.)

Each `real` case restores what it changed (node drained -> resumed, comment cleared, job
cancelled, replica back in), so it runs in the session's sandbox between other tests.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import Config, EngineConfig, ReplicaConfig, load_config, parse_config
from slurm_idle.engine import Engine, EngineHealth, HttpSleepEngine, Identity
from slurm_idle.errors import MetricsUnavailable, RouterError
from slurm_idle.metrics import MetricsSource
from slurm_idle.model import ModelLoad, ReplicaLoad
from slurm_idle.router import IN, MISSING, OUT, Router, RouterTarget
from slurm_idle.slurm.protocol import AcctJob, SlurmBackend
from slurm_idle.testing.fake_router import FakeRouter
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm
from slurm_idle.testing.waiting import poll

from .test_router_real import backends, free_port, haproxy, stop  # noqa: F401 - fixtures

REAL = pytest.param("real", marks=pytest.mark.sandbox)
KINDS = ["fake", REAL]
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}


def settle(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """The fake answers at once; Slurm and the engines take a moment (polled, not slept)."""
    poll(cond, timeout_s, what, interval_s=0.2)


# --- Slurm: ClusterReader, NodeWriter, JobControl, SlurmBackend ----------------------------


@pytest.fixture(params=KINDS)
def slurm(request: pytest.FixtureRequest) -> Iterator[SlurmBackend]:
    """A backend with the sandbox's gpu4 plain (undrained, no comment) before and after."""
    if request.param == "fake":
        yield FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3", "gpu4"])
        return
    from slurm_idle.slurm import CliBackend
    from slurm_idle.slurm.runner import SubprocessRunner

    sandbox = request.getfixturevalue("sandbox")
    backend = CliBackend(runner=SubprocessRunner(env=sandbox.env()), timeout_s=30)
    backend.set_comment("gpu4", "")
    backend.resume("gpu4")
    try:
        yield backend
    finally:
        backend.set_comment("gpu4", "")
        backend.resume("gpu4")


def node(slurm: SlurmBackend, name: str) -> Any:
    return next(n for n in slurm.nodes() if n.name == name)


def test_reader_lists_every_node_with_its_gpus(slurm: SlurmBackend) -> None:
    """nodes() holds every pool node with its GPU count; jobs() is a list of SlurmJob."""
    nodes = {n.name: n for n in slurm.nodes()}
    assert {"gpu1", "gpu2", "gpu3", "gpu4"} <= nodes.keys()
    assert all(nodes[f"gpu{i}"].gpus_total == 4 for i in range(1, 5))
    assert {"idle", "inference"} <= set(nodes["gpu4"].partitions)
    assert isinstance(slurm.jobs(), list)


def test_writer_drain_resume_and_comment_round_trip(slurm: SlurmBackend) -> None:
    """drain sets DRAIN and the Reason (a second drain rewrites it); resume clears both and is
    idempotent; set_comment shows in nodes() and "" clears it."""
    slurm.drain("gpu4", "slurm-idle:serving since=2026-12-03T00:00:00Z")
    settle(lambda: node(slurm, "gpu4").drained, "gpu4 drained")
    slurm.drain("gpu4", "slurm-idle:retiring since=2026-12-03T00:00:00Z")
    settle(lambda: node(slurm, "gpu4").reason.startswith("slurm-idle:retiring"), "reason rewritten")
    slurm.set_comment("gpu4", "slurm-idle:lent since=2026-12-03T00:00:00Z")
    settle(lambda: node(slurm, "gpu4").comment.startswith("slurm-idle:lent"), "comment set")
    slurm.resume("gpu4")
    settle(lambda: not node(slurm, "gpu4").drained, "gpu4 resumed")
    assert node(slurm, "gpu4").reason == ""
    slurm.resume("gpu4")  # not drained: a no-op, not an error
    slurm.set_comment("gpu4", "")
    settle(lambda: node(slurm, "gpu4").comment == "", "comment cleared")


def test_job_control_refuses_a_requeue_grace(slurm: SlurmBackend) -> None:
    """requeue() never waits: a grace is a ValueError (the caller signals and waits); an
    empty list is a no-op."""
    with pytest.raises(ValueError, match="signal"):
        slurm.requeue([1], grace_s=30)
    slurm.requeue([])


def test_submit_lists_the_job_and_cancel_ends_it(slurm: SlurmBackend) -> None:
    """submit returns the id of a job jobs() then shows (named, in its partition); cancel ends
    it; workload_steps and accounting answer their types."""
    job_id = slurm.submit("#!/bin/sh\nsleep 300\n",
                          ["--hold", "--partition=idle", "--job-name=protocol-check"])
    try:
        job = next(j for j in slurm.jobs() if j.job_id == job_id)
        assert (job.name, job.partition, job.state) == ("protocol-check", "idle", "PENDING")
        steps = slurm.workload_steps()
        assert isinstance(steps, dict) and job_id not in steps  # pending: no step runs
    finally:
        slurm.cancel([job_id])
    settle(lambda: all(j.state not in ACTIVE for j in slurm.jobs() if j.job_id == job_id),
           "job cancelled")
    now = time.time()
    assert all(isinstance(a, AcctJob) for a in slurm.accounting(now - 600, now + 60))
    assert slurm.version().count(".") >= 1


# --- Engine ---------------------------------------------------------------------------------


@dataclass
class EngineCase:
    engine: Engine
    replica: ReplicaConfig
    hold: Callable[[int], None]  # make n requests in flight (one running, the rest waiting)


def _fake_engine() -> EngineCase:
    replica = ReplicaConfig(node="gpu1", url="http://127.0.0.1:1")
    fake = FakeEngine(up={replica.name: True})

    def hold(n: int) -> None:
        fake.running[replica.name], fake.waiting[replica.name] = 1.0, float(n - 1)

    return EngineCase(fake, replica, hold)


@pytest.fixture(params=["fake", "real"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EngineCase]:
    """The fake engine, or an emulator (one sequence at a time, 5 tokens/s: a request of 100
    tokens runs for 20 s) on its own port behind HttpSleepEngine."""
    if request.param == "fake":
        yield _fake_engine()
        return
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_idle.testing.emulator", "--port", str(port), "--model", "m",
         "--node", "gpu1", "--max-num-seqs", "1", "--seq-tokens-per-s", "5",
         "--state-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    replica = ReplicaConfig(node="gpu1", url=f"http://127.0.0.1:{port}")
    real = HttpSleepEngine(EngineConfig(kind="http-sleep", stop_timeout_s=10, start_timeout_s=10,
                                        drain_timeout_s=0, http_timeout_s=2), model="m")

    def hold(n: int) -> None:
        body = b'{"model": "m", "prompt": "x", "max_tokens": 100}'

        def one() -> None:
            req = urllib.request.Request(replica.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=60).read()
            except OSError:
                pass  # the emulator is stopped under it at the end of the test

        for _ in range(n):
            threading.Thread(target=one, daemon=True).start()

    try:
        settle(lambda: real.health(replica).serving, "emulator serving")
        yield EngineCase(real, replica, hold)
    finally:
        stop(proc)


def test_engine_health_and_identity_types(engine: EngineCase) -> None:
    """A serving replica: EngineHealth up, awake and serving; Identity ours; the tick's check
    live and ours; nothing in flight."""
    health = engine.engine.health(engine.replica)
    assert isinstance(health, EngineHealth) and health.serving and health.up
    identity = engine.engine.identify(engine.replica)
    assert isinstance(identity, Identity) and identity.ours is True
    checked = engine.engine.check(engine.replica)
    assert isinstance(checked, EngineHealth) and checked.serving and not checked.foreign_proven
    assert engine.engine.in_flight(engine.replica) == 0


def test_engine_check_of_a_stopped_replica(engine: EngineCase) -> None:
    """Stopped (the fake: gone; the sleep engine: asleep): the tick's check says it is not
    live, so it is no capacity, whichever way each engine kind tells it."""
    engine.engine.stop(engine.replica, timeout_s=10)
    settle(lambda: engine.engine.released(engine.replica), "stop taken effect")
    assert not engine.engine.check(engine.replica).live


def test_engine_in_flight_counts_waiting_requests(engine: EngineCase) -> None:
    """Three requests on a one-sequence engine: one running, two waiting, three in flight
    (stopping would drop all three)."""
    engine.hold(3)
    settle(lambda: engine.engine.in_flight(engine.replica) == 3, "3 requests in flight")
    health = engine.engine.health(engine.replica)
    assert (health.running, health.waiting) == (1, 2)


def test_engine_stop_and_start_are_idempotent(engine: EngineCase) -> None:
    """stop: released, no longer serving (twice: harmless); start: serving again (twice:
    harmless). Each call only signals: the caller polls for the state."""
    engine.engine.stop(engine.replica, timeout_s=10)
    settle(lambda: engine.engine.released(engine.replica), "stop taken effect")
    engine.engine.stop(engine.replica, timeout_s=10)
    assert engine.engine.released(engine.replica)
    assert not engine.engine.health(engine.replica).serving
    engine.engine.start(engine.replica, timeout_s=10)
    settle(lambda: engine.engine.health(engine.replica).serving, "serving again")
    engine.engine.start(engine.replica, timeout_s=10)
    assert engine.engine.health(engine.replica).serving


# --- MetricsSource ---------------------------------------------------------------------------


@dataclass
class MetricsCase:
    source: MetricsSource
    broken: MetricsSource  # the same kind of source with its backend unreachable
    config: Config


FAKE_CONFIG = """
engine: {kind: command, start_command: "true", stop_command: "true"}
models: [{name: m, nodes: "gpu[1-2]", url: "http://127.0.0.1:1/{node}"}]
"""


@pytest.fixture(params=KINDS)
def metrics(request: pytest.FixtureRequest) -> MetricsCase:
    if request.param == "fake":
        config = parse_config(FAKE_CONFIG)
        loads = {r.name: ReplicaLoad(model="m", node=r.node, url=r.url, running=0.0)
                 for r in config.models[0].replicas}
        return MetricsCase(FakeMetrics(replicas=loads), FakeMetrics(fail=True), config)
    from slurm_idle.metrics.prometheus import PrometheusSource

    sandbox = request.getfixturevalue("sandbox")
    config = load_config(sandbox.config_path)
    dead = config.model_copy(update={"metrics": config.metrics.model_copy(
        update={"prometheus_url": f"http://127.0.0.1:{free_port()}", "query_timeout_s": 2})})
    return MetricsCase(PrometheusSource(config), PrometheusSource(dead), config)


def test_metrics_answer_one_load_per_replica_and_model_in_order(metrics: MetricsCase) -> None:
    """replica_loads: one ReplicaLoad per replica asked, in order, an unknown replica as
    known=False (never left out); model_loads: one ModelLoad per model, an unknown model too."""
    model = metrics.config.models[0]
    ghost = ReplicaConfig(node="gpu99", url=f"http://127.0.0.1:{free_port()}")
    asked = [(model.name, r) for r in model.replicas] + [(model.name, ghost)]
    loads = metrics.source.replica_loads(asked, budget_s=10)
    assert [(x.node, type(x)) for x in loads] == [(r.node, ReplicaLoad) for _, r in asked]
    assert loads[-1].known is False
    other = model.model_copy(update={"name": "no-such-model"})
    models = metrics.source.model_loads([model, other], time.time(), budget_s=10)
    assert [(m.model, type(m)) for m in models] == [(model.name, ModelLoad), ("no-such-model", ModelLoad)]
    assert models[1].known is False


def test_metrics_unreachable_is_metrics_unavailable(metrics: MetricsCase) -> None:
    """A source that cannot be read raises MetricsUnavailable (never zeros)."""
    model = metrics.config.models[0]
    with pytest.raises(MetricsUnavailable):
        metrics.broken.model_loads([model], time.time(), budget_s=5)


# --- Router ----------------------------------------------------------------------------------


def target(name: str, port: int = 1) -> RouterTarget:
    return RouterTarget(name=name, model="m", url=f"http://127.0.0.1:{port}", node=name, port=port)


@pytest.fixture(params=["fake", "real"])
def router(request: pytest.FixtureRequest) -> Router:
    """The fake with gpu1/gpu2 configured, or a HAProxy with servers gpu1/gpu2 (the fixture of
    test_router_real.py)."""
    if request.param == "fake":
        return FakeRouter(servers={"gpu1", "gpu2"})
    real: Router = request.getfixturevalue("haproxy")[0]
    return real


def test_router_remove_and_add_round_trip(router: Router) -> None:
    """Both configured servers start in; remove takes one out (twice: harmless); add puts it back."""
    t1, t2 = target("gpu1"), target("gpu2")
    assert router.state([t1, t2]) == {"gpu1": IN, "gpu2": IN}
    router.remove(t1)
    router.remove(t1)
    assert router.state([t1, t2]) == {"gpu1": OUT, "gpu2": IN}
    router.add(t1)
    assert router.state([t1, t2]) == {"gpu1": IN, "gpu2": IN}


def test_router_unknown_server_fails_and_reads_missing(router: Router) -> None:
    """A server the router is not configured with: remove raises RouterError naming it, and
    its state reads missing."""
    ghost = target("gpu9")
    with pytest.raises(RouterError, match="gpu9"):
        router.remove(ghost)
    assert router.state([ghost]) == {"gpu9": MISSING}

