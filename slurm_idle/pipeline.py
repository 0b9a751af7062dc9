"""Pipelines (a DAG of container job steps) mapped onto Slurm `afterok` dependencies.

A pipeline YAML names steps, each an inline job spec and/or a reference to a job spec file,
with `depends_on`. Steps are submitted in dependency order, each with
`--dependency=afterok:<upstream ids>` and `--kill-on-invalid-dep=yes`: a requeued step keeps
its downstream waiting (afterok waits for a successful end, not for the first run), and a
failed step makes Slurm cancel everything downstream. The ids are recorded in a small state
file (see `state_dir`), which `pipeline status` and `pipeline cancel` read to act on the DAG.

Parsing, ordering and status explanation are pure; submission goes through the narrow
`Submitter` protocol (the Slurm adapter, or a fake in tests). Parameters, `matrix:` fan-out
and `outputs:` -> `/inputs/<step>` are expanded by pipeline_expand; `pipeline retry` lives in
pipeline_retry (it resubmits the batch scripts this module records).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from slurm_idle.config import describe_validation_error
from slurm_idle.errors import ConfigError, SlurmIdleError
from slurm_idle.jobs import (
    NAME_RE,
    JobSpec,
    SubmitOptions,
    parse_job_spec,
    read_yaml,
    render_script,
    sbatch_args,
)
from slurm_idle.model import SlurmJob
from slurm_idle.pipeline_expand import (
    ParamValue,
    data_mounts,
    instance_names,
    matrix_rows,
    outputs_target,
    resolve_params,
    template,
)

#: Job states after which a step will never run again (afterok then never holds).
FAILED_STATES = frozenset(
    {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


class Submitter(Protocol):
    """What pipelines need from Slurm (a subset of slurm_idle.slurm's SlurmBackend)."""

    def submit(self, script: str, extra_args: Sequence[str] = ()) -> int: ...

    def cancel(self, job_ids: Sequence[int], signal: str | None = None) -> None: ...

    def jobs(self) -> list[SlurmJob]: ...


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
) -> Pipeline:
    """Validate a pipeline mapping and resolve every step (each matrix job) to a JobSpec."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a pipeline must be a mapping")
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(exc)}") from None
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
    path: str | os.PathLike[str], overrides: Mapping[str, str] | None = None
) -> Pipeline:
    """Read a pipeline YAML; step `file:` references are relative to it."""
    p = Path(path)
    base = p.resolve().parent
    return parse_pipeline(
        read_yaml(p), source=str(p), load_file=lambda f: read_yaml(base / f), overrides=overrides
    )


def step_options(pipeline: Pipeline, step: Step, opts: SubmitOptions) -> SubmitOptions:
    return SubmitOptions(
        partition=opts.partition,
        tag=opts.tag,
        python=opts.python,
        job_name=step.job_name,
        comment_extra=(("pipeline", pipeline.name), ("step", step.name)),
        requeue_grace_s=opts.requeue_grace_s,
    )


def dependency_args(upstream_ids: Sequence[int | str]) -> list[str]:
    """afterok on every upstream, and let Slurm cancel this step if one of them fails."""
    if not upstream_ids:
        return []
    return [
        "--dependency=afterok:" + ":".join(str(i) for i in upstream_ids),
        "--kill-on-invalid-dep=yes",
    ]


def dry_run(pipeline: Pipeline, opts: SubmitOptions) -> dict[str, Any]:
    """`pipeline run --dry-run --json`: upstream job ids appear as {step} placeholders."""
    steps = []
    for st in pipeline.steps:
        args = sbatch_args(st.spec, step_options(pipeline, st, opts))
        args += dependency_args([f"{{{u}}}" for u in st.depends_on])
        steps.append({"name": st.name, "depends_on": list(st.depends_on), "sbatch_args": args})
    return {"pipeline": pipeline.name, "steps": steps}


def submit_pipeline(
    pipeline: Pipeline, slurm: Submitter, opts: SubmitOptions
) -> dict[str, int]:
    """Submit every step in order; on a failure cancel what was submitted and re-raise."""
    ids: dict[str, int] = {}
    try:
        for st in pipeline.steps:
            script = render_script(st.spec, step_options(pipeline, st, opts))
            ids[st.name] = slurm.submit(script, dependency_args([ids[u] for u in st.depends_on]))
    except SlurmIdleError:
        if ids:
            slurm.cancel(list(ids.values()))
        raise
    return ids


# ---------------------------------------------------------------- records (state files)


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$SLURM_IDLE_STATE_DIR, else $XDG_STATE_HOME/slurm-idle, else ~/.local/state/slurm-idle."""
    if environ.get("SLURM_IDLE_STATE_DIR"):
        return Path(environ["SLURM_IDLE_STATE_DIR"])
    xdg = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(xdg) / "slurm-idle"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def record_job(root: Path, job_id: int, spec: JobSpec, now: float,
               job_name: str | None = None) -> None:
    """Remember where a submitted job checkpoints and logs, for `slurm-idle jobs` and `web`."""
    ckpt = spec.mounts.checkpoint
    ckpt_dir = ckpt.source.replace("{job_id}", str(job_id)) if ckpt else None
    log = log_path(spec.log, job_id, job_name or spec.name, os.getcwd())
    _write_json(root / "jobs" / f"{job_id}.json",
                {"job_id": job_id, "name": spec.name, "checkpoint": ckpt_dir, "log": log,
                 "submitted_at": now})


