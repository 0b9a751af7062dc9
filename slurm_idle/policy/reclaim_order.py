"""Which lent node to reclaim first: the ranking the planner sorts its candidates by. Pure.

Two rules, in this order:
1. a node running a job younger than `policy.min_job_runtime_s` goes last (like Slurm's
   PreemptExemptTime): a job that just started is left alone whenever another lent node can be
   reclaimed instead. It only orders candidates: when the service needs every lent node, the
   protected ones are reclaimed too;
2. then the node whose jobs would lose the least work (GPU-seconds since their last checkpoint).
The planner takes as many nodes from the front of this order as the model needs; a node
chooser working in lend groups (several nodes at once) can rank groups by the worst key of
their nodes.
"""

from __future__ import annotations

from slurm_idle.model import NodeView


def lost_work(view: NodeView, now: float, checkpoint_interval_s: float | None) -> float:
    """GPU-seconds of work the node's jobs would lose (unknown start: assume the worst).

    Slurm does not know checkpoints: with `report.checkpoint_interval_s` set, a job is taken
    to have checkpointed at every multiple of it since its start (so it loses `age % interval`);
    without it, all of its run (the youngest job loses least).
    """
    lost = 0.0
    for job in view.jobs:
        age = now - job.start_time if job.start_time is not None else float("inf")
        if checkpoint_interval_s and age != float("inf"):
            age %= checkpoint_interval_s
        lost += max(1, job.gpus) * max(0.0, age)
    return lost


def young_jobs(view: NodeView, now: float, min_job_runtime_s: float) -> list[int]:
    """Ids of the node's jobs that started less than `min_job_runtime_s` ago (none when 0;
    a job of unknown start is not known to be young)."""
    if min_job_runtime_s <= 0:
        return []
    return [j.job_id for j in view.jobs
            if j.start_time is not None and now - j.start_time < min_job_runtime_s]


def reclaim_rank(
    view: NodeView, now: float, checkpoint_interval_s: float | None, min_job_runtime_s: float
) -> tuple[bool, float, int, str]:
    """Sort key of a lent node for reclaim (smallest first): protected by the minimum run
    time, then work lost, GPUs in use, and the name (a stable tie-break)."""
    return (
        bool(young_jobs(view, now, min_job_runtime_s)),
        lost_work(view, now, checkpoint_interval_s),
        view.node.gpus_used,
        view.name,
    )
