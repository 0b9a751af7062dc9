"""`slurm-idle doctor`: check a live site against what slurm-idle relies on.

`checks.py` holds the pure verdicts, `gather.py` reads the site; `diagnose(config)` wires the
real adapters (the CLI backend's commands, the configured metrics source, the engines' HTTP
endpoints and the docker client) and returns the checks in a fixed order.
"""

from __future__ import annotations

from typing import Any

from slurm_idle.config import Config, EngineConfig, ReplicaConfig
from slurm_idle.doctor.checks import Check, EngineFacts, SiteFacts, exit_code, run_checks
from slurm_idle.doctor.gather import engine_problems, gather
from slurm_idle.errors import SlurmIdleError
from slurm_idle.model import Observation

__all__ = ["Check", "SiteFacts", "diagnose", "exit_code", "run_checks"]


def _engine_facts(config: Config, http: Any) -> Any:
    from slurm_idle.engine import HttpProbe
    from slurm_idle.httpdeadline import HttpResponse
    from slurm_idle.replica_health import engine_down

    clients: dict[str | None, Any] = {}

    def container_exists(engine: EngineConfig, node: str, model: str) -> bool | str:
        from slurm_idle.engine import container_name

        try:
            import docker

            if engine.docker_host not in clients:
                clients[engine.docker_host] = (
                    docker.DockerClient(base_url=engine.docker_host) if engine.docker_host
                    else docker.from_env())
            clients[engine.docker_host].containers.get(container_name(engine.container, node, model))
        except Exception as exc:  # noqa: BLE001 - any failure is the finding itself
            return f"container {container_name(engine.container, node, model)!r}: {exc}"
        return True

    def facts(node: str, model: str, engine: EngineConfig,
              replica: ReplicaConfig | None = None) -> EngineFacts:
        """One replica's engine (`replica`; None: the first headed on `node`): with two on
        a node, each is asked at its own URL, so a dead one is not hidden by its neighbour."""
        replica = replica or config.replica(node)
        url = replica.url.rstrip("/") if replica else ""

        def sleep_endpoint() -> int | None:
            try:
                resp: HttpResponse = http.request("GET", url + "/is_sleeping", engine.http_timeout_s)
            except Exception:  # noqa: BLE001 - unreachable is what is reported
                return None
            return int(resp.status)

        down = engine_down(url, HttpProbe(http, engine.http_timeout_s).health(replica)) if replica else None
        # A dead engine answers no endpoint: /is_sleeping's "start it in dev mode" would mislead.
        problems = engine_problems(
            engine, node, lambda n: container_exists(engine, n, model),
            sleep_endpoint if engine.kind == "http-sleep" and down is None else None)
        warning = replica_version_warning(http, replica, engine) if replica and down is None else None
        return EngineFacts(node=node, model=model, kind=engine.kind, problems=problems,
                           warnings=(warning,) if warning else (),
                           down=down.detail if down is not None else None,
                           replica=replica.name if replica else "")

    return facts


def replica_version_warning(http: Any, replica: ReplicaConfig, engine: EngineConfig) -> str | None:
    """The version warning of one running replica (None when it runs a recent enough vLLM, or
    does not answer /health at all: a stopped engine, e.g. on a lent node, has no version)."""
    from slurm_idle.engine import HttpProbe
    from slurm_idle.engine_version import version_warning

    probe = HttpProbe(http, engine.http_timeout_s)
    if not probe.health(replica).up:
        return None
    return version_warning(probe.version(replica), engine)


def status_warnings(config: Config, obs: Observation, runner: Any = None,
                    http: Any = None) -> list[str]:
    """Site problems `status` shows beside the observation's own: serving nodes Slurm's power
    saving may suspend, and serving replicas whose vLLM lacks what the engine kind relies on
    (one line per distinct finding, naming the nodes). Unreadable parts are said, not hidden."""
    from slurm_idle import powersave
    from slurm_idle.doctor.gather import read_show_config
    from slurm_idle.engine import UrllibClient
    from slurm_idle.lifecycle import DRAINED_PHASES

    warnings: list[str] = []
    serving = [v for v in obs.nodes if v.phase in DRAINED_PHASES]
    try:
        line = powersave.exclusion_warning(read_show_config(config, runner), [v.node for v in serving])
        if line:
            warnings.append(line)
    except SlurmIdleError as exc:
        warnings.append(f"cannot read `scontrol show config` for the power-save check: {exc}")
    http = http or UrllibClient()
    by_finding: dict[str, list[str]] = {}
    for view in serving:
        replica = config.replica(view.name)
        if replica is None:
            continue
        finding = replica_version_warning(http, replica, config.engine_for(view.model))
        if finding:
            by_finding.setdefault(finding, []).append(view.name)
    warnings += [f"{', '.join(nodes)}: {finding}" for finding, nodes in by_finding.items()]
    return warnings


def diagnose(config: Config) -> list[Check]:
    """Read the live site and run every check."""
    from slurm_idle.commands import SubprocessRunner
    from slurm_idle.engine import UrllibClient
    from slurm_idle.slurm import make_backend
    from slurm_idle.wiring import make_gpu_source, make_metrics_source

    runner = SubprocessRunner()
    try:
        metrics: Any = make_metrics_source(config, read_only=True)
    except SlurmIdleError as exc:
        metrics = _Broken(str(exc))
    from slurm_idle.router.sync import RouterSet

    routers = RouterSet(config)
    facts = gather(config, runner, make_backend(config, runner), metrics,
                   _engine_facts(config, UrllibClient()),
                   router_states=routers.states if routers.active else None,
                   gpus=make_gpu_source(config))
    return run_checks(facts, config)


class _Broken:
    """A metrics source that could not be built: its error is the finding."""

    def __init__(self, error: str) -> None:
        self.error = error

    def replica_loads(self, replicas: Any) -> Any:
        from slurm_idle.errors import MetricsUnavailable

        raise MetricsUnavailable(self.error)

