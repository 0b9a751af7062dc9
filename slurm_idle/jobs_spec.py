"""A container job spec (YAML): an image plus parameters, validated with pydantic (unknown keys are
errors), and the names, limits and exit codes a job and its batch script share.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slurm_idle.config import describe_validation_error
from slurm_idle.errors import ConfigError
from slurm_idle.runlog import cluster_key
from slurm_idle.yamlfile import parse_yaml, read_text

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Image references: registry/name:tag@digest characters only (no spaces, quotes or `$`).
IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$")
MEM_RE = re.compile(r"^[0-9]{1,12}[KMGT]?$")
# Slurm time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
TIME_RE = re.compile(r"^([0-9]{1,5}-)?[0-9]{1,7}(:[0-9]{1,2}){0,2}$")
# A log path goes on an #SBATCH line: printable, no quotes, backslashes or whitespace.
LOG_RE = re.compile(r"^[A-Za-z0-9._/%+=,@~-]{1,4096}$")
ENGINE_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock", "/run/podman/podman.sock")

DEFAULT_PARTITION = "idle"
DEFAULT_TAG = "slurm-idle"
DEFAULT_LOG = "slurm-idle-%x-%j.out"
JOB_KIND = "job"  # the comment reads "<tag>:job ..." for every job we submit
# Runner exit codes the batch script acts on (slurm_idle/runner documents all of them).
EXIT_PREEMPTED = 143  # SIGTERM: preempted or requeued; Slurm finishes the requeue
EXIT_REQUEUE_ME = 75  # SIGUSR1: time limit near, checkpointed; the script requeues the job
REQUEUE_WAIT_S = 300  # how long the batch shell waits for Slurm to requeue a preempted job

ParamValue = str | int | float | bool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mount(_Strict):
    """A host directory bind-mounted into the container."""

    source: str  # absolute path on the node (shared storage for checkpoints); ~ is the home
    target: str  # absolute path inside the container

    @field_validator("source", mode="before")
    @classmethod
    def _home(cls, value: Any) -> Any:
        return expand_home(value)

    @field_validator("source", "target")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"mount paths must be absolute, got {value!r}")
        if any(ch in value for ch in "\0\n\r:"):
            raise ValueError(f"mount path {value!r} contains a newline, NUL or ':'")
        return value

    @field_validator("source")
    @classmethod
    def _not_engine_socket(cls, value: str) -> str:
        if exposes_socket(value, ENGINE_SOCKETS) or value.endswith(".sock"):
            raise ValueError(
                f"mounting {value} would expose the container engine socket (root on the node): "
                "not allowed; mount a directory that does not contain it"
            )
        return value


def expand_home(value: Any) -> Any:
    """`~/...` as the submitting user's home (shared on a cluster, so the node's path too):
    examples then write under each researcher's own directory, not a shared fixed path."""
    if isinstance(value, str) and (value == "~" or value.startswith("~/")):
        return os.path.expanduser(value)
    return value


def exposes_socket(source: str, sockets: Sequence[str]) -> bool:
    """True when bind-mounting `source` shows one of `sockets` inside the container: the socket
    itself or any directory above it (`/`, `/run`, `/var/run`, ...). Pure path arithmetic; the
    runner repeats the check on resolved paths and the engine it really talks to."""
    src = os.path.normpath(source)
    for sock in sockets:
        sock = os.path.normpath(sock)
        if src == sock or os.path.commonpath([src, sock]) == src:
            return True
    return False


class Mounts(_Strict):
    """Inputs are read-only; outputs and the checkpoint dir are writable."""

    inputs: tuple[Mount, ...] = ()
    outputs: tuple[Mount, ...] = ()
    checkpoint: Mount | None = None


