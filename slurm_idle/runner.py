"""The in-job container runner (`slurm-idle-run`, `python -m slurm_idle.runner`).

Every batch script rendered by jobs.py runs this as an **srun step**, because at preemption
Slurm sends SIGTERM to job steps at the start of the grace period (a bare batch shell only gets
it at the end). The runner starts the job's container through the docker SDK (`DOCKER_HOST`),
streams its output into the job log, and turns Slurm's signals into a clean checkpoint:

- SIGTERM (preemption, `scontrol requeue`, `slurm-idle reclaim`): SIGTERM to the container
  (its init, tini, forwards it to the workload), wait up to `grace_s` for it to checkpoint and
  exit, then kill it; exit 143. Slurm requeues the job (PreemptMode=REQUEUE, or the requeue
  that sent the signal) when it ends the batch shell, which therefore waits on exit 143
  instead of ending first (measured on 22.05: a batch shell that exits during GraceTime ends
  the job FAILED, not requeued).
- SIGUSR1 (`--signal=USR1@N`: the time limit is near): same, exit 75; the batch script then
  runs `scontrol requeue` so the job continues in a new run instead of ending as TIMEOUT.
- A second SIGTERM (or SIGINT), or a first one (also after SIGUSR1) while Slurm is already
  ending the job (JobState no longer RUNNING: `scontrol requeue`, scancel, the time limit),
  means "stop now": Slurm SIGKILLs the runner KillWait seconds later (5 s in our slurm.conf),
  and a container under dockerd would outlive it holding the GPUs. The container gets
  `urgent_wait_s` (2 s) to finish a quick checkpoint, then is force-removed (kill + remove);
  exit 143. The usual case is the agent's reclaim: SIGTERM to the steps, then after
  slurm.requeue_grace_s `scontrol requeue` (SIGTERM again). The Epilog sweep
  (`--cleanup JOBID`) still covers a runner killed anyway (slurmctld unreachable, a hung engine).

Exit codes (the step's exit code; the job's is the same unless Slurm requeues it):
  0    the container exited 0              N    the container failed with exit code N
  143  stopped by SIGTERM (preempted)      75   time limit near: checkpointed, requeue me
  64   more restarts than max_restarts     70   the container could not be started
  75   also: the container failed and `retries` allow another run (after the backoff)

Why each run ended is appended to the job's run ledger (runlog.py, `<state dir>/runs/`):
max_restarts counts Slurm's restarts minus the recorded preemptions and retries, so a job
preempted every night never fails for it; `retries` counts only recorded failures.

Completion is final (completion.py): after the container exits 0 the runner records it in a
marker file (the checkpoint dir, else the user's state dir) before exiting 0; a later run of the
same job id finds it and exits 0 at once without starting anything. Slurm 24.05+ may start a
finished job once more after a preemption (docs/slurm-releases.md).

The container always runs as the job's uid:gid, unprivileged, with no-new-privileges, never
with the engine socket mounted, with `init=True`, and is always removed (finally, plus a
label-based sweep of leftovers of the same job at start and `--cleanup JOBID` for an Epilog).

GPUs: the indexes Slurm allocated (SLURM_STEP_GPUS / SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES)
are requested as nvidia device requests when the engine has an `nvidia` runtime (or
`--gpu-mode nvidia`); otherwise (`--gpu-mode env`, or `auto` without that runtime, as on a
machine without GPUs) they are only passed as NVIDIA_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES.
Those two are always set by the runner, over the spec's env and the image's: the nvidia
runtime honours NVIDIA_VISIBLE_DEVICES from an unprivileged container, so `all` there would
show every GPU of the node. A job without GPUs (or `--gpu-mode off`) gets `void`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, Literal

from slurm_idle import completion, runlog
from slurm_idle.errors import SlurmIdleError
from slurm_idle.jobpolicy import check_spec, site_policy
from slurm_idle.jobs import (
    ENGINE_SOCKETS,
    EXIT_PREEMPTED,
    EXIT_REQUEUE_ME,
    JobSpec,
    decode_spec,
    exposes_socket,
    load_job_spec,
)
from slurm_idle.pipeline import state_dir
from slurm_idle.podman import PodmanService

EXIT_MAX_RESTARTS = 64
EXIT_START_FAILED = 70

LABEL_MANAGED = "slurm-idle.managed"
LABEL_JOB = "slurm-idle.job-id"
LABEL_RESTART = "slurm-idle.restart"
LABEL_NAME = "slurm-idle.name"
PARAMS_TARGET = "/run/slurm-idle/params.json"

GpuMode = Literal["auto", "nvidia", "env", "off"]


@dataclass(frozen=True)
class SlurmContext:
    """What the runner learns from the job step's environment."""

    job_id: str = ""  # empty when run by hand outside Slurm
    restart_count: int = 0
    gpus: tuple[str, ...] = ()  # node-level GPU indexes Slurm allocated
    cuda_visible_devices: str | None = None
    job_name: str = ""
    cluster: str = ""  # SLURM_CLUSTER_NAME: with the job id, names the completion marker and the run ledger


