"""Container job specs (YAML) and the sbatch scripts rendered from them.

A researcher describes a job as an image plus parameters; jobs_spec validates that spec
(pydantic, unknown keys are errors; its names are re-exported here) and this module renders the
batch script that runs it on the preemptible partition. Rendering is pure text: nothing here submits or touches the engine.

Safety of the generated script rests on two rules:
- every user string that reaches the shell body is `shlex.quote`d, and the spec itself travels
  to the in-job runner as base64 of its JSON, so no name, argument, env value or parameter
  can ever be read by bash as code;
- the few values that go on `#SBATCH` lines (which sbatch parses itself, outside any shell) are
  validated against a strict character set, so no newline can smuggle in a line of script.
"""

from __future__ import annotations

import base64
import json
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from slurm_idle import __version__
from slurm_idle.errors import ConfigError
from slurm_idle.jobs_spec import (
    DEFAULT_PARTITION,
    DEFAULT_TAG,
    ENGINE_SOCKETS,
    EXIT_PREEMPTED,
    EXIT_REQUEUE_ME,
    JOB_KIND,
    NAME_RE,
    REQUEUE_WAIT_S,
    JobSpec,
    exposes_socket,
    load_job_spec,
    parse_job_spec,
    read_yaml,
    time_limit_s,
)

__all__ = ["DEFAULT_TAG", "ENGINE_SOCKETS", "EXIT_PREEMPTED", "EXIT_REQUEUE_ME", "NAME_RE",
           "JobSpec", "exposes_socket", "load_job_spec", "parse_job_spec", "read_yaml",
           "time_limit_s"]

@dataclass(frozen=True)
class SubmitOptions:
    """Site settings that shape every script: partition, tag, interpreter."""

    partition: str = DEFAULT_PARTITION
    tag: str = DEFAULT_TAG
    python: str = sys.executable  # the interpreter slurm-idle runs under (has the runner)
    job_name: str | None = None  # Slurm job name, default: the spec's name
    comment_extra: tuple[tuple[str, str], ...] = ()  # e.g. (("pipeline", "p"), ("step", "sft"))
    # The site's slurm.requeue_grace_s (None: unknown, no config): a job's grace_s must fit in it.
    requeue_grace_s: float | None = None


def check_grace(spec: JobSpec, opts: SubmitOptions) -> None:
    """Refuse a grace_s the site's reclaim cannot wait for.

    At reclaim the agent SIGTERMs the runner, waits slurm.requeue_grace_s, then `scontrol
    requeue` (SIGTERM, SIGKILL KillWait later). A runner still waiting out a longer grace_s is
    cut short there: the checkpoint is lost and the job requeued anyway.
    """
    limit = opts.requeue_grace_s
    if limit is not None and spec.grace_s > 0 and spec.grace_s >= limit:
        raise ConfigError(
            f"job {spec.name!r}: grace_s {spec.grace_s:g} does not fit this site's "
            f"slurm.requeue_grace_s {limit:g}: set grace_s below it "
            f"(e.g. {max(limit - 5, limit / 2):g})"
        )


def job_comment(opts: SubmitOptions) -> str:
    """The Slurm comment that marks a job as ours: `<tag>:job[,key=value...]` (no spaces)."""
    extra = "".join(f",{k}={v}" for k, v in opts.comment_extra)
    return f"{opts.tag}:{JOB_KIND}{extra}"


def parse_job_comment(comment: str, tag: str = DEFAULT_TAG) -> dict[str, str] | None:
    """The key=value pairs of one of our comments, or None when the job is not ours."""
    words = comment.strip().split(",")
    if not words or words[0] != f"{tag}:{JOB_KIND}":
        return None
    pairs = (w.split("=", 1) for w in words[1:] if "=" in w)
    return {k: v for k, v in pairs}


