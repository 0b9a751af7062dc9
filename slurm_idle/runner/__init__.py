"""The in-job container runner (`slurm-idle-run`, `python -m slurm_idle.job_step`, which holds
Slurm's signals while this package is imported).

The package: container.py (what the container is created with; host checks), supervise.py
(signals -> SIGTERM/SIGKILL within the grace, with an injected clock), run.py (one run: completion,
restart budget, ledger, retries), slurmjob.py (the job's own state from `scontrol show job`,
through the command runner; its text parsers live in slurm/text.py) and cli.py (the command line).

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

The image comes from the engine's store as the node's `job_policy.pull` allows: `never` asks no
registry (not even a name lookup) and fails a job whose image is not there with exit 70, before
any container starts, in one line naming the image, the node and how to load it there
(`docker load`, or `podman load` as the job's user: a rootless store is the user's own);
`missing` pulls an absent image, `always` every run. One rule (container.ensure_image) for
docker and rootless podman alike.

`job_policy.runtime: charliecloud` runs the container with `ch-run` (unprivileged, no daemon,
no store; charliecloud.py) as a child of the runner behind the same docker-SDK-shaped calls, so
the supervisor and everything above are unchanged: the signals, the grace, the urgent stop,
the exit codes, the ledger and the completion marker. Its image is a directory on the node
(job_policy.charliecloud_images), never pulled: a missing one fails with exit 70 in one line
naming the image, the node, the directory and how to make it. ch-run execs in place, so the
runner's SIGTERM goes to the workload itself; the workload is the caller (the job's user);
GPUs go by environment (as `--gpu-mode env`); only the container's environment reaches it.

An engine's container always runs as the job's uid:gid, unprivileged, with no-new-privileges,
never with the engine socket mounted, with `init=True`, and is always removed (finally, plus a
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

from slurm_idle.jobs import EXIT_PREEMPTED, EXIT_REQUEUE_ME
from slurm_idle.runner.cli import main
from slurm_idle.runner.container import (
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_NAME,
    LABEL_RESTART,
    PARAMS_TARGET,
    GpuMode,
    SlurmContext,
    check_no_engine_socket,
    container_env,
    container_kwargs,
    container_name,
    engine_sockets,
    gpu_env,
    mem_bytes,
    remove_job_containers,
    slurm_context,
    wants_device_requests,
)
from slurm_idle.runner.run import EXIT_MAX_RESTARTS, EXIT_START_FAILED, run_container
from slurm_idle.runner.slurmjob import job_is_ending, requeue_if_preempted
from slurm_idle.runner.supervise import Clock, RealClock, Reporter, RunSettings, Signals
from slurm_idle.slurm.text import ENDING_STATES, preempted_in_this_run, show_job_state

__all__ = [
    "ENDING_STATES", "EXIT_MAX_RESTARTS", "EXIT_PREEMPTED", "EXIT_REQUEUE_ME", "EXIT_START_FAILED",
    "LABEL_JOB", "LABEL_MANAGED", "LABEL_NAME", "LABEL_RESTART", "PARAMS_TARGET", "Clock",
    "GpuMode", "RealClock", "Reporter", "RunSettings", "Signals", "SlurmContext",
    "check_no_engine_socket", "container_env", "container_kwargs", "container_name",
    "engine_sockets", "gpu_env", "job_is_ending", "main", "mem_bytes", "preempted_in_this_run",
    "remove_job_containers", "requeue_if_preempted", "run_container", "show_job_state",
    "slurm_context", "wants_device_requests",
]