def slurm_context(environ: Mapping[str, str]) -> SlurmContext:
    """Parse the step environment (pure)."""
    gpu_list = ""
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        if environ.get(key):
            gpu_list = environ[key]
            break
    gpus = tuple(g for g in gpu_list.split(",") if g and g != "NoDevFiles")
    try:
        restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        restarts = 0
    return SlurmContext(
        job_id=environ.get("SLURM_JOB_ID", ""),
        restart_count=restarts,
        gpus=gpus,
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        job_name=environ.get("SLURM_JOB_NAME", ""),
        cluster=environ.get("SLURM_CLUSTER_NAME", ""),
    )


def mem_bytes(mem: str) -> int:
    """Slurm memory syntax (plain number = MiB) to bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if mem[-1] in units:
        return int(mem[:-1]) * units[mem[-1]]
    return int(mem) << 20


def container_name(ctx: SlurmContext, spec: JobSpec) -> str:
    if ctx.job_id:
        return f"slurm-idle-{ctx.job_id}-r{ctx.restart_count}"
    return f"slurm-idle-{spec.name}-{os.getpid()}"


def container_env(
    spec: JobSpec, ctx: SlurmContext, use_device_requests: bool, params_in_file: bool
) -> dict[str, str]:
    """The container's environment: spec env, params, then what the runner adds."""
    env = {**spec.env, **spec.param_env()}
    env["SLURM_RESTART_COUNT"] = str(ctx.restart_count)
    if ctx.job_id:
        env["SLURM_JOB_ID"] = ctx.job_id
    if spec.mounts.checkpoint:
        env["CHECKPOINT_DIR"] = spec.mounts.checkpoint.target
    if params_in_file:
        env["SLURM_IDLE_PARAMS_FILE"] = PARAMS_TARGET
    env.update(gpu_env(ctx, use_device_requests))
    return env


