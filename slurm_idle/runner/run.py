"""One run of a job's container: completion check, restart budget, ledger, the run, retries.

`run_container` is the runner's whole life inside a job step after the command line is read:
a job already completed exits at once, a job over its restart budget fails, otherwise the
container is created (container.py), supervised (supervise.py) and always removed, and why
the run ended goes to the run ledger (runlog.py).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slurm_idle import completion, runlog
from slurm_idle.errors import SlurmIdleError
from slurm_idle.jobs import EXIT_PREEMPTED, EXIT_REQUEUE_ME, JobSpec
from slurm_idle.runner.container import (
    SlurmContext,
    container_kwargs,
    ensure_image,
    prepare_host_dirs,
    remove_job_containers,
    wants_device_requests,
    write_params,
)
from slurm_idle.runner.supervise import Reporter, RunSettings, Signals, backoff, supervise

EXIT_MAX_RESTARTS = 64
EXIT_START_FAILED = 70


def run_container(
    client: Any,
    spec: JobSpec,
    ctx: SlurmContext,
    settings: RunSettings,
    signals: Signals,
    report: Reporter,
    stream_client: Any = None,
    early_requeue: Callable[[], str] | None = None,
    job_ending: Callable[[], bool] | None = None,
    environ: Mapping[str, str] | None = None,
    preempted: Callable[[], bool] | None = None,
) -> int:
    """Run the job's container to its end or to a stop signal; return the runner's exit code.

    `early_requeue` runs after a SIGTERM stop once the container is gone (see
    requeue_if_preempted): requeueing earlier could kill the runner before its cleanup.
    `job_ending` is asked once after the first SIGTERM: True when Slurm is already ending the
    job (see job_is_ending), so there is no grace to wait out. `preempted` is asked once after a
    stop by SIGUSR1 alone: True when Slurm is preempting this run (see was_preempted). A site
    with PreemptParameters=send_user_signal (22.05: SlurmctldParameters=
    preempt_send_user_signal, what submitit's jobs need in `placement: jobs`) sends the job's
    own `--signal` (USR1) at a preemption instead of SIGTERM: that stop is a preemption (exit
    143, ledger `preempted`, early requeue), not the time limit, or every nightly preemption
    would count against max_restarts.
    A job id whose completion is recorded (completion.py) exits 0 before anything starts; a
    run whose container exits 0 records it first. `environ` (default os.environ) locates the
    marker of a spec without a checkpoint dir.
    """
    marker = _completion_marker(spec, ctx, os.environ if environ is None else environ)
    if marker is not None:
        done = completion.read_completion(marker)
        if done is not None:
            report.say(completion.already_done_message(done, ctx.restart_count))
            return 0
    ledger = _Ledger(settings.ledger_dir, ctx, report)
    ledger.fresh_start()
    past = ledger.summary()
    ledger.write({"event": "start"})
    counted = past.counted_restarts(ctx.restart_count) if ledger.known else ctx.restart_count
    if counted > spec.max_restarts:
        report.say(
            f"job {ctx.job_id} was restarted {counted} times (preemptions and retries not "
            f"counted), more than max_restarts={spec.max_restarts}: failing instead of running "
            "again (raise max_restarts to allow more)"
        )
        ledger.write({"event": "end", "why": "max_restarts", "exit_code": EXIT_MAX_RESTARTS})
        return EXIT_MAX_RESTARTS
    code = _run_once(client, spec, ctx, settings, signals, report, stream_client, job_ending)
    by_preemption = signals.term.is_set()
    if (code == EXIT_REQUEUE_ME and not by_preemption and preempted is not None
            and preempted()):
        report.say("SIGUSR1 came with Slurm's preemption of this run (send_user_signal): "
                   "a preemption, not the time limit")
        code, by_preemption = EXIT_PREEMPTED, True
    why = runlog.end_reason(code, EXIT_PREEMPTED, EXIT_REQUEUE_ME)
    failure = past.failures + 1
    retry = why == "failed" and ledger.known and failure <= spec.retries
    ledger.write({"event": "end", "why": why, "exit_code": code, "retry": retry})
    if retry:
        wait = runlog.backoff_s(spec.retry_backoff_s, failure)
        report.say(f"run failed with code {code}: retry {failure} of {spec.retries} after "
                   f"{wait:g} s of backoff (requeueing the job)")
        # Cut short by SIGUSR1 alone (the time limit is near): requeue now, as planned.
        if backoff(wait, signals, settings) or not signals.term.is_set():
            return EXIT_REQUEUE_ME
        report.say("stop signal during the backoff: leaving the requeue to Slurm")
        code = EXIT_PREEMPTED
    if code == EXIT_PREEMPTED and by_preemption and early_requeue is not None:
        report.say(early_requeue())
    if code == 0 and marker is not None:
        report.say(_record_completion(marker, ctx))
    return code


def _completion_marker(spec: JobSpec, ctx: SlurmContext, environ: Mapping[str, str]) -> Path | None:
    """Where this job's completion is recorded; None outside Slurm (no job id to key it)."""
    if not ctx.job_id:
        return None
    ck = spec.for_job(ctx.job_id, ctx.cluster).mounts.checkpoint
    return completion.marker_path(
        completion.marker_dir(ck.source if ck else None, environ), ctx.job_id, ctx.cluster
    )


def _record_completion(marker: Path, ctx: SlurmContext) -> str:
    done = completion.Completion(
        job_id=ctx.job_id, cluster=ctx.cluster, exit_code=0, restart_count=ctx.restart_count,
        finished_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    try:
        completion.write_completion(marker, done)
    except OSError as exc:
        return (f"could not record the completion in {marker}: {exc} (a later run of this job "
                "would run the work again)")
    return f"completion recorded in {marker}: a later run of job {ctx.job_id} exits at once"


class _Ledger:
    """Best-effort writer of this run's ledger records: a full disk never stops a job."""

    def __init__(self, root: Path | None, ctx: SlurmContext, report: Reporter) -> None:
        self.root = root if ctx.job_id else None
        self.ctx = ctx
        self.report = report
        self.known = self.root is not None  # False: every restart counts, no retries

    def fresh_start(self) -> None:
        """Run 0 has no past: a ledger already there belongs to an older job of the same id
        (slurmctld state reset), so it is set aside instead of being counted."""
        if self.root is None or self.ctx.restart_count != 0:
            return
        path = runlog.ledger_path(self.root, self.ctx.job_id, self.ctx.cluster)
        try:
            path.replace(path.with_suffix(".jsonl.old"))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.known = False
            self.report.say(f"cannot set aside the old run ledger {path}: {exc}")

    def summary(self) -> runlog.RunSummary:
        if self.root is None:
            return runlog.RunSummary()
        records = runlog.read(self.root, self.ctx.job_id, self.ctx.cluster)
        return runlog.summarize(records, self.ctx.restart_count)

    def write(self, record: dict[str, Any]) -> None:
        if self.root is None:
            return
        record = {**record, "run": self.ctx.restart_count, "t": round(time.time(), 3),
                  "node": os.uname().nodename}
        try:
            runlog.append(self.root, self.ctx.job_id, record, self.ctx.cluster)
        except OSError as exc:
            self.known = False
            self.report.say(f"cannot write the run ledger in {self.root}: {exc}")


def _run_once(
    client: Any,
    spec: JobSpec,
    ctx: SlurmContext,
    settings: RunSettings,
    signals: Signals,
    report: Reporter,
    stream_client: Any,
    job_ending: Callable[[], bool] | None = None,
) -> int:
    import docker.errors

    spec = spec.for_job(ctx.job_id or "none", ctx.cluster)
    container = None
    params_dir = None
    try:
        if ctx.job_id:
            for name in remove_job_containers(client, ctx.job_id):
                report.say(f"removed leftover container {name}")
        prepare_host_dirs(spec, settings.engine_sockets)
        params_dir, params_file = write_params(spec)
        runtimes = list((client.info().get("Runtimes") or {}).keys())
        use_dr = wants_device_requests(settings.gpu_mode, runtimes)
        if settings.gpu_mode == "off":
            ctx = replace(ctx, gpus=(), cuda_visible_devices=None)
        ensure_image(client, spec.image, report, settings.pull, ctx.node, settings.engine)
        if signals.stop_requested():
            report.say("stop signal before the container started: nothing to checkpoint")
            # SIGUSR1 alone (the time limit is near; Slurm may send it up to a minute early):
            # the batch script requeues the job. SIGTERM: Slurm is ending or requeueing it.
            return EXIT_PREEMPTED if signals.term.is_set() else EXIT_REQUEUE_ME
        kwargs = container_kwargs(
            spec, ctx, uid=settings.uid, gid=settings.gid,
            use_device_requests=use_dr, params_file=params_file,
        )
        container = client.containers.create(**kwargs)
        container.start()
        report.say(
            f"started container {kwargs['name']} image={spec.image} restart={ctx.restart_count}"
            f" gpus={','.join(ctx.gpus) or '-'} device_requests={'yes' if use_dr else 'no'}"
        )
        return supervise(
            container, settings, signals, report, stream_client or client, job_ending
        )
    except (docker.errors.DockerException, SlurmIdleError, OSError) as exc:
        report.say(f"could not run the container: {exc}")
        return EXIT_START_FAILED
    finally:
        if container is not None:
            try:
                container.remove(force=True)
                report.say(f"removed container {container.name}")
            except docker.errors.NotFound:
                pass
            except (docker.errors.DockerException, OSError) as exc:  # OSError: requests' errors
                report.say(f"could not remove container {container.name}: {exc}")
        if params_dir:
            shutil.rmtree(params_dir, ignore_errors=True)
