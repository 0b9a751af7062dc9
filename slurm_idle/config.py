"""The configuration file (etc/slurm-idle.yaml) as frozen pydantic models, with clear errors.

A typo in a config read by cron every minute must fail loudly and precisely, so every model
forbids unknown keys and non-finite numbers (`1e400`, `.inf`), and `load_config` turns YAML
and validation problems into a one-line `ConfigError` that names the file, line or dotted field
path. A config *file* is held to what works on a real pool (see `FILE_CONTEXT`); the simulator
builds the same models in code with values only it can use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from slurm_idle import fleetspec
from slurm_idle.errors import ConfigError
from slurm_idle.yamlfile import parse_yaml, read_text

DEFAULT_CONFIG_PATH = "/etc/slurm-idle/slurm-idle.yaml"
CONFIG_ENV = "SLURM_IDLE_CONFIG"
#: Validation context of a config file (parse_config): rules that only a real pool needs.
FILE_CONTEXT = {"config_file": True}
DEFAULT_REPLICA_URL = fleetspec.DEFAULT_REPLICA_URL
#: A Slurm partition or our tag: they go into Reasons, Comments and `#SBATCH` lines.
SLURM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: A Slurm node name (what hostlist.expand_hostlist accepts, and not empty).
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: A Prometheus label name (`by (...)`) and a label value we put between quotes in PromQL.
LABEL_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")


def _http_url(value: str, what: str) -> str:
    """Only http(s) URLs: the agent talks HTTP, and `file:`/`ftp:` would make urllib read files."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in {"http", "https"} or not rest or any(
        ch.isspace() or ch in "\"'" for ch in value
    ):
        raise ValueError(f"{what} {value!r} must be an http:// or https:// URL")
    return value


class _Strict(BaseModel):
    # allow_inf_nan=False: `timeouts.start_s: 1e400` is YAML for infinity, never meant.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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