def gpu_env(ctx: SlurmContext, use_device_requests: bool) -> dict[str, str]:
    """The GPU variables the runner imposes, whatever the spec or the image set.

    NVIDIA_VISIBLE_DEVICES is what the nvidia runtime reads (an image's `all` would otherwise
    expose every GPU of the node): the allocated indexes, the same as the device request, or
    `void` for none. CUDA_VISIBLE_DEVICES follows: with device requests the container sees only
    its GPUs, numbered from 0; without, Slurm's own value (or the indexes); none: empty.
    """
    if not ctx.gpus:
        return {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    indexes = ",".join(ctx.gpus)
    if use_device_requests:
        cuda = ",".join(str(i) for i in range(len(ctx.gpus)))
    else:
        cuda = ctx.cuda_visible_devices or indexes
    return {
        "SLURM_IDLE_GPUS": indexes, "NVIDIA_VISIBLE_DEVICES": indexes, "CUDA_VISIBLE_DEVICES": cuda,
    }


def container_kwargs(
    spec: JobSpec,
    ctx: SlurmContext,
    *,
    uid: int,
    gid: int,
    use_device_requests: bool,
    params_file: str | None,
) -> dict[str, Any]:
    """Keyword arguments for `client.containers.create` (pure: no engine call)."""
    from docker.types import DeviceRequest, Mount

    mounts = [Mount(m.target, m.source, type="bind", read_only=True) for m in spec.mounts.inputs]
    mounts += [Mount(m.target, m.source, type="bind") for m in spec.mounts.outputs]
    if spec.mounts.checkpoint:
        c = spec.mounts.checkpoint
        mounts.append(Mount(c.target, c.source, type="bind"))
    if params_file:
        mounts.append(Mount(PARAMS_TARGET, params_file, type="bind", read_only=True))
    kwargs: dict[str, Any] = {
        "image": spec.image,
        "name": container_name(ctx, spec),
        "environment": container_env(spec, ctx, use_device_requests, params_file is not None),
        "mounts": mounts,
        "user": f"{uid}:{gid}",
        "network_mode": spec.network,
        "init": True,  # tini as PID 1 forwards SIGTERM; a bare PID 1 would ignore it
        "privileged": False,
        "security_opt": ["no-new-privileges"],
        "labels": {
            LABEL_MANAGED: "true",
            LABEL_JOB: ctx.job_id or "none",
            LABEL_RESTART: str(ctx.restart_count),
            LABEL_NAME: spec.name,
        },
        "nano_cpus": spec.cpus * 1_000_000_000,
    }
    if spec.command is not None:
        kwargs["entrypoint"] = list(spec.command)
    if spec.args is not None:
        kwargs["command"] = list(spec.args)
    if spec.workdir:
        kwargs["working_dir"] = spec.workdir
    if spec.mem:
        kwargs["mem_limit"] = mem_bytes(spec.mem)
    if use_device_requests and ctx.gpus:
        kwargs["device_requests"] = [
            DeviceRequest(driver="nvidia", device_ids=list(ctx.gpus), capabilities=[["gpu"]])
        ]
    return kwargs


def wants_device_requests(mode: GpuMode, runtimes: Sequence[str]) -> bool:
    """Device requests only when asked for, or (auto) when the engine has an nvidia runtime."""
    return mode == "nvidia" or (mode == "auto" and "nvidia" in runtimes)


# ---------------------------------------------------------------- running


@dataclass
class Signals:
    """Signals received so far; handlers set these, the run loop reads them.

    `urgent` is set by a second SIGTERM/SIGINT: Slurm is ending the job and SIGKILLs the
    runner KillWait seconds later, so the container must go now. A SIGTERM after SIGUSR1 is
    not urgent by itself (a preemption may send both at the start of its GraceTime, with
    SlurmctldParameters=preempt_send_user_signal): the run loop asks Slurm whether the job is
    ending (the time limit) instead. A repeated SIGUSR1 (slurmctld's warning beat) never is.
    """

    term: threading.Event = field(default_factory=threading.Event)
    usr1: threading.Event = field(default_factory=threading.Event)
    urgent: threading.Event = field(default_factory=threading.Event)

    def stop_requested(self) -> bool:
        return self.term.is_set() or self.usr1.is_set()

    def on_term(self) -> None:
        if self.term.is_set():
            self.urgent.set()
        self.term.set()

    def on_usr1(self) -> None:
        self.usr1.set()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.on_term())
        signal.signal(signal.SIGINT, lambda *_: self.on_term())
        signal.signal(signal.SIGUSR1, lambda *_: self.on_usr1())

    def settle(self) -> None:
        """The exit code is decided: ignore stop signals from now until the process is gone.

        At exit Python resets its signal handlers to the default action, which for SIGTERM
        and SIGUSR1 is death. A time-limit warning (slurmctld sends it on its own ~30 s beat)
        landing in that window turned a finished job into FAILED ("task 0: User defined
        signal 1"). Ignored signals are left ignored, so the decided code stands.
        """
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)


