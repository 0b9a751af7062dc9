"""A pipeline YAML read into a `Pipeline`: steps (inline job fields and/or job spec files merged),
their `depends_on` in topological order, job names and `{step}` references substituted, matrix
and parameter overrides resolved. Pure apart from reading the referenced files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from slurm_idle.config import PipelineConfig, describe_validation_error
from slurm_idle.errors import ConfigError
from slurm_idle.jobs import (
    NAME_RE,
    JobSpec,
    parse_job_spec,
    read_yaml,
)
from slurm_idle.pipeline_expand import (
    ParamValue,
    data_mounts,
    instance_names,
    matrix_rows,
    outputs_target,
    resolve_params,
    template,
)

DEFAULT_MAX_STEPS = PipelineConfig().max_steps  # without a config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepSpec(_Strict):
    """One step: `file` (a job spec, relative to the pipeline file) and/or inline `job` fields."""

    name: str
    depends_on: tuple[str, ...] = ()
    file: str | None = None
    job: dict[str, Any] = Field(default_factory=dict)
    retries: int | None = Field(None, ge=0, le=100)  # the job's `retries` (failures only)
    outputs: bool | str = False  # True: /outputs; mounted as inputs/<step> of dependents
    matrix: dict[str, tuple[ParamValue, ...]] | None = None  # fan-out, see pipeline_expand

    @field_validator("outputs")
    @classmethod
    def _outputs(cls, value: bool | str) -> bool | str:
        if isinstance(value, str) and not value.startswith("/"):
            raise ValueError(f"outputs must be true or an absolute container path, got {value!r}")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError(f"step name {value!r} must be letters, digits, '.', '_' or '-'")
        return value


class PipelineSpec(_Strict):
    """The pipeline YAML: a name, fields shared by every step, and the steps."""

    name: str
    defaults: dict[str, Any] = Field(default_factory=dict)
    params: dict[str, ParamValue] = Field(default_factory=dict)  # `-p NAME=VALUE` overrides
    data_dir: str | None = None  # where step outputs live (shared storage); {pipeline} expands
    steps: tuple[StepSpec, ...] = Field(..., min_length=1)

    @field_validator("data_dir")
    @classmethod
    def _data_dir(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"data_dir must be an absolute path, got {value!r}")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError(f"pipeline name {value!r} must be letters, digits, '.', '_' or '-'")
        return value


@dataclass(frozen=True)
class Step:
    """A resolved step: its job spec, Slurm job name and upstream step names."""

    name: str
    depends_on: tuple[str, ...]
    spec: JobSpec
    job_name: str
    group: str = ""  # the YAML step a matrix job came from ("" : the step itself)
    matrix: tuple[tuple[str, ParamValue], ...] = ()


@dataclass(frozen=True)
class Pipeline:
    name: str
    steps: tuple[Step, ...]  # in a valid submission (topological) order
    params: tuple[tuple[str, ParamValue], ...] = ()

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)


_DEEP_KEYS = ("env", "params", "mounts")


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Shallow merge, except env/params/mounts which merge one level deeper.

    Raises ConfigError (without a source; the caller adds it) when one of those is not a
    mapping, e.g. `env: null`, which would otherwise surface as a TypeError.
    """
    out = dict(base)
    for key, value in over.items():
        if key in _DEEP_KEYS and not isinstance(value, Mapping):
            shown = "null" if value is None else type(value).__name__
            raise ConfigError(f"{key} must be a mapping of names to values, got {shown}")
        if key in _DEEP_KEYS and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def job_names(pipeline: str, steps: Sequence[str]) -> dict[str, str]:
    """Slurm job names `<pipeline>.<step>`, cut to 63 characters and unique per step.

    Long names cut to the same 63 characters get a short hash of their step name instead of
    their tail, so two steps never share a job name (`jobs` and squeue would mix them up).
    """
    import hashlib

    full = {step: f"{pipeline}.{step}" for step in steps}
    cut = {step: name[:63] for step, name in full.items()}
    counts = {name: list(cut.values()).count(name) for name in cut.values()}
    out = {}
    for step, name in cut.items():
        if counts[name] > 1:
            digest = hashlib.sha256(step.encode()).hexdigest()[:8]
            name = f"{full[step][:54]}-{digest}"
        out[step] = name
    if len(set(out.values())) != len(out):
        raise ConfigError(
            f"pipeline {pipeline!r}: step job names collide even with a hash; shorten the "
            "pipeline or step names"
        )
    return out


def _substitute(value: Any, names: Mapping[str, str]) -> Any:
    """Replace {pipeline} and {step} in strings (so each step gets its own checkpoint dir)."""
    if isinstance(value, str):
        for k, v in names.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, Mapping):
        return {k: _substitute(v, names) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_substitute(v, names) for v in value]
    return value