def sbatch_args(spec: JobSpec, opts: SubmitOptions = SubmitOptions()) -> list[str]:
    """The sbatch options of a job, as argv words (also written as #SBATCH lines)."""
    for value, what in ((opts.partition, "partition"), (opts.tag, "tag")):
        if not NAME_RE.match(value):
            raise ConfigError(f"{what} {value!r} is not a plain Slurm name")
    for k, v in opts.comment_extra:
        if not (NAME_RE.match(k) and NAME_RE.match(v)):
            raise ConfigError(f"comment field {k}={v!r} is not a plain name")
    name = opts.job_name or spec.name
    if not NAME_RE.match(name):
        raise ConfigError(f"job name {name!r} is not a plain name")
    check_grace(spec, opts)
    args = [
        f"--job-name={name}",
        f"--partition={opts.partition}",
        "--requeue",
        "--open-mode=append",
        f"--output={spec.log}",
        f"--comment={job_comment(opts)}",
        "--ntasks=1",
        f"--cpus-per-task={spec.cpus}",
    ]
    if spec.warn_s:
        # To the steps (the runner): the time limit is near, checkpoint and requeue.
        args.append(f"--signal=USR1@{spec.warn_s}")
    if spec.gpus:
        args.append(f"--gres=gpu:{spec.gpus}")
    if spec.mem:
        args.append(f"--mem={spec.mem}")
    if spec.time:
        args.append(f"--time={spec.time}")
    return args


_OMIT_WHEN_DEFAULT = ("retries", "retry_backoff_s")


def encode_spec(spec: JobSpec) -> str:
    """The spec as base64 of its JSON: a shell-inert word that carries any user string."""
    data = spec.model_dump(mode="json")
    for key in _OMIT_WHEN_DEFAULT:  # scripts of specs without them stay byte-identical
        if data.get(key) == JobSpec.model_fields[key].default:
            data.pop(key, None)
    raw = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return base64.b64encode(raw.encode()).decode()


def decode_spec(b64: str) -> JobSpec:
    """Inverse of encode_spec (used by the runner)."""
    try:
        data = json.loads(base64.b64decode(b64.encode(), validate=True))
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"the job spec passed to the runner is not valid base64 JSON: {exc}") from None
    return parse_job_spec(data, source="--spec-b64")


def render_script(spec: JobSpec, opts: SubmitOptions = SubmitOptions()) -> str:
    """The batch script: #SBATCH options, then the runner as an srun step.

    The runner must be an srun step: at preemption Slurm sends SIGTERM to steps at the start
    of the grace period, but to a bare batch shell only at its end.
    """
    runner = [
        "srun",
        "--ntasks=1",
        "--kill-on-bad-exit=1",
        opts.python,
        "-m",
        "slurm_idle.job_step",
        "--grace-s",
        f"{spec.grace_s:g}",
        "--spec-b64",
    ]
    # The image is validated and JSON-escaped: safe and useful in a comment line.
    lines = [
        "#!/bin/bash",
        (
            f"# Generated by slurm-idle {__version__} from job spec {json.dumps(spec.name)}"
            f" (image {json.dumps(spec.image)}). Edit the spec, not this file."
        ),
        *(f"#SBATCH {arg}" for arg in sbatch_args(spec, opts)),
        "set -euo pipefail",
        (
            'echo "slurm-idle: job ${SLURM_JOB_ID:-?} run ${SLURM_RESTART_COUNT:-0}'
            ' on $(hostname) at $(date +%s)"'
        ),
        f"SPEC={shlex.quote(encode_spec(spec))}",
        "rc=0",
        f'{shlex.join(runner)} "$SPEC" || rc=$?',
        f"if [ $rc -eq {EXIT_PREEMPTED} ] || [ $rc -eq {EXIT_REQUEUE_ME} ]; then",
        "  # Stopped for preemption or the time limit, checkpoint taken. The batch shell must",
        "  # outlive the step: ending now would record the job FAILED instead of requeued.",
        "  # Slurm ends it (GraceTime over, or `scontrol requeue`); if nobody does, requeue here.",
        f"  if [ $rc -eq {EXIT_PREEMPTED} ]; then sleep {REQUEUE_WAIT_S} & wait $! || true; fi",
        '  echo "slurm-idle: requeueing job ${SLURM_JOB_ID:-?} ourselves"',
        '  scontrol requeue "${SLURM_JOB_ID:-}" || true',
        "  sleep 60 & wait $! || true",
        "fi",
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


def render_dry_run(spec: JobSpec, opts: SubmitOptions = SubmitOptions()) -> dict[str, Any]:
    """What `submit --dry-run --json` prints."""
    return {"sbatch_args": sbatch_args(spec, opts), "script": render_script(spec, opts)}
