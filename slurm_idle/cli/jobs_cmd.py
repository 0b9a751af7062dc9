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

from slurm_idle import dag, runlog
from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.config import Config
from slurm_idle.errors import ConfigError
from slurm_idle.jobs import (
    SubmitOptions,
    check_grace,
    load_job_spec,
    render_script,
    sbatch_args,
)
from slurm_idle.jobview import job_rows
from slurm_idle.pipeline import (
    Submitter,
    cancel_pipeline,
    live_status,
    load_pipeline,
    read_pipeline_record,
    record_job,
    record_pipeline,
    state_dir,
    step_options,
    submit_pipeline,
    write_record,
)
from slurm_idle.pipeline import (
    dry_run as pipeline_dry_run,
)
from slurm_idle.pipeline_expand import parse_overrides
from slurm_idle.pipeline_retry import plan_retry, retry_pipeline
from slurm_idle.pipeline_spec import DEFAULT_MAX_STEPS


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


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def jobs(ctx: Context, as_json: bool) -> None:
    """List our jobs with state, restarts, node and last checkpoint age.

    JSON: {"jobs": [{"job_id", "name", "user", "state", "restarts", "preemptions",
    "failures", "node", "gpus", "checkpoint_age_s", "pipeline", "step", "reason", "log"}]}.
    Restarts are Slurm's count; preemptions and failures come from the runner's ledger (None
    when it is not readable here). The checkpoint age is known for jobs submitted from this
    account on a machine that sees their checkpoint dir.
    """
    cfg = _config(ctx)
    opts = _options(cfg)
    rows = job_rows(_slurm(cfg).jobs(), opts.tag, state_dir(), time.time())
    if as_json:
        echo_json({"jobs": rows})
        return
    if not rows:
        click.echo("no slurm-idle jobs in the queue")
        return
    click.echo(f"{'JOBID':>8}  {'NAME':24} {'STATE':11} {'RESTARTS':>8} {'PREEMPT':>7} "
               f"{'FAILED':>6}  {'NODE':10} CKPT_AGE")
    for r in rows:
        age = "-" if r["checkpoint_age_s"] is None else f"{r['checkpoint_age_s']:.0f}s"
        pre = "-" if r["preemptions"] is None else r["preemptions"]
        fail = "-" if r["failures"] is None else r["failures"]
        click.echo(f"{r['job_id']:>8}  {r['name'][:24]:24} {r['state'][:11]:11} "
                   f"{r['restarts']:>8} {pre:>7} {fail:>6}  {r['node'][:10] or '-':10} {age}")


@main.group()
def pipeline() -> None:
    """Run multi-step pipelines (pre-process -> train -> eval) as dependent idle jobs.

    Each run is recorded in $SLURM_IDLE_STATE_DIR/pipelines/NAME.json (default
    ~/.local/state/slurm-idle); `status` and `cancel` take the pipeline file or its name.
    """


@pipeline.command("run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-p", "--param", "params", multiple=True, metavar="NAME=VALUE",
              help="Override one of the pipeline's `params:` (repeatable), e.g. -p lr=3e-4.")
@click.option("--dry-run", is_flag=True, help="Print the steps; submit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_run(ctx: Context, file: str, params: tuple[str, ...], dry_run: bool,
                 as_json: bool) -> None:
    """Submit every step of a pipeline with afterok dependencies.

    Steps may fan out (`matrix:`), pass their `outputs:` to dependents (read-only at
    /inputs/<step>), retry failures (`retries:`) and use `{params.NAME}` templates.
    """
    cfg = _config(ctx)
    pipe = load_pipeline(file, parse_overrides(params), _max_steps(cfg))
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
        record_job(state_dir(), ids[st.name], st.spec, now, st.job_name)
    path = record_pipeline(state_dir(), pipe, ids, now, source=str(Path(file).resolve()),
                           opts=opts)
    if as_json:
        echo_json({"pipeline": pipe.name, "state_file": str(path),
                   "steps": [{"name": s.name, "job_id": ids[s.name],
                              "depends_on": list(s.depends_on)} for s in pipe.steps]})
        return
    for st in pipe.steps:
        after = f" after {', '.join(st.depends_on)}" if st.depends_on else ""
        click.echo(f"{st.name}: job {ids[st.name]}{after}")