@dataclass(frozen=True)
class RunSettings:
    grace_s: float = 30.0
    gpu_mode: GpuMode = "auto"
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    poll_s: float = 0.2
    engine_sockets: tuple[str, ...] = ENGINE_SOCKETS
    # After SIGKILL at the end of grace: how long to wait for the exit code and the last log
    # lines before the container is removed anyway (kept short: Slurm may SIGKILL us next).
    kill_wait_s: float = 3.0
    # "Stop now" (see Signals.urgent): the container, SIGTERMed already, gets this much longer
    # to finish a quick checkpoint, then is force-removed. With the removal it must stay well
    # inside Slurm's KillWait (5 s in etc/slurm.conf.snippet).
    urgent_wait_s: float = 2.0
    # Where the run ledger lives (runlog.py); None: no ledger, every restart counts.
    ledger_dir: Path | None = None


class Reporter:
    """Runner messages, prefixed and flushed, into the same stream as the container's output."""

    def __init__(self, out: BinaryIO, clock: Callable[[], float] = time.time) -> None:
        self.out = out
        self.clock = clock
        self.lock = threading.Lock()

    def say(self, message: str) -> None:
        self.write(f"slurm-idle-run: {message} t={self.clock():.1f}\n".encode())

    def write(self, data: bytes) -> None:
        with self.lock:
            self.out.write(data)
            self.out.flush()


def remove_job_containers(client: Any, job_id: str) -> list[str]:
    """Remove every container labelled with this job id (leftovers of a killed run)."""
    removed = []
    for c in client.containers.list(all=True, filters={"label": [f"{LABEL_JOB}={job_id}"]}):
        c.remove(force=True)
        removed.append(c.name)
    return removed


def _prepare_host_dirs(spec: JobSpec, engine_sockets: Sequence[str]) -> None:
    for m in spec.mounts.inputs:
        if not os.path.exists(m.source):
            raise SlurmIdleError(f"input {m.source} does not exist on {os.uname().nodename}")
    writable = list(spec.mounts.outputs)
    if spec.mounts.checkpoint:
        writable.append(spec.mounts.checkpoint)
    for m in writable:
        os.makedirs(m.source, exist_ok=True)
    check_no_engine_socket(spec, engine_sockets)


def check_no_engine_socket(spec: JobSpec, engine_sockets: Sequence[str]) -> None:
    """Refuse a mount that would show the engine's socket inside the container.

    The spec was checked at submit time against the usual socket paths; here the check runs on
    resolved paths (a symlinked source, /var/run -> /run) and on the socket this runner
    really talks to (DOCKER_HOST), which may live anywhere (e.g. under /tmp).
    """
    sockets = [os.path.realpath(s) for s in engine_sockets]
    mounts = [*spec.mounts.inputs, *spec.mounts.outputs]
    if spec.mounts.checkpoint:
        mounts.append(spec.mounts.checkpoint)
    for m in mounts:
        if exposes_socket(os.path.realpath(m.source), sockets):
            raise SlurmIdleError(
                f"mount {m.source} would expose the container engine socket inside the "
                "container: refusing to start it (mount a directory that does not contain it)"
            )


def engine_sockets(docker_host: str | None) -> tuple[str, ...]:
    """The socket paths to keep out of containers: the usual ones and DOCKER_HOST's."""
    extra = docker_host[len("unix://"):] if docker_host and docker_host.startswith("unix://") else None
    return ENGINE_SOCKETS + ((extra,) if extra else ())


