"""The fleet: `models`, each with its replicas (where they run, their endpoints) or replica jobs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from slurm_idle import fleetspec
from slurm_idle.config.adapters import EngineConfig, RouterConfig
from slurm_idle.config.base import (
    NODE_NAME_RE,
    SLURM_NAME_RE,
    _http_url,
    _Strict,
)


class ReplicaConfig(_Strict):
    """One vLLM replica: the GPUs it runs on (a node, part of one, or several) and its endpoint.

    `node` is its head (where `url` points and where per-node commands aim); `nodes` every node
    it spans (default: just `node`); `gpus` its GPU indexes on each node (None: the whole
    node); `index` its position among the replicas on its head node (`{index}` in templates);
    `name` unique in the config (the node for a whole-node replica, else `node:port`).
    """

    node: str
    url: str
    nodes: tuple[str, ...] = ()
    gpus: tuple[int, ...] | None = None
    port: int | None = None
    index: int = Field(0, ge=0)
    name: str = ""

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        return fleetspec.replica_fields(data)

    @property
    def gpus_text(self) -> str:
        return fleetspec.format_gpus(self.gpus)

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        if not NODE_NAME_RE.match(value):
            raise ValueError(f"node {value!r} is not a Slurm node name")
        return value

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        return _http_url(value, "url")


class ReplicaJobConfig(_Strict):
    """`placement: jobs`: each replica of the model is one Slurm batch job (see replicajobs.py).

    Replica `index` (0..replicas-1) listens on `port_base + index`; `command` runs under srun in
    the job with `{port}`, `{model}` and `{index}` filled in (or a site's own `script`, which
    gets them as SLURM_IDLE_PORT/MODEL/INDEX). `url` says where the replica answers once Slurm
    has placed it (`{node}`: its head node, `{port}`).
    """

    replicas: int = Field(ge=1, le=10_000)
    gpus_per_replica: int | None = Field(None, ge=1, le=1024)  # default: the model's
    nodes_per_replica: int = Field(1, ge=1, le=1024)
    cpus: int | None = Field(None, ge=1, le=100_000)  # --cpus-per-task
    mem: str | None = None  # --mem, e.g. 64G
    time: str | None = None  # --time, e.g. 7-00:00:00
    partition: str | None = None  # default: slurm.serve_partition
    sbatch_args: tuple[str, ...] = ()
    command: str | None = None
    script: str | None = None
    port_base: int = Field(8000, gt=0, lt=65536)
    url: str = "http://{node}:{port}"
    # Slurm's delay from `sbatch` of a replica job to its start, GraceTime aside (the pass
    # that preempts and the one that starts it): part of a reclaim's lead time. A few seconds
    # on an idle controller (measured on the sandbox); more on a busy one.
    expected_queue_s: float = Field(5.0, ge=0, le=3600)

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9]+[KMGT]?", value):
            raise ValueError(f"mem {value!r} must be sbatch's --mem form, e.g. 64G or 16000")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9]+(-[0-9]+)?(:[0-9]+){0,2}|UNLIMITED|INFINITE",
                                                  value):
            raise ValueError(f"time {value!r} must be sbatch's --time form, e.g. 7-00:00:00")
        return value

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_NAME_RE.match(value):
            raise ValueError(f"partition {value!r} must be 1-63 letters, digits, '.', '_' or '-'")
        return value

    @field_validator("sbatch_args")
    @classmethod
    def _args(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from slurm_idle.replicajobs import check_sbatch_args

        check_sbatch_args(value)
        return value

    @field_validator("script")
    @classmethod
    def _script(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"script {value!r} must be an absolute path")
        return value

    @model_validator(mode="after")
    def _one_command(self) -> ReplicaJobConfig:
        from slurm_idle.replicajobs import check_templates

        if (self.command is None) == (self.script is None):
            raise ValueError("job: give exactly one of `command` (run by srun) or `script` (a "
                             "batch script file of your own)")
        if self.port_base + self.replicas - 1 > 65535:
            raise ValueError(f"job.port_base {self.port_base} + replicas {self.replicas} runs past "
                             "port 65535")
        check_templates(self.command, self.url)
        return self


class ModelConfig(_Strict):
    """One served model and its replicas (see fleetspec.py for the forms a config may use)."""

    #: Keys `_expand_nodes` turns into `replicas` (fleetspec.expand_model): valid, not fields,
    #: so `config check` suggests them for a typo (`node:` -> `nodes`).
    shorthand_keys: ClassVar[tuple[str, ...]] = ("nodes", "url", "replicas_per_node", "ports")

    name: str = Field(min_length=1, max_length=256)
    gpus_per_replica: int = Field(4, ge=1, le=1024)
    # GPUs each node of this model has (optional): checked against the replicas' GPUs here and
    # against Slurm's gres at run time.
    gpus_per_node: int | None = Field(None, ge=1, le=1024)
    tokens_per_s_per_replica: float = Field(2000.0, gt=0, le=1e9)
    min_serving_replicas: int = Field(1, ge=0, le=100_000)
    replicas: tuple[ReplicaConfig, ...] = ()
    engine: EngineConfig | None = None  # overrides the top-level engine for this model
    router: RouterConfig | None = None  # overrides the top-level router for this model
    # nodes: vLLM outside Slurm on drained nodes (`replicas:`); jobs: each replica a Slurm job
    # in the serve partition (`job:`), lent GPU by GPU (replicajobs.py).
    placement: Literal["nodes", "jobs"] = "nodes"
    job: ReplicaJobConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _expand_nodes(cls, data: Any) -> Any:
        # `nodes: gpu[1-4]` + `url: http://{node}:8000` (+ `replicas_per_node`, `ports`) is
        # shorthand for a replica list. Errors are ValueErrors: `models.N: ...`, exit 2.
        if isinstance(data, Mapping):
            return fleetspec.expand_model(dict(data))
        return data

    @model_validator(mode="after")
    def _gpus_fit(self) -> ModelConfig:
        for i, r in enumerate(self.replicas):
            if r.gpus is not None and self.gpus_per_node is not None and max(r.gpus) >= self.gpus_per_node:
                raise ValueError(
                    f"replicas.{i}.gpus: GPU {max(r.gpus)} of {r.node} is beyond gpus_per_node "
                    f"{self.gpus_per_node} (indexes run 0-{self.gpus_per_node - 1})"
                )
        if self.gpus_per_node is not None:
            per_node: dict[str, int] = {}
            for r in self.replicas:
                for n in r.nodes:
                    per_node[n] = per_node.get(n, 0) + (
                        len(r.gpus) if r.gpus is not None else self.gpus_per_replica // len(r.nodes))
            over = sorted(n for n, g in per_node.items() if g > self.gpus_per_node)
            if over:
                raise ValueError(
                    f"gpus_per_node: {over[0]} carries {per_node[over[0]]} GPUs of replicas, more "
                    f"than its {self.gpus_per_node} (gpus_per_replica x replicas_per_node)"
                )
        return self

    @model_validator(mode="after")
    def _placement_fits(self) -> ModelConfig:
        if self.placement == "jobs":
            if self.job is None:
                raise ValueError("job: placement jobs needs a `job:` block (replicas, command or "
                                 "script, ...)")
            if self.replicas:
                raise ValueError("replicas: placement jobs takes no `nodes:`/`replicas:` (Slurm "
                                 "places the replica jobs); give `job.replicas: N`")
        elif self.job is not None:
            raise ValueError("job: a `job:` block needs `placement: jobs`")
        return self

    @property
    def job_gpus_per_replica(self) -> int:
        """GPUs of one replica job (jobs placement): job.gpus_per_replica, else the model's."""
        return (self.job.gpus_per_replica if self.job and self.job.gpus_per_replica
                else self.gpus_per_replica)

    @field_validator("min_serving_replicas")
    @classmethod
    def _serving_floor(cls, value: int, info: ValidationInfo) -> int:
        # A model lent down to zero replicas has no vLLM left to report its load: its
        # metrics are unknown, and on unknown metrics nothing is reclaimed. Only the
        # simulator (which reads the load from its trace) may plan with 0.
        if value < 1 and info.context and info.context.get("config_file"):
            raise ValueError(
                f"must be at least 1 (got {value}): with no replica serving, the model has no "
                "metrics, so slurm-idle could never see its load return and reclaim a node"
            )
        return value


def _node_names(nodes: Any) -> list[str]:
    """The `nodes:` shorthand (a Slurm hostlist or a list of names) as node names."""
    return fleetspec.node_names(nodes)
