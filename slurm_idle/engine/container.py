"""Engine kind `docker`: a pre-created container per replica, started and stopped through the
docker SDK (SIGTERM, then SIGKILL after a grace cut to the caller's time).
"""

from __future__ import annotations

import re
from typing import Any

from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine.probe import (
    HttpProbe,
    Identity,
    UrllibClient,
    _HttpHealth,
    _limit,
)
from slurm_idle.errors import EngineError
from slurm_idle.httpdeadline import HttpClient


def container_name(
    template: str, node: str, model: str = "", index: int = 0, port: int | None = None
) -> str:
    """The container of a replica: `{node}`, `{model}` (made name-safe), `{index}` and `{port}`
    (for several replicas on one node) filled in."""
    safe_model = re.sub(r"[^a-zA-Z0-9_.-]", "-", model)
    return (template.replace("{node}", node).replace("{model}", safe_model)
            .replace("{index}", str(index)).replace("{port}", "" if port is None else str(port)))


class ContainerMissing(EngineError):
    """The replica's container does not exist (docker's NotFound)."""


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
            raise ContainerMissing(
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
        answers on the port while the container is stopped is someone else's. A docker
        daemon that does not answer tells nothing (None: no repair on its blip)."""
        try:
            container = self.container(replica)
        except ContainerMissing as exc:
            return Identity(False, str(exc))
        except EngineError as exc:
            return Identity(None, str(exc))
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
