"""Pipelines (a DAG of container job steps) mapped onto Slurm `afterok` dependencies.

A pipeline YAML names steps, each an inline job spec and/or a reference to a job spec file,
with `depends_on`. Steps are submitted in dependency order, each with
`--dependency=afterok:<upstream ids>` and `--kill-on-invalid-dep=yes`: a requeued step keeps
its downstream waiting (afterok waits for a successful end, not for the first run), and a
failed step makes Slurm cancel everything downstream. The ids are recorded in a small state
file (see `state_dir`), which `pipeline status` and `pipeline cancel` read to act on the DAG.

Parsing and ordering (pipeline_spec, re-exported here) and status explanation are pure;
submission goes through the narrow `Submitter` protocol (the Slurm adapter, or a fake in tests). Parameters, `matrix:` fan-out
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

from slurm_idle import runlog
from slurm_idle.errors import BadInput, SlurmIdleError
from slurm_idle.jobs import (
    JobSpec,
    SubmitOptions,
    render_script,
    sbatch_args,
)
from slurm_idle.model import SlurmJob
from slurm_idle.pipeline_spec import (
    Pipeline,
    Step,
    load_pipeline,
    parse_pipeline,
    topo_order,
)

__all__ = ["load_pipeline", "parse_pipeline", "topo_order"]

#: Job states after which a step will never run again (afterok then never holds).
FAILED_STATES = frozenset(
    {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


class Submitter(Protocol):
    """What pipelines need from Slurm (a subset of slurm_idle.slurm's SlurmBackend)."""

    def submit(self, script: str, extra_args: Sequence[str] = ()) -> int: ...

    def cancel(self, job_ids: Sequence[int], signal: str | None = None) -> None: ...

    def jobs(self) -> list[SlurmJob]: ...


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


def records_dir(root: Path, kind: str, cluster: str) -> Path:
    """`<state dir>/<kind>/<ClusterName>/` (`<kind>/` without one): job ids restart on every
    cluster and pipeline names are the researcher's, so two clusters (or a sandbox beside a
    cluster) sharing a home directory must not read or overwrite each other's records."""
    key = runlog.cluster_key(cluster)
    return root / kind / key if key else root / kind


def pipeline_path(root: Path, name: str, cluster: str = "") -> Path:
    return records_dir(root, "pipelines", cluster) / f"{name}.json"


def record_job(root: Path, job_id: int, spec: JobSpec, now: float,
               job_name: str | None = None, cluster: str = "") -> None:
    """Remember where a submitted job checkpoints and logs, for `slurm-idle jobs` and `web`."""
    ckpt = spec.for_job(str(job_id), cluster).mounts.checkpoint
    ckpt_dir = ckpt.source if ckpt else None
    log = log_path(spec.log, job_id, job_name or spec.name, os.getcwd())
    _write_json(records_dir(root, "jobs", cluster) / f"{job_id}.json",
                {"job_id": job_id, "name": spec.name, "checkpoint": ckpt_dir, "log": log,
                 "submitted_at": now})


def log_path(log: str, job_id: int, job_name: str, cwd: str) -> str:
    """The file sbatch writes for `--output=log`: %j, %x and %% expanded, relative to cwd."""
    path = log.replace("%%", "\0").replace("%j", str(job_id)).replace("%x", job_name)
    path = path.replace("\0", "%")
    return path if os.path.isabs(path) else os.path.join(cwd, path)


def job_record(root: Path, job_id: int, cluster: str = "") -> dict[str, Any] | None:
    try:
        data = json.loads((records_dir(root, "jobs", cluster) / f"{job_id}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def record_pipeline(root: Path, pipeline: Pipeline, ids: Mapping[str, int], now: float,
                    source: str = "", opts: SubmitOptions | None = None,
                    cluster: str = "") -> Path:
    """The run's record. With `opts`, each step's batch script too: `pipeline retry`
    resubmits exactly what ran, even when the file or the -p parameters changed since."""
    path = pipeline_path(root, pipeline.name, cluster)
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


def read_pipeline_record(root: Path, name: str, cluster: str = "") -> dict[str, Any]:
    path = pipeline_path(root, name, cluster)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:  # a name nothing was submitted as: bad input (exit 2)
        raise BadInput(
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


def pipeline_records(root: Path, cluster: str = "") -> list[dict[str, Any]]:
    """Every readable pipeline record of this state dir and cluster, newest first."""
    out = []
    for path in sorted(records_dir(root, "pipelines", cluster).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("steps"), list):
            out.append(data)
    return sorted(out, key=lambda r: -float(r.get("retried_at") or r.get("submitted_at") or 0))
