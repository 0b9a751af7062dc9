"""The sections of the external systems: `slurm`, `metrics`, `gpu`, `engine` and `router`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from slurm_idle.config.base import (
    LABEL_NAME_RE,
    LABEL_VALUE_RE,
    METRIC_NAME_RE,
    SLURM_NAME_RE,
    _http_url,
    _Strict,
)


class SlurmConfig(_Strict):
    """How to talk to Slurm and which partitions/tags are ours."""

    backend: Literal["cli", "pyslurm", "auto"] = "cli"
    lend_partition: str = "idle"
    serve_partition: str = "inference"
    tag: str = "slurm-idle"
    command_timeout_s: float = Field(30.0, gt=0)
    # At reclaim every job on the node is warned, then given this long before it is requeued
    # (like the idle partition's GraceTime at preemption): our container jobs get SIGTERM on
    # their steps, plain jobs their own `--signal` or default_job_signal (without either they
    # are requeued at once: SIGTERM, KillWait, SIGKILL), srun/salloc jobs are then cancelled.
    # Waited within the tick's deadline (eviction.py); `config check` wants it < tick_budget_s.
    requeue_grace_s: float = Field(30.0, ge=0)
    # At reclaim, a plain sbatch job without its own `--signal` (read from its batch script)
    # gets this one, in sbatch's form (`B:USR2` to the batch shell, `USR2` to its steps), then
    # requeue_grace_s, then the requeue; unset: requeued at once (SIGTERM, KillWait, SIGKILL).
    # srun/salloc jobs (Slurm cannot requeue them) get it too, or SIGTERM, then are cancelled.
    default_job_signal: str | None = None
    # At reclaim, a job on the node that is neither the lend partition's nor one of our replica
    # jobs (a job of the serve partition, which preempts lent jobs, or of any other partition)
    # gets SIGTERM, requeue_grace_s, then is cancelled (or requeued: a batch job only, srun/
    # salloc are cancelled). Cancel by default: a requeued job of the serve partition would
    # start on the next lent node and hold that one's reclaim up in turn. Service first.
    foreign_job_action: Literal["cancel", "requeue"] = "cancel"
    bin_dir: str | None = None  # where sinfo/scontrol/... live, if not on PATH
    # placement jobs: a node feature naming one node (`{node}`, e.g. Features=gpu01 in
    # slurm.conf). With it, on Slurm >= 22.05 a steered replica job gets `--prefer=FEATURE`
    # (soft: Slurm may still place it elsewhere) instead of `--nodelist=NODE` (hard).
    prefer_feature: str | None = None

    @field_validator("prefer_feature")
    @classmethod
    def _prefer_template(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                filled = value.format(node="n")
            except (KeyError, IndexError, ValueError):
                raise ValueError(f"prefer_feature {value!r}: the only placeholder is {{node}}") from None
            if not filled or any(c.isspace() or c in ",&|[]*" for c in filled):
                raise ValueError(f"prefer_feature {value!r} must be one feature name (e.g. \"{{node}}\")")
        return value

    @field_validator("default_job_signal")
    @classmethod
    def _signal_form(cls, value: str | None) -> str | None:
        from slurm_idle.slurm.parse import parse_signal_option

        if value is not None and parse_signal_option(value) is None:
            raise ValueError(f"{value!r} is not a signal in sbatch's --signal form "
                             "(e.g. USR2, B:USR2, TERM)")
        return value

    @field_validator("lend_partition", "serve_partition", "tag")
    @classmethod
    def _slurm_name(cls, value: str, info: ValidationInfo) -> str:
        # An empty tag would make every Reason "ours" (`:serving`); a space or newline would
        # break the Reason/Comment we parse back and the `#SBATCH` lines we render.
        if not SLURM_NAME_RE.match(value):
            raise ValueError(
                f"{info.field_name} {value!r} must be 1-63 letters, digits, '.', '_' or '-'"
            )
        return value

    @model_validator(mode="after")
    def _partitions_differ(self) -> SlurmConfig:
        if self.lend_partition == self.serve_partition:
            raise ValueError(
                f"lend_partition and serve_partition are both {self.lend_partition!r}: lent "
                "GPUs must go to a partition of their own (the preemptible one)"
            )
        return self


class MetricsConfig(_Strict):
    """Where engine metrics come from and how fresh they must be."""

    source: Literal["prometheus", "scrape"] = "prometheus"
    prometheus_url: str = "http://127.0.0.1:9090"
    query_timeout_s: float = Field(10.0, gt=0)
    rate_window_s: int = Field(60, ge=5)
    staleness_s: float = Field(120.0, gt=0)
    job_label: str | None = None  # restrict Prometheus queries to one scrape job, if set
    # The label naming a series' scrape target (host:port, or the node name after relabelling).
    instance_label: str = "instance"
    # scrape source: where the previous scrape is kept so rates span the time between ticks
    # (None: scrape each replica twice, scrape_interval_s apart, within the tick).
    scrape_state: str | None = None
    scrape_interval_s: float = Field(1.0, gt=0)
    scrape_timeout_s: float = Field(5.0, gt=0)
    # source: prometheus only: when Prometheus does not answer, scrape the serving replicas'
    # /metrics directly in the same tick (enough to reclaim; nothing is lent on it).
    fallback_scrape: bool = True

    @field_validator("prometheus_url")
    @classmethod
    def _http(cls, value: str) -> str:
        return _http_url(value, "prometheus_url")

    @field_validator("job_label")
    @classmethod
    def _label_value(cls, value: str | None) -> str | None:
        # It is put between quotes in every PromQL query: a quote or brace would rewrite them.
        if value is not None and not LABEL_VALUE_RE.match(value):
            raise ValueError(
                f"job_label {value!r} may only hold letters, digits and _.:/@+- (it goes into "
                "PromQL queries)"
            )
        return value

    @field_validator("instance_label")
    @classmethod
    def _label_name(cls, value: str) -> str:
        if not LABEL_NAME_RE.match(value):
            raise ValueError(f"instance_label {value!r} is not a Prometheus label name")
        return value


class GpuConfig(_Strict):
    """Where the GPUs' memory is read: the site's GPU exporter, through the Prometheus of
    `metrics` (metrics/gpus.py). Defaults are dcgm-exporter's names; other exporters (e.g.
    `nvidia_gpu_memory_used_bytes`) are named here, in MiB or bytes."""

    # MiB a GPU may hold beyond its engine's own residue and still count as free.
    free_tolerance_mib: int = Field(1024, ge=0)
    # The most an asleep or stopped engine may leave on a GPU it lends.
    max_residue_mib: int = Field(4096, ge=0)
    used_metric: str = "DCGM_FI_DEV_FB_USED"
    # Total = used + free; `total_metric` instead where the exporter has the total (null: unknown).
    free_metric: str | None = "DCGM_FI_DEV_FB_FREE"
    total_metric: str | None = None
    unit: Literal["mib", "bytes"] = "mib"
    node_label: str = "Hostname"  # the node's name (or FQDN, or host:port) in each series
    index_label: str = "gpu"  # the GPU's index on its node
    # The job the exporter maps to the GPU (dcgm-exporter's HPC job mapping); null: none.
    holder_label: str | None = "hpc_job"
    # How old a reading may already be when Prometheus scrapes it (dcgm-exporter's
    # --collect-interval, 30 s by default): a reading counts as taken after an event (an
    # engine's sleep, a node emptied) only when scraped this long after it.
    sample_lag_s: float = Field(30.0, ge=0)

    @field_validator("used_metric", "free_metric", "total_metric")
    @classmethod
    def _metric_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        # It goes into PromQL as it is: anything but a metric name would rewrite the query.
        if value is not None and not METRIC_NAME_RE.match(value):
            raise ValueError(f"{info.field_name} {value!r} is not a Prometheus metric name")
        return value

    @field_validator("node_label", "index_label", "holder_label")
    @classmethod
    def _label_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not LABEL_NAME_RE.match(value):
            raise ValueError(f"{info.field_name} {value!r} is not a Prometheus label name")
        return value


class EngineConfig(_Strict):
    """How a vLLM replica is stopped and started on a node.

    `command`: admin-supplied shell commands with `{node}`, `{url}`, `{model}`, `{port}`,
    `{index}` placeholders, run once per replica.
    `docker`: a named container per replica via the docker SDK (`container` is a template with
    `{node}`, `{model}`, `{index}`, `{port}`).
    `http-sleep`: vLLM sleep mode (`POST /sleep?level=..&mode=wait`, `POST /wake_up`).
    """

    kind: Literal["command", "docker", "http-sleep"] = "command"
    start_command: str | None = None
    stop_command: str | None = None
    container: str = "vllm-{node}"
    docker_host: str | None = None  # default: DOCKER_HOST / the local socket
    sleep_level: int = 1  # only 1 works: see _sleep_level_one
    drain_timeout_s: float = Field(120.0, ge=0)  # wait for in-flight requests before stopping
    start_timeout_s: float = Field(600.0, gt=0)  # cold start / wake until /health and awake
    # What a start or wake usually takes, for the forecast's lead time (policy.forecast_lead_s);
    # unset: 300 s (a cold start), or 30 s for http-sleep (a wake).
    expected_start_s: float = Field(300.0, ge=0)
    stop_timeout_s: float = Field(60.0, ge=0)
    http_timeout_s: float = Field(5.0, gt=0)
    # Wakes or starts tried on one replica before it is given up on (at least 1).
    wake_attempts: int = Field(3, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _start_estimate_by_kind(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("expected_start_s") is None:
            data = {k: v for k, v in data.items() if k != "expected_start_s"}
            if data.get("kind") == "http-sleep":
                data["expected_start_s"] = 30.0
        return data

    @field_validator("sleep_level")
    @classmethod
    def _sleep_level_one(cls, value: int) -> int:
        # Level 2 discards the weights too; the engine's start only calls /wake_up, which
        # would leave a level-2 replica without weights (it needs a reload slurm-idle never does).
        if value != 1:
            raise ValueError(
                f"sleep_level must be 1 (got {value}): level 2 discards the weights and "
                "slurm-idle's start only calls /wake_up, which does not reload them"
            )
        return value

    @model_validator(mode="after")
    def _commands_present(self) -> EngineConfig:
        if self.kind == "command" and not (self.start_command and self.stop_command):
            raise ValueError("engine kind 'command' needs both start_command and stop_command")
        return self


class RouterConfig(_Strict):
    """The request router in front of the replicas (issue 14), told before a replica stops.

    `none`: nobody is told (clients may see errors while a replica drains and stops);
    `haproxy`: the runtime API on the admin socket (`set server B/S state drain|ready`);
    `file`: the serving set written to `path` (JSON, YAML or a line template), atomically,
    then `reload_command`; `command`: `remove_command`/`add_command` (+ `state_command`).
    Placeholders everywhere: `{name}`, `{node}`, `{model}`, `{url}`, `{host}`, `{port}`.
    """

    kind: Literal["none", "haproxy", "file", "command"] = "none"
    timeout_s: float = Field(5.0, gt=0)  # one router call (socket, command, reload)
    # STARTING -> SERVING: a completion of this prompt (max_tokens 1) must succeed first.
    warmup_prompt: str | None = None
    warmup_timeout_s: float = Field(60.0, gt=0)
    # haproxy
    admin_socket: str | None = None  # unix socket path (`stats socket ... level admin`)
    backend: str = "vllm"
    server: str = "{node}"
    # file
    path: str | None = None
    format: Literal["json", "yaml", "template"] = "json"
    header: str = ""
    line: str = "{url}\n"  # per serving replica, format `template`
    footer: str = ""
    reload_command: str | None = None
    # command
    remove_command: str | None = None
    add_command: str | None = None
    state_command: str | None = None  # prints the names (or urls) now in the router, one a line

    @model_validator(mode="after")
    def _kind_needs(self) -> RouterConfig:
        need = {"haproxy": ("admin_socket",), "file": ("path",),
                "command": ("remove_command", "add_command")}.get(self.kind, ())
        missing = [k for k in need if not getattr(self, k)]
        if missing:
            raise ValueError(f"router kind {self.kind!r} needs {' and '.join(missing)}")
        return self

