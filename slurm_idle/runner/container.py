"""Container setup for the in-job runner: what the container is created with, and the host side.

Pure parts (the step environment, the container's environment, GPUs and create() arguments)
are apart from the few engine calls (the image as job_policy.pull allows, sweeping leftovers)
and host checks (mount sources, the engine socket). See the package docstring for the rules
they follow.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from slurm_idle.errors import SlurmIdleError
from slurm_idle.jobs import ENGINE_SOCKETS, JobSpec, exposes_socket

LABEL_MANAGED = "slurm-idle.managed"
LABEL_JOB = "slurm-idle.job-id"
LABEL_RESTART = "slurm-idle.restart"
LABEL_NAME = "slurm-idle.name"
PARAMS_TARGET = "/run/slurm-idle/params.json"

GpuMode = Literal["auto", "nvidia", "env", "off"]
PullPolicy = Literal["never", "missing", "always"]  # the node's job_policy.pull
# What answers the docker SDK calls the runner makes: an engine's API, or ch-run children
# (charliecloud.py).
Engine = Literal["docker", "podman", "charliecloud"]


class Say(Protocol):
    """Where runner messages go (supervise.Reporter)."""

    def say(self, message: str) -> None: ...


@dataclass(frozen=True)
class SlurmContext:
    """What the runner learns from the job step's environment."""

    job_id: str = ""  # empty when run by hand outside Slurm
    restart_count: int = 0
    gpus: tuple[str, ...] = ()  # node-level GPU indexes Slurm allocated
    cuda_visible_devices: str | None = None
    job_name: str = ""
    cluster: str = ""  # SLURM_CLUSTER_NAME: with the job id, names the completion marker and the run ledger
    node: str = ""  # SLURMD_NODENAME: named in messages an admin acts on (a missing image)


def slurm_context(environ: Mapping[str, str]) -> SlurmContext:
    """Parse the step environment (pure)."""
    gpu_list = ""
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        if environ.get(key):
            gpu_list = environ[key]
            break
    gpus = tuple(g for g in gpu_list.split(",") if g and g != "NoDevFiles")
    try:
        restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        restarts = 0
    return SlurmContext(
        job_id=environ.get("SLURM_JOB_ID", ""),
        restart_count=restarts,
        gpus=gpus,
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        job_name=environ.get("SLURM_JOB_NAME", ""),
        cluster=environ.get("SLURM_CLUSTER_NAME", ""),
        node=environ.get("SLURMD_NODENAME", ""),
    )


def mem_bytes(mem: str) -> int:
    """Slurm memory syntax (plain number = MiB) to bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if mem[-1] in units:
        return int(mem[:-1]) * units[mem[-1]]
    return int(mem) << 20


def container_name(ctx: SlurmContext, spec: JobSpec) -> str:
    if ctx.job_id:
        return f"slurm-idle-{ctx.job_id}-r{ctx.restart_count}"
    return f"slurm-idle-{spec.name}-{os.getpid()}"


def container_env(
    spec: JobSpec, ctx: SlurmContext, use_device_requests: bool, params_in_file: bool
) -> dict[str, str]:
    """The container's environment: spec env, params, then what the runner adds."""
    env = {**spec.env, **spec.param_env()}
    env["SLURM_RESTART_COUNT"] = str(ctx.restart_count)
    if ctx.job_id:
        env["SLURM_JOB_ID"] = ctx.job_id
    if spec.mounts.checkpoint:
        env["CHECKPOINT_DIR"] = spec.mounts.checkpoint.target
    if params_in_file:
        env["SLURM_IDLE_PARAMS_FILE"] = PARAMS_TARGET
    env.update(gpu_env(ctx, use_device_requests))
    return env