def _write_params(spec: JobSpec) -> tuple[str | None, str | None]:
    """A private dir holding params.json when params go to a file: (dir, file)."""
    if "file" not in spec.params_as or not spec.params:
        return None, None
    import json

    tmp = tempfile.mkdtemp(prefix="slurm-idle-params-")
    path = os.path.join(tmp, "params.json")
    Path(path).write_text(json.dumps(spec.params, indent=2, sort_keys=True) + "\n")
    os.chmod(path, 0o444)
    os.chmod(tmp, 0o755)
    return tmp, path


def _ensure_image(client: Any, image: str, report: Reporter) -> None:
    import docker.errors

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        report.say(f"pulling {image}")
        client.images.pull(image)


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
) -> int:
    """Run the job's container to its end or to a stop signal; return the runner's exit code.

    `early_requeue` runs after a SIGTERM stop once the container is gone (see
    requeue_if_preempted): requeueing earlier could kill the runner before its cleanup.
    `job_ending` is asked once after the first SIGTERM: True when Slurm is already ending the
    job (see job_is_ending), so there is no grace to wait out.
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
    why = runlog.end_reason(code, EXIT_PREEMPTED, EXIT_REQUEUE_ME)
    failure = past.failures + 1
    retry = why == "failed" and ledger.known and failure <= spec.retries
    ledger.write({"event": "end", "why": why, "exit_code": code, "retry": retry})
    if retry:
        wait = runlog.backoff_s(spec.retry_backoff_s, failure)
        report.say(f"run failed with code {code}: retry {failure} of {spec.retries} after "
                   f"{wait:g} s of backoff (requeueing the job)")
        # Cut short by SIGUSR1 alone (the time limit is near): requeue now, as planned.
        if _backoff(wait, signals, settings.poll_s) or not signals.term.is_set():
            return EXIT_REQUEUE_ME
        report.say("stop signal during the backoff: leaving the requeue to Slurm")
        code = EXIT_PREEMPTED
    if code == EXIT_PREEMPTED and signals.term.is_set() and early_requeue is not None:
        report.say(early_requeue())
    if code == 0 and marker is not None:
        report.say(_record_completion(marker, ctx))
    return code


def _completion_marker(spec: JobSpec, ctx: SlurmContext, environ: Mapping[str, str]) -> Path | None:
    """Where this job's completion is recorded; None outside Slurm (no job id to key it)."""
    if not ctx.job_id:
        return None
    ck = spec.for_job(ctx.job_id).mounts.checkpoint
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