def topo_order(deps: Mapping[str, Sequence[str]]) -> list[str]:
    """Names in an order where every step follows its dependencies (stable: file order).

    Raises ConfigError on unknown dependencies and cycles.
    """
    for name, ups in deps.items():
        for up in ups:
            if up not in deps:
                raise ConfigError(f"step {name!r} depends on unknown step {up!r}")
            if up == name:
                raise ConfigError(f"step {name!r} depends on itself")
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(deps):
        ready = [n for n in deps if n not in done and all(u in done for u in deps[n])]
        if not ready:
            stuck = sorted(n for n in deps if n not in done)
            raise ConfigError(f"steps {', '.join(stuck)} form a dependency cycle")
        for n in ready:
            order.append(n)
            done.add(n)
    return order


def parse_pipeline(
    data: Any,
    source: str = "<pipeline>",
    load_file: Callable[[str], Any] | None = None,
    overrides: Mapping[str, str] | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> Pipeline:
    """Validate a pipeline mapping and resolve every step (each matrix job) to a JobSpec.

    More than `max_steps` jobs (config `pipeline.max_steps`) is refused before any matrix is
    expanded: the count is the product of each matrix's list lengths, computed, not built
    (a matrix of ten 100-value lists is 10^20 jobs in a dozen lines).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a pipeline must be a mapping")
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(exc)}") from None
    jobs = sum(math.prod(len(v) for v in (s.matrix or {}).values()) for s in spec.steps)
    if jobs > max_steps:
        raise ConfigError(f"{source}: the steps and their matrix fan-out make {jobs} jobs, more "
                          f"than pipeline.max_steps ({max_steps}): split the pipeline or raise "
                          "pipeline.max_steps in the config")
    names = [s.name for s in spec.steps]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{source}: step names must be unique, repeated: {', '.join(dupes)}")
    try:
        params = resolve_params(spec.params, overrides or {})
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    order = topo_order({s.name: s.depends_on for s in spec.steps})
    by_name = {s.name: s for s in spec.steps}
    rows = {n: matrix_rows(by_name[n].matrix) for n in names}
    instances = {n: instance_names(n, rows[n]) for n in names}
    all_names = [i for n in names for i in instances[n]]
    clash = sorted(set(all_names) & set(names) - {n for n in names if instances[n] == [n]})
    if clash or len(set(all_names)) != len(all_names):
        raise ConfigError(f"{source}: matrix job names collide with step names: "
                          f"{', '.join(clash) or 'rename the steps'}")
    names_of = job_names(spec.name, all_names)
    data_dir = spec.data_dir.replace("{pipeline}", spec.name) if spec.data_dir else None
    steps = []
    for name in order:
        st = by_name[name]
        ups = tuple(i for u in st.depends_on for i in instances[u])
        with_outputs = [u for u in st.depends_on if by_name[u].outputs is not False]
        for index, (inst, row) in enumerate(zip(instances[name], rows[name], strict=True)):
            where = f"{source}: step {inst!r}"
            fields = _step_fields(spec, st, load_file, where)
            if st.retries is not None:
                fields["retries"] = st.retries
            try:
                fields = template(fields, {"params": params, "matrix": row})
                fields = data_mounts(
                    fields, data_dir=data_dir, step=name,
                    index=index if st.matrix else None,
                    outputs=outputs_target(st.outputs), upstream_outputs=with_outputs,
                )
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            fields["name"] = names_of[inst]
            fields = _substitute(fields, {"pipeline": spec.name, "step": inst})
            job = parse_job_spec(fields, source=where)
            steps.append(Step(inst, ups, job, job.name, group=name if st.matrix else "",
                              matrix=tuple(row.items())))
    return Pipeline(spec.name, tuple(steps), tuple(params.items()))


def _step_fields(spec: PipelineSpec, st: StepSpec, load_file: Callable[[str], Any] | None,
                 where: str) -> dict[str, Any]:
    """defaults < referenced file < inline job."""
    fields: dict[str, Any] = dict(spec.defaults)
    try:
        if st.file:
            if load_file is None:
                raise ConfigError(f"refers to {st.file} but no file loader")
            ref = load_file(st.file)
            if not isinstance(ref, Mapping):
                raise ConfigError(f"{st.file} is not a job spec mapping")
            try:
                fields = _merge(fields, ref)
            except ConfigError as exc:
                raise ConfigError(f"{st.file}: {exc}") from None
        return _merge(fields, st.job)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_pipeline(
    path: str | os.PathLike[str],
    overrides: Mapping[str, str] | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> Pipeline:
    """Read a pipeline YAML; step `file:` references are relative to it."""
    p = Path(path)
    base = p.resolve().parent
    return parse_pipeline(read_yaml(p), source=str(p), load_file=lambda f: read_yaml(base / f),
                          overrides=overrides, max_steps=max_steps)
