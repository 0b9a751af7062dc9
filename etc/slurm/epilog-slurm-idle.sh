#!/bin/sh
# Slurm Epilog (runs as root on the node after every job): remove any container slurm-idle's
# runner left behind for this job. The runner always removes its container itself; this covers
# the one case it cannot: Slurm SIGKILLs the runner (KillWait after a requeue's SIGTERM) while
# the workload is still checkpointing. Install as `Epilog=/etc/slurm/epilog.d/slurm-idle.sh`
# (or call it from your existing Epilog). DOCKER_HOST must name the node's container engine if
# it is not the default socket.
[ -n "${SLURM_JOB_ID:-}" ] || exit 0
command -v slurm-idle-run >/dev/null 2>&1 || exit 0
# Never fail the epilog (a failing Epilog drains the node): log and go on.
slurm-idle-run --cleanup "$SLURM_JOB_ID" >/dev/null 2>&1 || logger -t slurm-idle "epilog cleanup of job $SLURM_JOB_ID failed"
exit 0