def _backoff(seconds: float, signals: Signals, poll_s: float) -> bool:
    """Wait out a retry's backoff; False when a stop signal cut it short."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if signals.stop_requested():
            return False
        time.sleep(min(poll_s, left))
    return not signals.stop_requested()


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

    spec = spec.for_job(ctx.job_id or "none")
    container = None
    params_dir = None
    try:
        if ctx.job_id:
            for name in remove_job_containers(client, ctx.job_id):
                report.say(f"removed leftover container {name}")
        _prepare_host_dirs(spec, settings.engine_sockets)
        params_dir, params_file = _write_params(spec)
        runtimes = list((client.info().get("Runtimes") or {}).keys())
        use_dr = wants_device_requests(settings.gpu_mode, runtimes)
        if settings.gpu_mode == "off":
            ctx = replace(ctx, gpus=(), cuda_visible_devices=None)
        _ensure_image(client, spec.image, report)
        if signals.stop_requested():
            report.say("stop signal before the container started: nothing to checkpoint")
            return EXIT_PREEMPTED
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
        return _supervise(
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
            except docker.errors.DockerException as exc:
                report.say(f"could not remove container {container.name}: {exc}")
        if params_dir:
            shutil.rmtree(params_dir, ignore_errors=True)


def _wait(
    done: threading.Event,
    seconds: float,
    signals: Signals,
    poll_s: float,
    on_first_term: Callable[[], None] | None = None,
) -> bool:
    """Wait up to `seconds` for `done`; give up early on an urgent stop. True: done.

    `on_first_term` runs once, as soon as a SIGTERM has been received (also one that arrives
    during a SIGUSR1 grace), and may set `signals.urgent`.
    """
    deadline = time.monotonic() + seconds
    while not done.is_set() and not signals.urgent.is_set():
        if on_first_term is not None and signals.term.is_set():
            on_first_term()
            on_first_term = None
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done.wait(min(poll_s, left))
    return done.is_set()


def _stop_now(done: threading.Event, settings: RunSettings, report: Reporter, t0: float) -> bool:
    """The urgent end of a grace wait: a last short wait. True: the container exited."""
    report.say(
        f"stop signal {time.monotonic() - t0:.1f} s into the grace: Slurm is ending the job; "
        f"the container gets {settings.urgent_wait_s:g} s more, then is removed"
    )
    if done.wait(settings.urgent_wait_s):
        return True
    report.say("container still running: removing it now, before Slurm kills the runner")
    return False


def _supervise(
    container: Any,
    settings: RunSettings,
    signals: Signals,
    report: Reporter,
    stream_client: Any,
    job_ending: Callable[[], bool] | None = None,
) -> int:
    done = threading.Event()
    result: dict[str, int] = {}

    def wait() -> None:
        try:
            result["code"] = int(stream_client.containers.get(container.id).wait()["StatusCode"])
        except Exception:  # noqa: BLE001 - the container vanished; the loop decides
            result.setdefault("code", -1)
        done.set()

    def stream_logs() -> None:
        try:
            for chunk in stream_client.containers.get(container.id).logs(
                stream=True, follow=True
            ):
                report.write(chunk)
        except Exception:  # noqa: BLE001, S110 - logs are best effort; the exit code is not
            pass

    logs = threading.Thread(target=stream_logs, daemon=True)
    logs.start()
    threading.Thread(target=wait, daemon=True).start()
    while not done.wait(settings.poll_s):
        if signals.stop_requested():
            break
    if done.is_set():
        logs.join(timeout=5)
        code = result["code"]
        report.say(f"container exited with code {code}")
        if code in (EXIT_PREEMPTED, EXIT_REQUEUE_ME):
            # Those two codes tell the batch script "requeue me": a container that fails
            # with one of them on its own must not be requeued forever.
            report.say(f"exit code {code} is reserved for preemption: reporting failure (1)")
            return 1
        return code
    why = "SIGTERM (preemption or requeue)" if signals.term.is_set() else "SIGUSR1 (time limit near)"
    report.say(f"{why}: forwarding SIGTERM to the container, grace {settings.grace_s:g} s")
    t0 = time.monotonic()
    try:
        container.kill(signal="SIGTERM")
    except Exception as exc:  # noqa: BLE001 - it may have exited meanwhile
        report.say(f"could not signal the container: {exc}")

    def check_ending() -> None:
        # Asked after the container has its SIGTERM, so the check costs it no grace.
        if job_ending is not None and job_ending():
            report.say("Slurm is already ending the job (no grace left): stopping now")
            signals.urgent.set()

    if not _wait(done, settings.grace_s, signals, settings.poll_s, check_ending):
        if signals.urgent.is_set():
            if not _stop_now(done, settings, report, t0):
                # The finally of _run_once force-removes it (kill + remove) right away.
                return EXIT_PREEMPTED
        else:
            report.say(f"container still running after {settings.grace_s:g} s: killing it")
            try:
                container.kill(signal="SIGKILL")
            except Exception as exc:  # noqa: BLE001 - it may have exited meanwhile
                report.say(f"could not kill the container: {exc}")
            _wait(done, settings.kill_wait_s, signals, settings.poll_s)
    logs.join(timeout=0.5 if signals.urgent.is_set() else settings.kill_wait_s)
    report.say(
        f"container stopped with code {result.get('code', -1)} after "
        f"{time.monotonic() - t0:.1f} s of grace"
    )
    if signals.usr1.is_set() and not signals.term.is_set():
        return EXIT_REQUEUE_ME
    return EXIT_PREEMPTED


def preempted_in_this_run(show_job: str) -> bool:
    """True when `scontrol show job` says this run was preempted (PreemptTime >= StartTime).

    Both are local ISO times (2026-12-02T16:33:38) or None/Unknown: comparable as text.
    """
    fields = dict(
        word.split("=", 1) for word in show_job.split() if "=" in word and not word.startswith("=")
    )
    preempt, start = fields.get("PreemptTime", "None"), fields.get("StartTime", "Unknown")
    if not preempt[:1].isdigit() or not start[:1].isdigit():
        return False
    return preempt >= start


#: JobStates in which Slurm is ending the job (a requeue, scancel, the time limit, ...): a
#: SIGTERM then starts KillWait, not a grace period. RUNNING (a preemption's GraceTime, the
#: agent's step-only SIGTERM) and anything unknown keep the grace.
ENDING_STATES = frozenset({
    "COMPLETING", "CANCELLED", "TIMEOUT", "PENDING", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "FAILED", "NODE_FAIL", "PREEMPTED", "DEADLINE", "OUT_OF_MEMORY",
    "COMPLETED", "BOOT_FAIL", "SPECIAL_EXIT",
})


def job_state(show_job: str) -> str:
    """JobState from `scontrol show job` text ("" when absent)."""
    for word in show_job.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1].split("+", 1)[0].upper()
    return ""


def job_is_ending(job_id: str, run: Callable[[Sequence[str]], tuple[int, str]]) -> bool:
    """True when Slurm says the job is already being ended (see ENDING_STATES).

    Unknown (no job id, scontrol failing) is False: the runner then keeps the grace, and a
    second SIGTERM still stops it at once.
    """
    if not job_id:
        return False
    rc, out = run(["scontrol", "show", "job", job_id])
    return rc == 0 and job_state(out) in ENDING_STATES


def requeue_if_preempted(
    job_id: str, run: Callable[[Sequence[str]], tuple[int, str]]
) -> str:
    """After a clean stop, requeue a preempted job at once instead of idling out GraceTime.

    Slurm would requeue it anyway when GraceTime ends; doing it as soon as the checkpoint is
    taken hands the node back to inference earlier. A job stopped for another reason (a
    step-only signal, `scontrol requeue` already under way) is left to whoever signalled it.
    """
    if not job_id:
        return "not in a Slurm job: nothing to requeue"
    rc, out = run(["scontrol", "show", "job", job_id])
    if rc != 0 or not preempted_in_this_run(out):
        return "not preempted by Slurm: leaving the requeue to whoever stopped the job"
    rc, out = run(["scontrol", "requeue", job_id])
    if rc != 0:
        return f"early requeue of job {job_id} failed (Slurm requeues it after GraceTime): {out.strip()}"
    return f"preempted: requeued job {job_id} at once to hand the node back early"


def _run_command(argv: Sequence[str], timeout_s: float = 30) -> tuple[int, str]:
    import subprocess

    try:
        p = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return p.returncode, p.stdout + p.stderr


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="slurm-idle-run",
        description="Run a slurm-idle job spec's container inside a Slurm job step.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec-b64", help="the job spec as base64 JSON (what scripts pass)")
    src.add_argument("--spec", help="a job spec YAML/JSON file")
    src.add_argument("--cleanup", metavar="JOBID", help="remove JOBID's containers and exit")
    p.add_argument(
        "--grace-s", type=float, default=None,
        help=(
            "seconds from SIGTERM to killing the container (default: the spec's grace_s; "
            "generated batch scripts pass the spec's value). A second SIGTERM stops it at once"
        ),
    )
    p.add_argument(
        "--gpu-mode", choices=["auto", "nvidia", "env", "off"],
        default=os.environ.get("SLURM_IDLE_GPU_MODE", "auto"),
        help="auto: nvidia device requests only if the engine has an nvidia runtime",
    )
    p.add_argument(
        "--docker-host", default=None,
        help=("engine URL (default: the site's job_policy.runtime: a rootless podman service "
              "started for this job; docker: $DOCKER_HOST or the local socket)"),
    )
    return p.parse_args(argv)


def _client(docker_host: str | None, timeout: int | None = 60) -> Any:
    import docker

    if docker_host:
        return docker.DockerClient(base_url=docker_host, timeout=timeout)
    return docker.from_env(timeout=timeout)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `slurm-idle-run`; returns (and exits with) the codes documented above."""
    signals = Signals()
    signals.install()
    try:
        return _main(argv, signals)
    finally:
        signals.settle()