def gpu_env(ctx: SlurmContext, use_device_requests: bool) -> dict[str, str]:
    """The GPU variables the runner imposes, whatever the spec or the image set.

    NVIDIA_VISIBLE_DEVICES is what the nvidia runtime reads (an image's `all` would otherwise
    expose every GPU of the node): the allocated indexes, the same as the device request, or
    `void` for none. CUDA_VISIBLE_DEVICES follows: with device requests the container sees only
    its GPUs, numbered from 0; without, Slurm's own value (or the indexes); none: empty.
    """
    if not ctx.gpus:
        return {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    indexes = ",".join(ctx.gpus)
    if use_device_requests:
        cuda = ",".join(str(i) for i in range(len(ctx.gpus)))
    else:
        cuda = ctx.cuda_visible_devices or indexes
    return {
        "SLURM_IDLE_GPUS": indexes, "NVIDIA_VISIBLE_DEVICES": indexes, "CUDA_VISIBLE_DEVICES": cuda,
    }


def container_kwargs(
    spec: JobSpec,
    ctx: SlurmContext,
    *,
    uid: int,
    gid: int,
    use_device_requests: bool,
    params_file: str | None,
) -> dict[str, Any]:
    """Keyword arguments for `client.containers.create` (pure: no engine call)."""
    from docker.types import DeviceRequest, Mount

    mounts = [Mount(m.target, m.source, type="bind", read_only=True) for m in spec.mounts.inputs]
    mounts += [Mount(m.target, m.source, type="bind") for m in spec.mounts.outputs]
    if spec.mounts.checkpoint:
        c = spec.mounts.checkpoint
        mounts.append(Mount(c.target, c.source, type="bind"))
    if params_file:
        mounts.append(Mount(PARAMS_TARGET, params_file, type="bind", read_only=True))
    kwargs: dict[str, Any] = {
        "image": spec.image,
        "name": container_name(ctx, spec),
        "environment": container_env(spec, ctx, use_device_requests, params_file is not None),
        "mounts": mounts,
        "user": f"{uid}:{gid}",
        "network_mode": spec.network,
        "init": True,  # tini as PID 1 forwards SIGTERM; a bare PID 1 would ignore it
        "privileged": False,
        "security_opt": ["no-new-privileges"],
        "labels": {
            LABEL_MANAGED: "true",
            LABEL_JOB: ctx.job_id or "none",
            LABEL_RESTART: str(ctx.restart_count),
            LABEL_NAME: spec.name,
        },
        "nano_cpus": spec.cpus * 1_000_000_000,
    }
    if spec.command is not None:
        kwargs["entrypoint"] = list(spec.command)
    if spec.args is not None:
        kwargs["command"] = list(spec.args)
    if spec.workdir:
        kwargs["working_dir"] = spec.workdir
    if spec.mem:
        kwargs["mem_limit"] = mem_bytes(spec.mem)
    if use_device_requests and ctx.gpus:
        kwargs["device_requests"] = [
            DeviceRequest(driver="nvidia", device_ids=list(ctx.gpus), capabilities=[["gpu"]])
        ]
    return kwargs


def wants_device_requests(mode: GpuMode, runtimes: Sequence[str]) -> bool:
    """Device requests only when asked for, or (auto) when the engine has an nvidia runtime."""
    return mode == "nvidia" or (mode == "auto" and "nvidia" in runtimes)


def remove_job_containers(client: Any, job_id: str) -> list[str]:
    """Remove every container labelled with this job id (leftovers of a killed run)."""
    removed = []
    for c in client.containers.list(all=True, filters={"label": [f"{LABEL_JOB}={job_id}"]}):
        c.remove(force=True)
        removed.append(c.name)
    return removed


def prepare_host_dirs(spec: JobSpec, engine_sockets: Sequence[str]) -> None:
    for m in spec.mounts.inputs:
        if not os.path.exists(m.source):
            raise SlurmIdleError(f"input {m.source} does not exist on {os.uname().nodename}")
    writable = list(spec.mounts.outputs)
    if spec.mounts.checkpoint:
        writable.append(spec.mounts.checkpoint)
    for m in writable:
        os.makedirs(m.source, exist_ok=True)
    check_no_engine_socket(spec, engine_sockets)


def check_no_engine_socket(spec: JobSpec, engine_sockets: Sequence[str]) -> None:
    """Refuse a mount that would show the engine's socket inside the container.

    The spec was checked at submit time against the usual socket paths; here the check runs on
    resolved paths (a symlinked source, /var/run -> /run) and on the socket this runner
    really talks to (DOCKER_HOST), which may live anywhere (e.g. under /tmp).
    """
    sockets = [os.path.realpath(s) for s in engine_sockets]
    mounts = [*spec.mounts.inputs, *spec.mounts.outputs]
    if spec.mounts.checkpoint:
        mounts.append(spec.mounts.checkpoint)
    for m in mounts:
        if exposes_socket(os.path.realpath(m.source), sockets):
            raise SlurmIdleError(
                f"mount {m.source} would expose the container engine socket inside the "
                "container: refusing to start it (mount a directory that does not contain it)"
            )


def engine_sockets(docker_host: str | None) -> tuple[str, ...]:
    """The socket paths to keep out of containers: the usual ones and DOCKER_HOST's."""
    extra = docker_host[len("unix://"):] if docker_host and docker_host.startswith("unix://") else None
    return ENGINE_SOCKETS + ((extra,) if extra else ())


def write_params(spec: JobSpec) -> tuple[str | None, str | None]:
    """A private dir holding params.json when params go to a file: (dir, file)."""
    if "file" not in spec.params_as or not spec.params:
        return None, None
    tmp = tempfile.mkdtemp(prefix="slurm-idle-params-")
    path = os.path.join(tmp, "params.json")
    Path(path).write_text(json.dumps(spec.params, indent=2, sort_keys=True) + "\n")
    os.chmod(path, 0o444)
    os.chmod(tmp, 0o755)
    return tmp, path


class ImageMissing(SlurmIdleError):
    """The job's image is not on the node and job_policy.pull is never."""


#: How an admin puts an image on a node, per engine: a rootless podman store is the job's
#: user's own, so root loading it into docker's (or root's podman's) would not help.
LOAD_HINTS: dict[Engine, str] = {
    "docker": "docker load -i IMAGE.tar on that node",
    "podman": "podman load -i IMAGE.tar as the job's user on that node",
    "charliecloud": ("ch-convert -i docker IMAGE DIR where docker has the image, or unpack a "
                     "`docker export` of a container of it into DIR, on that node"),
}


def ensure_image(client: Any, image: str, report: Say, pull: PullPolicy = "missing",
                 node: str = "", engine: Engine = "docker") -> None:
    """Have `image` on the node as job_policy.pull says: `never` only looks in the engine's
    store (no registry is asked, not even its name resolved) and raises ImageMissing, one line
    naming the image, the node and how to load it; `missing` pulls what is absent; `always`
    pulls every run.

    One rule for every engine the runner drives through the docker SDK: docker and Podman's
    compatible API (4.3, measured) both answer an absent image with a 404 saying "No such
    image" (Podman rewrites its own "image not known" for docker-py), which the SDK raises as
    ImageNotFound. Any other error is the engine's, reported as it is. Charliecloud has no
    store and no registry: its image is a directory (named in the ImageNotFound), never pulled.
    """
    import docker.errors

    if pull != "always":
        try:
            client.images.get(image)
            return
        except docker.errors.ImageNotFound as exc:
            where = node or socket.gethostname()
            if engine == "charliecloud":
                raise ImageMissing(
                    f"image {image} is not on node {where}: charliecloud runs it from the "
                    f"directory {exc.explanation}, which is not there (no registry is asked): "
                    f"make it there first ({LOAD_HINTS[engine]})") from None
            if pull == "never":
                raise ImageMissing(
                    f"image {image} is not on node {where} and job_policy.pull is never (no "
                    f"registry is asked): load it there first ({LOAD_HINTS[engine]})") from None
    report.say(f"pulling {image}")
    client.images.pull(image)