class JobSpec(_Strict):
    """One container job, as written in a job spec YAML (see etc/examples/)."""

    name: str
    image: str
    # Kubernetes semantics: `command` replaces the image ENTRYPOINT, `args` its CMD.
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    params: dict[str, ParamValue] = Field(default_factory=dict)
    # params become PARAM_<KEY> env vars and/or a JSON file at /run/slurm-idle/params.json
    params_as: tuple[Literal["env", "file"], ...] = ("env", "file")
    # Bounds far above any node, so `gpus: 1e30` is an error here, not a 31-digit --gres.
    gpus: int = Field(0, ge=0, le=1024)
    cpus: int = Field(1, ge=1, le=100_000)
    mem: str | None = None  # Slurm syntax: 4096 (MiB), 16G, ...
    time: str | None = None  # Slurm syntax: 30, 2:00:00, 1-12:00:00
    mounts: Mounts = Mounts()
    # A job restarted more often than this fails. Preemptions and retries never count (the
    # runner records why each run ended, see runlog.py): time-limit requeues and killed runs do.
    max_restarts: int = Field(20, ge=0, le=1_000_000)
    # A run whose container fails is retried this many times (requeued, after
    # retry_backoff_s, doubled each time, capped at 10 min); preemptions never use one up.
    retries: int = Field(0, ge=0, le=100)
    retry_backoff_s: float = Field(10.0, ge=0, le=600)
    # SIGTERM -> wait this long -> stop the container. Must be below the site's
    # slurm.requeue_grace_s (checked at submit) and the idle partition's GraceTime.
    grace_s: float = Field(30.0, ge=0, le=86_400)
    warn_s: int = Field(120, ge=0, le=86_400)  # SIGUSR1 this long before the time limit (0: none)
    network: Literal["none", "host"] = "none"
    workdir: str | None = None  # working directory inside the container
    log: str = DEFAULT_LOG  # sbatch --output (one file across restarts: --open-mode=append)

    @model_validator(mode="before")
    @classmethod
    def _stringify_env(cls, data: Any) -> Any:
        # YAML turns `THREADS: 4` into an int; env values are strings in the end anyway.
        if isinstance(data, Mapping) and isinstance(data.get("env"), Mapping):
            data = dict(data)
            data["env"] = {
                k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in data["env"].items()
            }
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError(
                f"job name {value!r} must be 1-63 characters of letters, digits, '.', '_' or '-'"
            )
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if not IMAGE_RE.match(value):
            raise ValueError(f"{value!r} is not an image reference (e.g. registry/name:tag)")
        return value

    @field_validator("env", "params")
    @classmethod
    def _env_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if not ENV_NAME_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return value

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        if value is not None and not MEM_RE.match(value):
            raise ValueError(f"mem {value[:40]!r} must look like 4096, 512M or 16G (at most 12 digits)")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not TIME_RE.match(value):
            raise ValueError(f"time {value[:40]!r} must look like 30, 2:00:00 or 1-12:00:00")
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"workdir must be absolute, got {value!r}")
        return value

    @field_validator("log", mode="before")
    @classmethod
    def _log_home(cls, value: Any) -> Any:
        return expand_home(value)

    @field_validator("log")
    @classmethod
    def _log(cls, value: str) -> str:
        if not LOG_RE.match(value):
            raise ValueError(
                f"log path {value!r} may only hold letters, digits and ._/%+=,@~- (no spaces)"
            )
        return value

    @model_validator(mode="after")
    def _fits(self) -> JobSpec:
        self._check_params_env()
        self._check_warning()
        return self

    def _check_params_env(self) -> None:
        # PARAM_<KEY> is upper-cased: lr and LR would silently become one variable, and a
        # PARAM_* key of env would be overwritten by the parameter of the same name.
        seen: dict[str, str] = {}
        for key in self.params:
            var = f"PARAM_{key.upper()}"
            if var in seen:
                raise ValueError(
                    f"params {seen[var]!r} and {key!r} both become {var}: rename one of them"
                )
            seen[var] = key
            if var in self.env and "env" in self.params_as:
                raise ValueError(
                    f"env {var} collides with params.{key} (set as {var}): keep only one"
                )

    def _check_warning(self) -> None:
        if not self.warn_s:
            return
        if self.grace_s >= self.warn_s:
            raise ValueError(
                f"warn_s {self.warn_s} must exceed grace_s {self.grace_s:g}: the checkpoint after "
                "the time-limit warning would still run when the limit ends the job"
            )
        limit = time_limit_s(self.time) if self.time else None
        # A warning due at or before the start would requeue every run at once. A short run
        # before the warning stays allowed (slurmctld sends it on a ~30 s beat anyway).
        if limit and self.warn_s >= limit:
            raise ValueError(
                f"warn_s {self.warn_s} is not below the time limit (time {self.time!r} = "
                f"{limit} s): every run would be warned and requeued at once; lower warn_s or "
                "raise time"
            )

    def for_job(self, job_id: str, cluster: str = "") -> JobSpec:
        """The spec with `{job_id}` and `{cluster}` (Slurm's ClusterName) in mount sources
        replaced: stable across requeues, and apart on two clusters, whose job ids both
        start at 1."""
        key = cluster_key(cluster) or "default"

        def sub(m: Mount) -> Mount:
            source = m.source.replace("{job_id}", job_id).replace("{cluster}", key)
            return m.model_copy(update={"source": source})

        mounts = Mounts(
            inputs=tuple(sub(m) for m in self.mounts.inputs),
            outputs=tuple(sub(m) for m in self.mounts.outputs),
            checkpoint=sub(self.mounts.checkpoint) if self.mounts.checkpoint else None,
        )
        return self.model_copy(update={"mounts": mounts})

    def param_env(self) -> dict[str, str]:
        """params as PARAM_<KEY> environment variables (booleans as true/false)."""
        if "env" not in self.params_as:
            return {}
        return {f"PARAM_{k.upper()}": _param_str(v) for k, v in self.params.items()}


def time_limit_s(value: str) -> int:
    """Seconds of a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); 0 means none."""
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, sec = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def _param_str(value: ParamValue) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def parse_job_spec(data: Any, source: str = "<job spec>") -> JobSpec:
    """Validate one job spec mapping; errors are ConfigError naming the source and field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a job spec must be a mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(exc)}") from None


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Load a YAML file, turning I/O and syntax problems into one-line ConfigErrors."""
    return parse_yaml(read_text(path), str(Path(path)))


def load_job_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a job spec YAML file."""
    return parse_job_spec(read_yaml(path), source=str(path))
