"""`placement: jobs` in the simulator: how long each phase of a replica job lasts.

A jobs-mode replica moves through the same phases as a node (lifecycle.JOB_EDGES), but its
edges wait for other things, so the simulator charges other latencies (each edge's `Ready`):

  ENGINES_IDLE    `drain_s`           (RETIRING: in-flight requests finish, as in node mode)
  JOB_GONE        `cancel_s`          (LENDING: `scancel`, vLLM exits within --shutdown-timeout)
  NOW             0                   (LENT -> RECLAIMING: the `sbatch` itself)
  JOB_RUNNING     `queue_s + grace_s` (RECLAIMING: Slurm's scheduling and preemption delay,
                                       then the idle jobs' GraceTime before their GPUs free)
  ENGINES_SERVING `start_s`/`wake_s`  (STARTING: the engine's cold start)

So a reclaim costs grace + queue + start and a lend drain + cancel. Each replica is its own
lend unit (GPU-granular): a jobs-mode FleetModel has one replica per "node". The defaults of
`queue_s` and `cancel_s` are the sandbox's measured values (tests/e2e/test_jobs_placement.py
prints them: MEASURE lines).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_idle.lifecycle import JOB_LIFECYCLE, Ready
from slurm_idle.model import Phase

if TYPE_CHECKING:  # engine.py imports this module
    from slurm_idle.sim.engine import SimParams

#: Slurm's delay from `sbatch` of a replica job to its start, GraceTime left out: the
#: scheduler's pass that preempts, and the one that starts the job once the GPUs are free
#: (measured on the sandbox, Slurm 22.05 and 24.11: a few seconds).
QUEUE_S = 5.0
#: `scancel` of a replica job to the job leaving the queue: vLLM's --shutdown-timeout bounds it.
CANCEL_S = 5.0


def job_ready_latency(params: SimParams, ready: Ready) -> float:
    """What a replica-job edge's wait costs in the simulation."""
    return {
        Ready.NOW: 0.0,
        Ready.ENGINES_IDLE: params.drain_s,
        Ready.JOB_GONE: params.cancel_s,
        Ready.JOB_RUNNING: params.queue_s + params.grace_s,
        Ready.ENGINES_SERVING: params.engine_start_s,
        Ready.GPUS_FREE: 0.0,  # simulated GPUs are never held by a leftover
    }[ready]


def job_phase_latency(params: SimParams, phase: Phase) -> float:
    """How long a replica job's transitional phase lasts (its forward edge's wait); KeyError
    for a settled phase."""
    edge = JOB_LIFECYCLE.forward.get(phase)
    if edge is None:
        raise KeyError(phase)
    return job_ready_latency(params, edge.ready)


def job_reclaim_s(params: SimParams) -> float:
    """A reclaim decision to serving: grace + queue + start."""
    return sum(job_phase_latency(params, p) for p in (Phase.RECLAIMING, Phase.STARTING))


def job_lend_s(params: SimParams) -> float:
    """A lend decision to the GPUs being the idle partition's: drain + cancel."""
    return sum(job_phase_latency(params, p) for p in (Phase.RETIRING, Phase.LENDING))


def job_reclaim_steps(params: SimParams) -> int:
    """Steps from a reclaim decision to the replica serving (the simulation's steps)."""
    return params.steps(params.queue_s + params.grace_s) + params.steps(params.engine_start_s)
