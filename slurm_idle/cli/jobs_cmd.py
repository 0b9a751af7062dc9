"""Researcher commands: submit, jobs, pipeline run|status|cancel.

The partition and tag come from the config when one is available (--config,
$SLURM_IDLE_CONFIG or the system path); a researcher without a config gets the defaults
(`idle`, `slurm-idle`). Submitted ids are recorded under the state dir
($SLURM_IDLE_STATE_DIR, else ~/.local/state/slurm-idle) for `jobs` and `pipeline status`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.config import Config
from slurm_idle.errors import ConfigError
from slurm_idle.jobs import (
    SubmitOptions,
    check_grace,
    load_job_spec,
    parse_job_comment,
    render_script,
    sbatch_args,
)
from slurm_idle.pipeline import (
    Submitter,
    cancel_pipeline,
    job_record,
    load_pipeline,
    pipeline_status,
    read_pipeline_record,
    record_job,
    record_pipeline,
    state_dir,
    step_options,
    submit_pipeline,
)
from slurm_idle.pipeline import (
    dry_run as pipeline_dry_run,
)


def _config(ctx: Context) -> Config | None:
    """The config if one is given or installed; None (defaults) otherwise."""
    if ctx.config_path or os.environ.get("SLURM_IDLE_CONFIG") or os.path.exists(
        ctx.resolved_config_path
    ):
        return ctx.config() if ctx._config is None else ctx._config
    return None


def _options(cfg: Config | None) -> SubmitOptions:
    if cfg is None:
        return SubmitOptions()
    return SubmitOptions(partition=cfg.slurm.lend_partition, tag=cfg.slurm.tag)


def _warn_grace(cfg: Config | None, specs: list[Any]) -> None:
    """Warn (not refuse) when a job's grace_s outlasts the site's reclaim wait.

    The runner still stops and removes its container when the reclaim's second SIGTERM comes,
    so the job is safe; only its checkpoint may be cut short. Refusing would reject the job
    spec defaults on a site with a short requeue_grace_s.
    """
    if cfg is None:
        return
    site = SubmitOptions(requeue_grace_s=cfg.slurm.requeue_grace_s)
    for spec in specs:
        try:
            check_grace(spec, site)
        except ConfigError as e:
            click.echo(f"slurm-idle: warning: {e}", err=True)


def _slurm(cfg: Config | None) -> Any:
    """The Slurm adapter the config selects; the CLI backend when there is no config."""
    from slurm_idle.slurm import CliBackend, make_backend

    return make_backend(cfg) if cfg is not None else CliBackend()


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the batch script; submit nothing.")
@click.option("--json", "as_json", is_flag=True, help='Print {"job_id": ...}.')
@pass_ctx
def submit(ctx: Context, file: str, dry_run: bool, as_json: bool) -> None:
    """Submit a container job spec (YAML) to the preemptible idle partition."""
    spec = load_job_spec(file)
    cfg = _config(ctx)
    opts = _options(cfg)
    _check_policy(cfg, [spec])
    _warn_grace(cfg, [spec])
    script = render_script(spec, opts)
    if dry_run:
        if as_json:
            echo_json({"job_id": None, "sbatch_args": sbatch_args(spec, opts), "script": script})
        else:
            click.echo(script, nl=False)
        return
    _make_log_dir(spec.log)
    slurm: Submitter = _slurm(cfg)
    job_id = slurm.submit(script)
    record_job(state_dir(), job_id, spec, time.time())
    if as_json:
        echo_json({"job_id": job_id})
    else:
        click.echo(f"submitted job {job_id} ({spec.name}) to partition {opts.partition}")


def _check_policy(cfg: Config | None, specs: list[Any]) -> None:
    """The site's job_policy (safe defaults without a config); the runner checks it again."""
    from slurm_idle.config import JobPolicyConfig
    from slurm_idle.jobpolicy import check_spec

    policy = cfg.job_policy if cfg is not None else JobPolicyConfig()
    for spec in specs:
        check_spec(spec, policy, os.geteuid(), cwd=os.getcwd())


def _make_log_dir(log: str) -> None:
    """Slurm does not create the --output directory: a missing one loses the whole log."""
    parent = os.path.dirname(log)
    if parent and "%" not in parent:
        os.makedirs(parent, exist_ok=True)