def log_path(log: str, job_id: int, job_name: str, cwd: str) -> str:
    """The file sbatch writes for `--output=log`: %j, %x and %% expanded, relative to cwd."""
    path = log.replace("%%", "\0").replace("%j", str(job_id)).replace("%x", job_name)
    path = path.replace("\0", "%")
    return path if os.path.isabs(path) else os.path.join(cwd, path)


def job_record(root: Path, job_id: int) -> dict[str, Any] | None:
    try:
        data = json.loads((root / "jobs" / f"{job_id}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def record_pipeline(root: Path, pipeline: Pipeline, ids: Mapping[str, int], now: float,
                    source: str = "", opts: SubmitOptions | None = None) -> Path:
    """The run's record. With `opts`, each step's batch script too: `pipeline retry`
    resubmits exactly what ran, even when the file or the -p parameters changed since."""
    path = root / "pipelines" / f"{pipeline.name}.json"
    steps = []
    for s in pipeline.steps:
        row: dict[str, Any] = {"name": s.name, "job_id": ids[s.name],
                               "depends_on": list(s.depends_on), "group": s.group or s.name}
        if s.matrix:
            row["matrix"] = dict(s.matrix)
        if opts is not None:
            row["script"] = render_script(s.spec, step_options(pipeline, s, opts))
        steps.append(row)
    write_record(path, {
        "pipeline": pipeline.name,
        "file": source,
        "submitted_at": now,
        "params": dict(pipeline.params),
        "attempt": 1,
        "steps": steps,
    })
    return path


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    _write_json(path, dict(record))


def read_pipeline_record(root: Path, name: str) -> dict[str, Any]:
    path = root / "pipelines" / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SlurmIdleError(
            f"no record of a pipeline named {name!r} in {path.parent} "
            "(was it submitted with `slurm-idle pipeline run` by this user?)"
        ) from None
    except (OSError, ValueError) as exc:
        raise SlurmIdleError(f"{path}: unreadable pipeline record: {exc}") from None
    return data  # type: ignore[no-any-return]


# ---------------------------------------------------------------- status


@dataclass(frozen=True)
class StepStatus:
    name: str
    job_id: int
    state: str  # upper-case Slurm state, or UNKNOWN when Slurm no longer knows the job
    depends_on: tuple[str, ...] = ()
    restarts: int = 0
    node: str = ""
    reason: str = ""


def explain_steps(
    steps: Sequence[tuple[str, int, Sequence[str]]],
    states: Mapping[int, tuple[str, int, str, str]],
) -> list[StepStatus]:
    """Step rows from the recorded DAG and job states {id: (state, restarts, node, reason)}.

    A step that cannot run because an upstream failed says so, naming that upstream.
    """
    out: dict[str, StepStatus] = {}
    for name, job_id, ups in steps:
        state, restarts, node, reason = states.get(job_id, ("UNKNOWN", 0, "", ""))
        failed_up = [u for u in ups if u in out and (out[u].state in FAILED_STATES
                                                      or out[u].reason.startswith("upstream"))]
        if failed_up and state in {"PENDING", "CANCELLED", "UNKNOWN"}:
            up = failed_up[0]
            reason = f"upstream step {up!r} {out[up].state.lower()}: this step will not run"
        elif state == "UNKNOWN" and not reason:
            reason = "no longer known to Slurm (finished long ago, or accounting is off)"
        out[name] = StepStatus(name, job_id, state, tuple(ups), restarts, node, reason)
    return list(out.values())


def pipeline_status(record: Mapping[str, Any], slurm: Submitter,
                    accounting: Callable[[list[int]], Mapping[int, str]] | None = None
                    ) -> list[StepStatus]:
    """Current state of every recorded step: live jobs from squeue, finished ones from sacct."""
    steps = [(s["name"], int(s["job_id"]), tuple(s.get("depends_on", ()))) for s in record["steps"]]
    ids = [i for _, i, _ in steps]
    states: dict[int, tuple[str, int, str, str]] = {}
    for job in slurm.jobs():
        if job.job_id in ids:
            states[job.job_id] = (job.state, job.restart_count, ",".join(job.nodes),
                                  job.state_reason if job.state == "PENDING" else "")
    missing = [i for i in ids if i not in states]
    if missing and accounting is not None:
        try:
            for job_id, state in accounting(missing).items():
                states[job_id] = (state, 0, "", "")
        except SlurmIdleError:
            pass
    return explain_steps(steps, states)


def cancel_pipeline(record: Mapping[str, Any], slurm: Submitter) -> list[int]:
    """scancel every step of the recorded pipeline (finished ones are unaffected)."""
    ids = [int(s["job_id"]) for s in record["steps"]]
    slurm.cancel(ids)
    return ids


def live_status(record: Mapping[str, Any], slurm: Any) -> list[StepStatus]:
    """pipeline_status with the backend's accounting for steps squeue no longer shows."""
    since = float(record.get("submitted_at", 0)) - 60

    def accounting(ids: list[int]) -> dict[int, str]:
        return {a.job_id: a.state for a in slurm.accounting(since, None, job_ids=ids)}

    return pipeline_status(record, slurm, accounting)


def pipeline_records(root: Path) -> list[dict[str, Any]]:
    """Every readable pipeline record of this state dir, newest first."""
    out = []
    for path in sorted((root / "pipelines").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("steps"), list):
            out.append(data)
    return sorted(out, key=lambda r: -float(r.get("retried_at") or r.get("submitted_at") or 0))
