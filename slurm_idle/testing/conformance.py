"""Static proof that the shipped fakes and the real adapters implement the core's protocols.

Nothing here runs anything: `mypy --strict slurm_idle` (scripts/test) type-checks the
assignments below, so a fake that loses a method, or answers with another type than the real
adapter, fails the gate before any test runs. tests/contract/test_protocols.py then runs the
same behavioural checks against each fake and its real counterpart, so neither can drift.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_idle.engine import CommandEngine, DockerEngine, Engine, HttpSleepEngine
    from slurm_idle.metrics import MetricsSource
    from slurm_idle.metrics.fallback import FallbackSource
    from slurm_idle.metrics.gpus import GpuSource, PrometheusGpuSource
    from slurm_idle.metrics.prometheus import PrometheusSource
    from slurm_idle.metrics.scrape import ScrapeSource
    from slurm_idle.router import PoolRouters, Router
    from slurm_idle.router.command import CommandRouter
    from slurm_idle.router.file import FileRouter
    from slurm_idle.router.haproxy import HaproxyRouter
    from slurm_idle.router.none import NoRouter
    from slurm_idle.router.sync import RouterSet
    from slurm_idle.slurm.cli_backend import CliBackend
    from slurm_idle.slurm.protocol import (
        ClusterReader,
        JobControl,
        NodeWriter,
        PoolSlurm,
        SlurmBackend,
    )
    from slurm_idle.slurm.pyslurm_backend import PyslurmBackend
    from slurm_idle.testing.fake_router import FakeRouter, FakeRouterSet
    from slurm_idle.testing.fakes import FakeEngine, FakeGpus, FakeMetrics, FakeSlurm


def _slurm(fake: FakeSlurm, cli: CliBackend, pyslurm: PyslurmBackend) -> None:
    reader: ClusterReader = fake
    writer: NodeWriter = fake
    jobs: JobControl = fake
    pool: PoolSlurm = fake
    backend: SlurmBackend = fake
    backend = cli
    backend = pyslurm
    del reader, writer, jobs, pool, backend


def _engine(fake: FakeEngine, cmd: CommandEngine, docker: DockerEngine, http: HttpSleepEngine) -> None:
    engine: Engine = fake
    engine = cmd
    engine = docker
    engine = http
    del engine


def _metrics(fake: FakeMetrics, prom: PrometheusSource, scrape: ScrapeSource,
             fallback: FallbackSource) -> None:
    source: MetricsSource = fake
    source = prom
    source = scrape
    source = fallback
    del source


def _gpus(fake: FakeGpus, prom: PrometheusGpuSource) -> None:
    source: GpuSource = fake
    source = prom
    del source


def _router(fake: FakeRouter, haproxy: HaproxyRouter, file: FileRouter, command: CommandRouter,
            none: NoRouter) -> None:
    router: Router = fake
    router = haproxy
    router = file
    router = command
    router = none
    del router


def _router_set(fake: FakeRouterSet, real: RouterSet) -> None:
    routers: PoolRouters = fake
    routers = real
    del routers