def checkpoint_age_s(path: str | None, now: float) -> float | None:
    """Seconds since the newest file under a local checkpoint dir was written (None: unknown)."""
    if not path or not os.path.isdir(path):
        return None
    newest = None
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                m = os.stat(os.path.join(root, f)).st_mtime
            except OSError:
                continue
            newest = m if newest is None else max(newest, m)
    return None if newest is None else round(max(now - newest, 0.0), 1)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def jobs(ctx: Context, as_json: bool) -> None:
    """List our jobs with state, restarts, node and last checkpoint age.

    JSON: {"jobs": [{"job_id", "name", "state", "restarts", "node", "checkpoint_age_s",
    "pipeline", "step", "reason"}]}. The checkpoint age is known for jobs submitted from this
    account on a machine that sees their checkpoint dir.
    """
    cfg = _config(ctx)
    opts = _options(cfg)
    now = time.time()
    rows = []
    for job in _slurm(cfg).jobs():
        tags = parse_job_comment(job.comment, opts.tag)
        if tags is None:
            continue
        rec = job_record(state_dir(), job.job_id) or {}
        rows.append({
            "job_id": job.job_id,
            "name": job.name,
            "state": job.state,
            "restarts": job.restart_count,
            "node": ",".join(job.nodes),
            "checkpoint_age_s": checkpoint_age_s(rec.get("checkpoint"), now),
            "pipeline": tags.get("pipeline"),
            "step": tags.get("step"),
            "reason": job.state_reason,
        })
    if as_json:
        echo_json({"jobs": rows})
        return
    if not rows:
        click.echo("no slurm-idle jobs in the queue")
        return
    click.echo(f"{'JOBID':>8}  {'NAME':24} {'STATE':11} {'RESTARTS':>8}  {'NODE':10} CKPT_AGE")
    for r in rows:
        age = "-" if r["checkpoint_age_s"] is None else f"{r['checkpoint_age_s']:.0f}s"
        click.echo(f"{r['job_id']:>8}  {r['name'][:24]:24} {r['state'][:11]:11} "
                   f"{r['restarts']:>8}  {r['node'][:10] or '-':10} {age}")


@main.group()
def pipeline() -> None:
    """Run multi-step pipelines (pre-process -> train -> eval) as dependent idle jobs.

    Each run is recorded in $SLURM_IDLE_STATE_DIR/pipelines/NAME.json (default
    ~/.local/state/slurm-idle); `status` and `cancel` take the pipeline file or its name.
    """


@pipeline.command("run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the steps; submit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_run(ctx: Context, file: str, dry_run: bool, as_json: bool) -> None:
    """Submit every step of a pipeline with afterok dependencies."""
    pipe = load_pipeline(file)
    cfg = _config(ctx)
    opts = _options(cfg)
    _check_policy(cfg, [st.spec for st in pipe.steps])
    _warn_grace(cfg, [st.spec for st in pipe.steps])
    if dry_run:
        plan = pipeline_dry_run(pipe, opts)
        if as_json:
            echo_json(plan)
            return
        for st in plan["steps"]:
            click.echo(f"# step {st['name']} (after: {', '.join(st['depends_on']) or '-'})")
            click.echo("sbatch " + " ".join(st["sbatch_args"]))
            click.echo(render_script(pipe.step(st["name"]).spec,
                                     step_options(pipe, pipe.step(st["name"]), opts)))
        return
    slurm = _slurm(cfg)
    for st in pipe.steps:
        _make_log_dir(st.spec.log)
    ids = submit_pipeline(pipe, slurm, opts)
    now = time.time()
    for st in pipe.steps:
        record_job(state_dir(), ids[st.name], st.spec, now)
    path = record_pipeline(state_dir(), pipe, ids, now, source=str(Path(file).resolve()))
    if as_json:
        echo_json({"pipeline": pipe.name, "state_file": str(path),
                   "steps": [{"name": s.name, "job_id": ids[s.name],
                              "depends_on": list(s.depends_on)} for s in pipe.steps]})
        return
    for st in pipe.steps:
        after = f" after {', '.join(st.depends_on)}" if st.depends_on else ""
        click.echo(f"{st.name}: job {ids[st.name]}{after}")


def _record_for(target: str) -> dict[str, Any]:
    """A pipeline file or a pipeline name -> its submission record."""
    name = load_pipeline(target).name if os.path.isfile(target) else target
    return read_pipeline_record(state_dir(), name)


@pipeline.command("status")
@click.argument("target", metavar="FILE|NAME")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_status_cmd(ctx: Context, target: str, as_json: bool) -> None:
    """State of every step of the last run of a pipeline (squeue, then sacct for finished ones)."""
    record = _record_for(target)
    slurm = _slurm(_config(ctx))
    since = float(record.get("submitted_at", 0)) - 60

    def accounting(ids: list[int]) -> dict[int, str]:
        return {a.job_id: a.state for a in slurm.accounting(since, None, job_ids=ids)}

    rows = pipeline_status(record, slurm, accounting)
    if as_json:
        echo_json({"pipeline": record["pipeline"], "steps": [
            {"name": r.name, "job_id": r.job_id, "state": r.state, "depends_on": list(r.depends_on),
             "restarts": r.restarts, "node": r.node, "reason": r.reason} for r in rows]})
        return
    click.echo(f"pipeline {record['pipeline']}")
    for r in rows:
        extra = f"  ({r.reason})" if r.reason else ""
        click.echo(f"  {r.name:16} job {r.job_id:<8} {r.state:11} restarts={r.restarts}{extra}")


@pipeline.command("cancel")
@click.argument("target", metavar="FILE|NAME")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_cancel_cmd(ctx: Context, target: str, as_json: bool) -> None:
    """Cancel every step of the last run of a pipeline."""
    record = _record_for(target)
    ids = cancel_pipeline(record, _slurm(_config(ctx)))
    if as_json:
        echo_json({"pipeline": record["pipeline"], "cancelled": ids})
    else:
        click.echo(f"cancelled {len(ids)} step(s) of {record['pipeline']}: "
                   + " ".join(map(str, ids)))
