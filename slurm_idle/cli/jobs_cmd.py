"""Researcher commands: submit, jobs, pipeline run|status|cancel.

The partition and tag come from the config when one is available (--config,
$SLURM_IDLE_CONFIG or the system path); a researcher without a config gets the defaults
(`idle`, `slurm-idle`). Submitted ids are recorded under the state dir
($SLURM_IDLE_STATE_DIR, else ~/.local/state/slurm-idle), per Slurm ClusterName (job ids restart
on every cluster), for `jobs` and `pipeline status`.
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
from slurm_idle.pipeline import (
    cancel_pipeline,
    live_status,
    load_pipeline,
    pipeline_path,
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
    slurm = _slurm(cfg)
    cluster = _cluster(slurm)
    job_id = slurm.submit(script)
    record_job(state_dir(), job_id, spec, time.time(), cluster=cluster)
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
@click.option("-u", "--user", "user", metavar="USER",
              help="Jobs of USER (default: yours).")
@click.option("--all", "all_users", is_flag=True, help="Jobs of every user.")
@click.option("--since", metavar="DATE", default="now-1day", show_default=True,
              help="Jobs that ran or waited after DATE (sacct's forms: now-1hour, today, "
                   "yesterday, 2026-12-01, 2026-12-01T08:00).")
@click.option("--until", metavar="DATE", help="... and before DATE (default: now, with the queue).")
@click.option("--state", "states", metavar="S[,S...]",
              help="Only jobs in one of these states now or at the end of any run, e.g. "
                   "FAILED or PREEMPTED,RUNNING.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def jobs(ctx: Context, user: str | None, all_users: bool, since: str, until: str | None,
         states: str | None, as_json: bool) -> None:
    """List jobs on the idle partition, live and past: state, runs, preemptions and failures
    apart, exit code, reason, node and last checkpoint age.

    The queue (squeue) joined with accounting (sacct: every run of a requeued job), so a job
    preempted at night is still listed in the morning after Slurm has forgotten it. Jobs are
    those in the idle partition (sbatch -p idle, submitit) and those `slurm-idle submit`
    tagged. Preemptions and failures come from the runner's ledger when it is readable here
    (it tells a retry from a reclaim), else from the runs: a requeue other than at the time
    limit is a preemption, never a failure. Without accounting (no slurmdbd) only the queue
    is listed, with a warning.

    JSON: {"jobs": [{"job_id", "name", "user", "state", "restarts", "runs", "preemptions",
    "failures", "exit_code", "signal", "node", "gpus", "start", "end", "checkpoint_age_s",
    "pipeline", "step", "reason", "log", "partition"}], "since", "until", "accounting"}; times
    ISO 8601 UTC; unknown values null. "accounting" is null when sacct answered, else why not.
    """
    from slurm_idle.job_history import iso_utc
    from slurm_idle.job_history import job_rows as history_rows
    from slurm_idle.when import parse_when

    if user and all_users:
        raise click.UsageError("give -u USER or --all, not both")
    cfg = _config(ctx)
    opts = _options(cfg)
    tz = cfg.policy.timezone if cfg is not None else "UTC"
    now = time.time()
    start = parse_when(since, tz, now)
    end = parse_when(until, tz, now) if until else None
    if end is not None and end <= start:
        raise ConfigError("the period is empty: --until must be after --since")
    slurm = _slurm(cfg)
    runs, problem = _accounting(slurm, start, end, opts.partition)
    if problem:
        click.echo(f"slurm-idle: warning: {problem}; listing the queue only", err=True)
    live = slurm.jobs() if end is None else []
    who = None if all_users else (user or _me())
    wanted = [s.strip() for s in (states or "").split(",") if s.strip()]
    rows = history_rows(live, runs, tag=opts.tag, partition=opts.partition, root=state_dir(),
                        now=now, user=who, states=wanted, cluster=_cluster(slurm))
    if as_json:
        echo_json({"jobs": rows, "since": iso_utc(start), "until": iso_utc(end),
                   "accounting": problem})
        return
    if not rows:
        whose = "anyone's" if who is None else f"{who}'s"
        click.echo(f"no jobs of {whose} on partition {opts.partition} since {since}")
        return
    click.echo(f"{'JOBID':>8}  {'NAME':20} {'STATE':11} {'RUNS':>4} {'PREEMPT':>7} "
               f"{'FAILED':>6} {'EXIT':>4}  {'NODE':8} {'CKPT_AGE':>8}  REASON")
    for r in rows:
        age = "-" if r["checkpoint_age_s"] is None else f"{r['checkpoint_age_s']:.0f}s"
        n_runs, pre, fail, code = (_dash(r[k]) for k in ("runs", "preemptions", "failures",
                                                          "exit_code"))
        click.echo(f"{r['job_id']:>8}  {r['name'][:20]:20} {r['state'][:11]:11} {n_runs:>4} "
                   f"{pre:>7} {fail:>6} {code:>4}  "
                   f"{r['node'][:8] or '-':8} {age:>8}  {r['reason'] or '-'}")


def _dash(value: Any) -> str:
    """A count or code for the table; unknown (None: no accounting, no ledger) is `-`."""
    return "-" if value is None else str(value)


def _accounting(slurm: Any, since: float, until: float | None,
                partition: str) -> tuple[list[Any], str | None]:
    """Every run in the window from sacct, or ([], why not) when accounting cannot answer."""
    from slurm_idle.errors import SlurmIdleError

    try:
        return slurm.accounting(since, until, partition), None
    except SlurmIdleError as exc:
        return [], f"no job history from accounting ({exc})"


def _me() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


@main.group()
def pipeline() -> None:
    """Run multi-step pipelines (pre-process -> train -> eval) as dependent idle jobs.

    Each run is recorded in $SLURM_IDLE_STATE_DIR/pipelines/<ClusterName>/NAME.json (default
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
    cluster = _cluster(slurm)
    for st in pipe.steps:
        _make_log_dir(st.spec.log)
    ids = submit_pipeline(pipe, slurm, opts)
    now = time.time()
    for st in pipe.steps:
        record_job(state_dir(), ids[st.name], st.spec, now, st.job_name, cluster=cluster)
    path = record_pipeline(state_dir(), pipe, ids, now, source=str(Path(file).resolve()),
                           opts=opts, cluster=cluster)
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


def _record_for(target: str, cfg: Config | None, cluster: str) -> dict[str, Any]:
    """A pipeline file or a pipeline name -> its submission record on this cluster."""
    name = (load_pipeline(target, max_steps=_max_steps(cfg)).name if os.path.isfile(target)
            else target)
    return read_pipeline_record(state_dir(), name, cluster)


def _cluster(slurm: Any) -> str:
    """Slurm's ClusterName, which keys this user's records (pipeline.records_dir); "" (the
    records of no cluster) when Slurm cannot be asked: the command's own Slurm call then
    says why, and a pipeline name nothing was submitted as is still bad input (exit 2)."""
    from slurm_idle.errors import SlurmIdleError

    try:
        return str(slurm.cluster_name())
    except SlurmIdleError:
        return ""


@pipeline.command("status")
@click.argument("target", metavar="FILE|NAME")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_status_cmd(ctx: Context, target: str, as_json: bool) -> None:
    """State of every step of the last run of a pipeline (squeue, then sacct for finished ones),
    drawn as its DAG stage by stage (JSON: the rows, each with its upstreams)."""
    cfg = _config(ctx)
    slurm = _slurm(cfg)
    record = _record_for(target, cfg, _cluster(slurm))
    rows = live_status(record, slurm)
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
    slurm = _slurm(cfg)
    cluster = _cluster(slurm)
    record = _record_for(target, cfg, cluster)
    rows = live_status(record, slurm)
    root = state_dir()
    done = frozenset(r.name for r in rows
                     if r.state == "UNKNOWN" and _ledger_completed(root, r.job_id, cluster))
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
    write_record(pipeline_path(root, record["pipeline"], cluster), new)
    ids = {s["name"]: s["job_id"] for s in new["steps"] if s["name"] in plan.redo}
    if as_json:
        echo_json({"pipeline": record["pipeline"], "attempt": new["attempt"],
                   "resubmitted": ids, "kept": list(plan.kept)})
        return
    for name, job_id in ids.items():
        click.echo(f"{name}: resubmitted as job {job_id}")
    click.echo(f"kept: {', '.join(plan.kept) or '-'}")


def _ledger_completed(root: Path, job_id: int, cluster: str) -> bool:
    last = runlog.summarize(runlog.read(root, job_id, cluster)).last_end
    return bool(last and last.get("why") == "completed")


@pipeline.command("cancel")
@click.argument("target", metavar="FILE|NAME")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pipeline_cancel_cmd(ctx: Context, target: str, as_json: bool) -> None:
    """Cancel every step of the last run of a pipeline."""
    cfg = _config(ctx)
    slurm = _slurm(cfg)
    record = _record_for(target, cfg, _cluster(slurm))
    ids = cancel_pipeline(record, slurm)
    if as_json:
        echo_json({"pipeline": record["pipeline"], "cancelled": ids})
    else:
        click.echo(f"cancelled {len(ids)} step(s) of {record['pipeline']}: "
                   + " ".join(map(str, ids)))
