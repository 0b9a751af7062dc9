"""The configuration file (etc/slurm-idle.yaml) as frozen pydantic models, with clear errors.

One module per group of sections (base, adapters, models, sections); this one holds the whole
`Config` and its loading (error wording: problems.py; `config show`: provenance.py), and
re-exports every model so `from slurm_idle.config import X` is the one import callers use.

A typo in a config read by cron every minute must fail loudly and precisely, so every model
forbids unknown keys and non-finite numbers (`1e400`, `.inf`), and `load_config` turns a YAML
problem into a one-line `ConfigError` and validation problems into `ConfigInvalid`: one line
per problem, in file order, each naming the file, line, column, dotted field path and, for a
typo, the key meant. An admin fixes them all in one round, not one `config check` per
mistake. A config *file* is held to what works on a real pool (see `FILE_CONTEXT`); the simulator
builds the same models in code with values only it can use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from slurm_idle import fleetspec
from slurm_idle.config.adapters import (
    EngineConfig,
    GpuConfig,
    MetricsConfig,
    RouterConfig,
    SlurmConfig,
)
from slurm_idle.config.base import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    DEFAULT_REPLICA_URL,
    FILE_CONTEXT,
    LABEL_NAME_RE,
    LABEL_VALUE_RE,
    METRIC_NAME_RE,
    NODE_NAME_RE,
    SLURM_NAME_RE,
    _Strict,
)
from slurm_idle.config.models import ModelConfig, ReplicaConfig, ReplicaJobConfig
from slurm_idle.config.problems import (
    ConfigInvalid,
    ConfigProblem,
    describe_error,
    problems_of,
    significant_errors,
)
from slurm_idle.config.sections import (
    HaConfig,
    JobPolicyConfig,
    PathsConfig,
    PipelineConfig,
    PolicyConfig,
    ReportConfig,
    TimeoutsConfig,
    WebConfig,
)
from slurm_idle.errors import ConfigError
from slurm_idle.yamlfile import Positions, parse_yaml_located, read_text

__all__ = ['CONFIG_ENV', 'DEFAULT_CONFIG_PATH', 'DEFAULT_REPLICA_URL', 'FILE_CONTEXT', 'LABEL_NAME_RE', 'LABEL_VALUE_RE', 'METRIC_NAME_RE', 'NODE_NAME_RE', 'SLURM_NAME_RE', 'Config', 'ConfigInvalid', 'ConfigProblem', 'EngineConfig', 'GpuConfig', 'HaConfig', 'JobPolicyConfig', 'MetricsConfig', 'ModelConfig', 'PathsConfig', 'PipelineConfig', 'PolicyConfig', 'ReplicaConfig', 'ReplicaJobConfig', 'ReportConfig', 'RouterConfig', 'SlurmConfig', 'TimeoutsConfig', 'WebConfig', 'describe_validation_error', 'load_config', 'load_config_located', 'parse_config', 'parse_config_located', 'resolve_config_path']


class Config(_Strict):
    """The whole etc/slurm-idle.yaml."""

    slurm: SlurmConfig = SlurmConfig()
    metrics: MetricsConfig = MetricsConfig()
    gpu: GpuConfig = GpuConfig()
    engine: EngineConfig | None = None
    models: tuple[ModelConfig, ...] = Field(..., min_length=1)
    policy: PolicyConfig = PolicyConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    paths: PathsConfig = PathsConfig()
    report: ReportConfig = ReportConfig()
    router: RouterConfig = Field(default_factory=RouterConfig)
    job_policy: JobPolicyConfig = Field(default_factory=JobPolicyConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    web: WebConfig = Field(default_factory=WebConfig)
    ha: HaConfig = Field(default_factory=HaConfig)
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
    """Read and validate a config file; ConfigError (ConfigInvalid: every problem, one per line)."""
    return load_config_located(path)[0]


def load_config_located(path: str | os.PathLike[str]) -> tuple[Config, Positions]:
    """The config of a file and where each of its keys is in it (for `config show`)."""
    text = read_text(path, "config file", f" (use --config PATH or set ${CONFIG_ENV})")
    return parse_config_located(text, source=str(Path(path)))


def parse_config(text: str, source: str = "<config>") -> Config:
    """Validate config text; errors name the source, line and dotted field path of each problem."""
    return parse_config_located(text, source)[0]


def parse_config_located(text: str, source: str = "<config>") -> tuple[Config, Positions]:
    """Validate config text, keeping where each key is; ConfigInvalid lists every problem."""
    data, positions = parse_yaml_located(text, source, "config file")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data, context=FILE_CONTEXT), positions
    except ValidationError as exc:
        problems = problems_of(exc, Config, positions, {ModelConfig: ModelConfig.shorthand_keys})
        raise ConfigInvalid(source, problems) from None


def describe_validation_error(exc: ValidationError) -> str:
    """The first error of a ValidationError as `dotted.path: message` (+ how many more): the
    one-line form of files without line numbers to give (job specs, pipelines)."""
    errors = significant_errors(exc)
    more = len(errors) - 1
    return describe_error(errors[0]) + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")