class PolicyConfig(_Strict):
    """Knobs of the planner (policy.py). Defaults are safe: service first."""

    target_utilisation: float = Field(0.8, gt=0, le=1)
    prompt_token_weight: float = Field(0.1, ge=0)
    max_lent_fraction: float = Field(1.0, ge=0, le=1)
    max_transitions_per_tick: int = Field(2, ge=1)
    scale_down_window_s: int = Field(900, ge=0)
    kv_cache_high: float = Field(0.9, gt=0, le=1)
    ttft_p95_slo_s: float | None = Field(None, gt=0)
    queue_waiting_threshold: float = Field(0.0, ge=0)
    headroom_replicas: int = Field(0, ge=0)
    learn_capacity: bool = False
    forecast: bool = True
    forecast_lead_s: float | None = Field(None, ge=0)  # default: grace + expected start + a tick
    # A queue adds replicas only once it has lasted this long (its minimum over this span is
    # above queue_waiting_threshold): one request waiting for a moment reclaims nothing.
    queue_sustain_s: int = Field(60, ge=0)
    lending_windows: tuple[str, ...] = ()  # e.g. ["20:00-08:00"]; empty = always
    timezone: str = "UTC"
    reclaim_on_unknown_metrics: bool = False
    # Adaptive headroom (issue 15): the replicas a model needs are sized for its load's level
    # and trend plus this many standard deviations of its minute-to-minute variability, all
    # three estimated over the scale-down window (policy/capacity.py `adaptive_demand`). 0 turns
    # it off. The same default holds from 1% to 10% noise because the margin scales with the
    # noise measured, not with a fixed planning factor.
    headroom_sigmas: float = Field(3.0, ge=0)
    # `slurm-idle agent` (a long-running loop instead of cron): a full tick every
    # tick_interval_s, and between ticks a fast check every fast_interval_s that only starts
    # reclaims of models under queue / KV-cache / TTFT pressure (0: no fast check).
    tick_interval_s: int = Field(60, ge=1)
    fast_interval_s: int = Field(10, ge=0)
    # Like Slurm's PreemptExemptTime: a lent node running a job younger than this is reclaimed
    # last, only when no other lent node can be (service still comes first); 0 turns it off.
    min_job_runtime_s: float = Field(0.0, ge=0)

    @field_validator("lending_windows")
    @classmethod
    def _windows_parse(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from slurm_idle.policy.windows import parse_window  # the planner's own parser

        for window in value:
            try:
                parse_window(window)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not a known time zone (e.g. Europe/Paris)") from None
        return value


class TimeoutsConfig(_Strict):
    """How long a transition may take before it is reported as stuck and retried."""

    retire_s: float = Field(300.0, gt=0)
    lend_s: float = Field(300.0, gt=0)
    reclaim_s: float = Field(600.0, gt=0)
    start_s: float = Field(900.0, gt=0)
    tick_budget_s: float = Field(50.0, gt=0)  # a cron tick gives up waiting after this


class PathsConfig(_Strict):
    """Files the agent writes: in directories only root (or the agent's user) can write, opened
    without following symlinks (safefiles)."""

    journal: str = "/var/lib/slurm-idle/journal.jsonl"
    # In a 0700 directory of its own (created by the agent), never the world-writable /run/lock.
    lock: str = "/run/slurm-idle/tick.lock"
    textfile: str | None = None  # node_exporter textfile collector .prom file
    # Prometheus file_sd_configs targets of the replica jobs (`placement: jobs`), rewritten
    # each tick (filesd.py); None: not written.
    file_sd: str | None = None


class ReportConfig(_Strict):
    """Money saved is priced at what the lent GPU-hours would cost elsewhere."""

    price_per_gpu_hour: float = Field(2.0, ge=0)
    currency: str = "USD"
    # Work lost to a preemption = min(run, this) x GPUs; unset: the whole run (an upper bound).
    checkpoint_interval_s: float | None = Field(None, gt=0)


class JobPolicyConfig(_Strict):
    """What a container job may ask of a node: checked at `submit` and again by the runner on
    the node (a user can write their own batch script, but not the node's config).

    The defaults are safe: no host network (it reaches Prometheus, the engines and every
    loopback service), bind mounts and absolute log paths only under `mount_prefixes`, and no
    job as root (a root container writes wherever its mounts point, e.g. the host's /etc).
    """

    mount_prefixes: tuple[str, ...] = ("/home", "/scratch", "/data", "/shared")
    networks: tuple[Literal["none", "host"], ...] = ("none",)
    allow_root: bool = False
    # The container engine the runner uses: rootless podman (a per-user API socket, no daemon
    # that is root on the node) or docker (its socket is root-equivalent: every researcher who
    # can use it is root on the node; choose it only where the site accepts that).
    runtime: Literal["podman", "docker"] = "podman"

    @field_validator("mount_prefixes")
    @classmethod
    def _absolute_dirs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for prefix in value:
            if not prefix.startswith("/") or prefix != os.path.normpath(prefix) or prefix == "/":
                raise ValueError(
                    f"mount prefix {prefix!r} must be an absolute, normalised directory other "
                    "than / (e.g. /scratch)"
                )
        return value


class Config(_Strict):
    """The whole etc/slurm-idle.yaml."""

    slurm: SlurmConfig = SlurmConfig()
    metrics: MetricsConfig = MetricsConfig()
    engine: EngineConfig | None = None
    models: tuple[ModelConfig, ...] = Field(..., min_length=1)
    policy: PolicyConfig = PolicyConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    paths: PathsConfig = PathsConfig()
    report: ReportConfig = ReportConfig()
    router: RouterConfig = Field(default_factory=RouterConfig)
    job_policy: JobPolicyConfig = Field(default_factory=JobPolicyConfig)
    # Derived once per Config (topology.lend_groups): the fleet's lend groups and node index.
    _groups: Any = PrivateAttr(default=None)
    _group_of: Any = PrivateAttr(default=None)

    @field_validator("models")
    @classmethod
    def _names_unique(cls, value: tuple[ModelConfig, ...]) -> tuple[ModelConfig, ...]:
        names = [m.name for m in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # model()/engine_for() would silently use the first one
            raise ValueError(f"model {twice[0]!r} is listed twice: model names must be unique")
        return value

    @model_validator(mode="after")
    def _replicas_fit_and_engines_known(self) -> Config:
        fleetspec.check_topology(self.models, self.engine)
        ports: dict[int, str] = {}
        for i, model in enumerate(self.models):
            if model.job is not None:
                for port in range(model.job.port_base, model.job.port_base + model.job.replicas):
                    if port in ports:
                        raise ValueError(f"models.{i}.job.port_base: port {port} is also one of "
                                         f"{ports[port]!r}'s replica jobs: give each model its range")
                    ports[port] = model.name
        for model in self.models:
            if model.engine is None and self.engine is None:
                raise ValueError(f"model {model.name!r} has no engine and there is no top-level engine")
        return self

    def engine_for(self, model: str) -> EngineConfig:
        m = self.model(model)
        engine = m.engine or self.engine
        assert engine is not None  # guaranteed by validation
        return engine

    def router_for(self, model: str) -> RouterConfig:
        return self.model(model).router or self.router

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise ConfigError(f"no model named {name!r} in the config")

    def model_of_node(self, node: str) -> ModelConfig | None:
        """The model of the first replica on `node` (a node may carry replicas of several)."""
        for m in self.models:
            if any(node in r.nodes for r in m.replicas):
                return m
        return None

    def replica(self, node: str) -> ReplicaConfig | None:
        """The first replica headed on `node` (the only one in a one-replica-per-node pool)."""
        for m in self.models:
            for r in m.replicas:
                if r.node == node:
                    return r
        return None

    def replicas_on(self, node: str) -> list[tuple[str, ReplicaConfig]]:
        """(model, replica) of every replica with a GPU on `node`."""
        return [(m.name, r) for m in self.models for r in m.replicas if node in r.nodes]

    @property
    def pool_nodes(self) -> tuple[str, ...]:
        """Every node that carries a replica, once, in config order."""
        return tuple(dict.fromkeys(n for m in self.models for r in m.replicas for n in r.nodes))


def resolve_config_path(path: str | None) -> str:
    """--config, else $SLURM_IDLE_CONFIG, else the system path."""
    return path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file, raising ConfigError with a one-line message."""
    text = read_text(path, "config file", f" (use --config PATH or set ${CONFIG_ENV})")
    return parse_config(text, source=str(Path(path)))


def parse_config(text: str, source: str = "<config>") -> Config:
    """Validate config text; errors name the source and the line or dotted field path."""
    data = parse_yaml(text, source, "config file")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data, context=FILE_CONTEXT)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(exc)}") from None


def describe_validation_error(exc: ValidationError) -> str:
    """The first error of a ValidationError as `dotted.path: message` (+ how many more).

    An error on a container that only echoes an error inside it (`models` too short because
    its one item failed) is not counted: the admin has one thing to fix, not two.
    """
    all_errors = exc.errors()
    locs = [tuple(e["loc"]) for e in all_errors]
    errors = [
        e for e in all_errors
        if not any(len(loc) > len(e["loc"]) and loc[: len(e["loc"])] == tuple(e["loc"]) for loc in locs)
    ] or all_errors
    first = errors[0]
    path = ".".join(str(part) for part in first["loc"]) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        message = f"unknown key {path!r}"
    elif kind == "missing":
        message = f"missing required key {path!r}"
    elif kind == "value_error":  # our own validators: their message is the whole story
        text = first["msg"].removeprefix("Value error, ")
        # ...unless it quotes a hostile value at length: one line stays a readable line.
        message = f"{path}: {text if len(text) <= 300 else text[:150] + ' ... ' + text[-100:]}"
    else:
        message = f"{path}: {first['msg']}"
        if "input" in first and kind != "value_error":
            got = repr(first["input"])  # bounded: the input may be any (large) structure
            message += f" (got {got if len(got) <= 80 else got[:80] + '...'})"
    more = len(errors) - 1
    return message + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")
