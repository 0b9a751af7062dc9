"""Zero dropped requests through a real HAProxy across lend/reclaim cycles (issue 14).

Steady client traffic goes through the sandbox's HAProxy while an admin lends and reclaims
one replica five times, for each engine kind the sandbox runs. With `router: haproxy` the
replica leaves HAProxy before it drains and stops (or sleeps) and joins after health, awake
and a warm-up request: no client request fails. With `router: none` the same cycles make
clients fail (aborted in-flight requests at SIGTERM, 503s from a sleeping engine that HAProxy's
health check still passes), so the first assertion is one the order of the steps decides.
The client-side p99 during the reclaims is printed (pytest -s) and kept in the sandbox's
router-e2e.json for the figures in docs/admin.md ("The request router").
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

CYCLES = 5
RPS = 4.0
NODE = "gpu1"


def cli(sb: Any, config: Path, *args: str) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args],
                  env={"SLURM_IDLE_CONFIG": str(config)}, timeout=180)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def wake_all(sb: Any) -> None:
    """Every emulator running and awake, every HAProxy server ready (a clean start)."""
    import http.client
    import urllib.request

    from slurm_idle.config import RouterConfig
    from slurm_idle.router import RouterTarget
    from slurm_idle.router.haproxy import HaproxyRouter

    haproxy = HaproxyRouter(RouterConfig(kind="haproxy", admin_socket=str(sb.layout.haproxy_socket)))
    def healthy(node: str) -> bool:
        return bool(sb.status()["emulators"][node]["healthy"])

    def awake(node: str) -> bool:
        # An emulator an earlier run stopped may still be exiting (it answers /health until its
        # server closes): start it again and retry until one process answers the wake-up.
        sb.engine_start(node)
        if not healthy(node):
            return False
        try:
            urllib.request.urlopen(urllib.request.Request(
                f"{sb.emulator_url(node)}/wake_up", data=b"", method="POST"), timeout=5).read()
        except (OSError, http.client.HTTPException):
            return False
        return True

    for node in sb.nodes:
        poll(functools.partial(awake, node), 60, f"{node} healthy and awake")
        haproxy.add(RouterTarget(node, "m", sb.emulator_url(node), node, 0))
    poll(lambda: set(sb.router_states().values()) == {"UP"}, 60, "every HAProxy server UP")


def config_for(sb: Any, tmp_path: Path, engine: str, router: str) -> Path:
    doc = yaml.safe_load(sb.config_path.read_text())
    if engine == "http-sleep":
        doc["engine"] = {"kind": "http-sleep", "drain_timeout_s": 10, "start_timeout_s": 60,
                         "stop_timeout_s": 15, "http_timeout_s": 2}
    if engine == "docker":
        from slurm_idle.testing.sandbox_docker import CONTAINER

        doc["engine"] = {"kind": "docker", "container": CONTAINER, "docker_host": sb.docker_host,
                         "drain_timeout_s": 10, "start_timeout_s": 60, "stop_timeout_s": 15,
                         "http_timeout_s": 2}
    doc["router"]["warmup_prompt"] = "warm up"  # only real traffic here: the warm-up is quick
    if router == "none":
        doc["router"] = {"kind": "none"}
    path = tmp_path / f"slurm-idle-{engine}-{router}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_cycles(sb: Any, config: Path, engine: str, until_failure: bool = False) -> dict[str, Any]:
    """CYCLES lends and reclaims of NODE under steady traffic; the client-side outcome.
    until_failure: stop after the first cycle in which a client request failed (the run
    without a router only has to show that failures happen: its later cycles said nothing)."""
    reset_cluster(sb, load_config(config).paths.journal)
    wake_all(sb)
    if engine != "docker":
        return _cycles(sb, config, until_failure)
    import docker

    from slurm_idle.testing import sandbox_docker

    client = docker.DockerClient(base_url=sb.docker_host, timeout=60)
    try:
        sandbox_docker.up(sb, client)
        poll(lambda: set(sb.router_states().values()) == {"UP"}, 60, "containers UP in HAProxy")
        return _cycles(sb, config, until_failure)
    finally:
        sandbox_docker.down(sb, client)
        client.close()


def _cycles(sb: Any, config: Path, until_failure: bool) -> dict[str, Any]:
    cli(sb, config, "tick")  # adopt every node into serving (no more ticks: only the admin acts)
    sb.traffic(RPS)
    time.sleep(3)
    reclaims: list[tuple[float, float]] = []
    for _ in range(CYCLES):
        cli(sb, config, "lend", NODE)
        time.sleep(2)  # lent for a while: traffic goes on on the other replicas
        started = time.time()
        cli(sb, config, "reclaim", NODE)
        reclaims.append((started, time.time()))
        time.sleep(3)
        if until_failure and sb.traffic_stats()["failed"] > 0:
            break
    end = time.time()
    sb.traffic_stop()  # requests still in flight are cancelled, counted apart (not failed)
    stats: dict[str, Any] = sb.traffic_stats(until=end)
    during = [sb.traffic_stats(since=a - 2, until=b + 2) for a, b in reclaims]
    p99s = [s["p99_s"] for s in during if s["p99_s"] is not None]
    stats["p99_during_reclaims_s"] = max(p99s) if p99s else None
    stats["failed_during_reclaims"] = sum(s["failed"] for s in during)
    stats["reclaim_s"] = [round(b - a, 1) for a, b in reclaims]  # admin reclaim, start to serving
    return stats


def record(sb: Any, key: str, stats: dict[str, Any]) -> None:
    path = Path(sb.root) / "router-e2e.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = stats
    path.write_text(json.dumps(data, indent=2))
    print(f"\n{key}: {json.dumps(stats)}")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["command", "http-sleep", "docker"])
def test_no_request_fails_with_haproxy_and_some_fail_without(sandbox: Any, tmp_path: Path,
                                                              engine: str) -> None:
    """router: haproxy -> 0 failed client requests over 5 cycles; router: none -> failures
    (within the same 5 cycles; the run stops at the first cycle that shows one)."""
    sb = sandbox
    if engine == "docker" and not sb.status()["docker"]:
        pytest.skip("the sandbox's dockerd does not answer")
    with_router = run_cycles(sb, config_for(sb, tmp_path, engine, "haproxy"), engine)
    record(sb, f"{engine}/haproxy", with_router)
    without = run_cycles(sb, config_for(sb, tmp_path, engine, "none"), engine, until_failure=True)
    record(sb, f"{engine}/none", without)
    assert with_router["requests"] > CYCLES * 10
    assert with_router["failed"] == 0, with_router
    assert with_router["p99_during_reclaims_s"] is not None
    assert without["failed"] > 0, without
