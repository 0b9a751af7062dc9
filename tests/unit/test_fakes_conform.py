"""The shipped fakes are what the core's protocols ask for (mypy proves the signatures in
slurm_idle/testing/conformance.py; this checks the same at run time, for users who run the
fakes without mypy), and answer with the real adapters' types."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_idle.config import ReplicaConfig
from slurm_idle.engine import Engine, EngineHealth, Identity
from slurm_idle.errors import RouterError
from slurm_idle.metrics import MetricsSource
from slurm_idle.slurm.protocol import ClusterReader, JobControl, NodeWriter, PoolSlurm, SlurmBackend
from slurm_idle.testing import conformance
from slurm_idle.testing.fakes import FakeEngine, FakeGpus, FakeMetrics, FakeSlurm


@pytest.mark.parametrize("protocol", [ClusterReader, NodeWriter, JobControl, PoolSlurm, SlurmBackend])
def test_fake_slurm_is_every_slurm_protocol(protocol: type) -> None:
    """FakeSlurm has every method of each Slurm protocol, submit/accounting/version included."""
    assert isinstance(FakeSlurm(), protocol)


def test_fake_engine_and_metrics_are_the_protocols() -> None:
    """FakeEngine is an Engine answering EngineHealth/Identity; FakeMetrics a MetricsSource."""
    replica = ReplicaConfig(node="gpu1", url="http://127.0.0.1:1")
    engine = FakeEngine(up={"gpu1": True})
    assert isinstance(engine, Engine) and isinstance(FakeMetrics(), MetricsSource)
    assert isinstance(engine.health(replica), EngineHealth)
    assert isinstance(engine.identify(replica), Identity)
    assert isinstance(engine.check(replica), EngineHealth)


def test_fake_gpus_is_a_gpu_source_answering_gpu_readings() -> None:
    """FakeGpus is a GpuSource (as PrometheusGpuSource is) and answers GpuReading tuples."""
    from slurm_idle.metrics.gpus import GpuSource, PrometheusGpuSource
    from slurm_idle.model import GpuReading

    fake = FakeGpus()
    fake.hold("gpu1", 0, 812)
    assert isinstance(fake, GpuSource)
    assert PrometheusGpuSource.readings.__annotations__ == FakeGpus.readings.__annotations__
    [reading] = fake.readings(["gpu1"], budget_s=1.0)["gpu1"]
    assert isinstance(reading, GpuReading)


def test_the_router_sets_are_pool_routers(tmp_path: Path) -> None:
    """FakeRouterSet and the real RouterSet both have every method the core calls on a pool's
    routers; the fake records the calls and fails the ones it is told to."""
    from slurm_idle.router import PoolRouters
    from slurm_idle.router.sync import RouterSet
    from slurm_idle.testing.fake_router import FakeRouterSet
    from tests.unit.test_agent import make_config

    fake = FakeRouterSet(fail_on={"remove"})
    assert isinstance(fake, PoolRouters) and isinstance(RouterSet(make_config(tmp_path)), PoolRouters)
    fake.add("gpu1", "back")
    with pytest.raises(RouterError):
        fake.remove("gpu1", "idle")
    assert fake.log == [("add", "gpu1", "back"), ("remove", "gpu1", "idle")]
    assert fake.take_errors() == 1 and fake.take_errors() == 0


def test_conformance_module_imports_nothing_at_run_time() -> None:
    """The static proof costs nothing at import: its adapters are imported for mypy only."""
    assert not hasattr(conformance, "CliBackend")