def _main(argv: Sequence[str] | None, signals: Signals) -> int:
    args = _parse_args(argv)
    report = Reporter(sys.stdout.buffer)
    service: PodmanService | None = None
    try:
        policy = site_policy(os.environ)
        spec = None
        if not args.cleanup:  # checked before any engine is reached or started
            spec = decode_spec(args.spec_b64) if args.spec_b64 else load_job_spec(args.spec)
            # The node's policy, not the script's say-so: resolved mounts, this process's uid.
            check_spec(spec.for_job(os.environ.get("SLURM_JOB_ID") or "none"),
                       policy, os.geteuid(), resolve=True)
        host = args.docker_host
        if host is None and policy.runtime == "podman" and not args.cleanup:
            service = PodmanService.for_job(os.environ.get("SLURM_JOB_ID", ""), os.environ)
            host = service.start()
            report.say(f"rootless podman service at {host}")
        elif host is None:
            host = os.environ.get("DOCKER_HOST")
        return _run(args, host, spec, service is not None, signals, report)
    except SlurmIdleError as exc:
        report.say(f"error: {exc}")
        return EXIT_START_FAILED
    finally:
        if service is not None:
            service.stop()


def _run(
    args: argparse.Namespace, host: str | None, spec: JobSpec | None, rootless: bool,
    signals: Signals, report: Reporter,
) -> int:
    try:
        client = _client(host)
        if args.cleanup:
            for name in remove_job_containers(client, args.cleanup):
                report.say(f"removed container {name}")
            return 0
    except SlurmIdleError as exc:
        report.say(f"error: {exc}")
        return EXIT_START_FAILED
    except Exception as exc:  # noqa: BLE001 - docker.errors.DockerException and friends
        report.say(f"error: cannot reach the container engine: {exc}")
        return EXIT_START_FAILED
    assert spec is not None  # only --cleanup runs without one
    grace = args.grace_s if args.grace_s is not None else spec.grace_s
    settings = RunSettings(
        grace_s=grace, gpu_mode=args.gpu_mode,
        engine_sockets=engine_sockets(host),
        # Rootless: the container's root is the job's user outside (its user namespace), so
        # files it writes in the mounts are the user's; a uid inside would be a subuid.
        uid=0 if rootless else os.getuid(), gid=0 if rootless else os.getgid(),
    )
    # Logs and wait block for as long as the container runs: no read timeout on that client.
    stream_client = _client(host, timeout=None)
    ctx = slurm_context(os.environ)
    settings = replace(settings, ledger_dir=state_dir(os.environ))
    return run_container(
        client, spec, ctx, settings, signals, report, stream_client=stream_client,
        early_requeue=lambda: requeue_if_preempted(ctx.job_id, _run_command),
        # Short: it runs inside the grace, maybe inside KillWait.
        job_ending=lambda: job_is_ending(ctx.job_id, lambda argv: _run_command(argv, 2.0)),
    )


if __name__ == "__main__":
    sys.exit(main())