def _max_steps(cfg: Config | None) -> int:
    """`pipeline.max_steps` of the config, else its default: the bound on one pipeline's jobs."""
    return cfg.pipeline.max_steps if cfg is not None else DEFAULT_MAX_STEPS


def _record_for(target: str, cfg: Config | None) -> dict[str, Any]:
    """A pipeline file or a pipeline name -> its submission record."""
    name = (load_pipeline(target, max_steps=_max_steps(cfg)).name if os.path.isfile(target)
            else target)
    return read_pipeline_record(state_dir(), name)


@pipeline.command("status")
@click.argument("target", metavar="FILE|NAME")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_status_cmd(ctx: Context, target: str, as_json: bool) -> None:
    """State of every step of the last run of a pipeline (squeue, then sacct for finished ones),
    drawn as its DAG stage by stage (JSON: the rows, each with its upstreams)."""
    cfg = _config(ctx)
    record = _record_for(target, cfg)
    rows = live_status(record, _slurm(cfg))
    if as_json:
        echo_json({"pipeline": record["pipeline"], "steps": [
            {"name": r.name, "job_id": r.job_id, "state": r.state, "depends_on": list(r.depends_on),
             "restarts": r.restarts, "node": r.node, "reason": r.reason} for r in rows]})
        return
    click.echo(dag.render_text(record["pipeline"], rows))


@pipeline.command("retry")
@click.argument("target", metavar="FILE|NAME")
@click.option("--dry-run", is_flag=True, help="Say which steps would be resubmitted.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_retry_cmd(ctx: Context, target: str, dry_run: bool, as_json: bool) -> None:
    """Resubmit the failed steps of a pipeline and everything downstream of them.

    Completed steps are kept (their outputs stay where they are); steps still queued or
    running that do not depend on a failed one are left alone. The recorded batch scripts are
    resubmitted, so the run keeps its parameters. JSON: {"pipeline", "attempt", "resubmitted":
    {step: job_id}, "kept": [step]}.
    """
    cfg = _config(ctx)
    record = _record_for(target, cfg)
    slurm = _slurm(cfg)
    rows = live_status(record, slurm)
    root = state_dir()
    done = frozenset(r.name for r in rows if r.state == "UNKNOWN" and _ledger_completed(root, r.job_id))
    plan = plan_retry(rows, done)
    if dry_run:
        doc = {"pipeline": record["pipeline"], "attempt": record.get("attempt", 1),
               "resubmitted": {n: None for n in plan.redo}, "kept": list(plan.kept)}
        if as_json:
            echo_json(doc)
        else:
            click.echo(f"would resubmit {', '.join(plan.redo)}; keep {', '.join(plan.kept) or '-'}")
        return
    new = retry_pipeline(record, rows, slurm, plan, time.time())
    write_record(root / "pipelines" / f"{record['pipeline']}.json", new)
    ids = {s["name"]: s["job_id"] for s in new["steps"] if s["name"] in plan.redo}
    if as_json:
        echo_json({"pipeline": record["pipeline"], "attempt": new["attempt"],
                   "resubmitted": ids, "kept": list(plan.kept)})
        return
    for name, job_id in ids.items():
        click.echo(f"{name}: resubmitted as job {job_id}")
    click.echo(f"kept: {', '.join(plan.kept) or '-'}")


def _ledger_completed(root: Path, job_id: int) -> bool:
    last = runlog.summarize(runlog.read(root, job_id)).last_end
    return bool(last and last.get("why") == "completed")


@pipeline.command("cancel")
@click.argument("target", metavar="FILE|NAME")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_cancel_cmd(ctx: Context, target: str, as_json: bool) -> None:
    """Cancel every step of the last run of a pipeline."""
    cfg = _config(ctx)
    record = _record_for(target, cfg)
    ids = cancel_pipeline(record, _slurm(cfg))
    if as_json:
        echo_json({"pipeline": record["pipeline"], "cancelled": ids})
    else:
        click.echo(f"cancelled {len(ids)} step(s) of {record['pipeline']}: "
                   + " ".join(map(str, ids)))
