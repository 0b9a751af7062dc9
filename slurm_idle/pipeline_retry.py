"""`pipeline retry NAME`: resubmit the failed steps and everything downstream, keep the rest.

Which steps to redo is a pure decision over the recorded DAG and the current step states
(`plan_retry`); `retry_pipeline` then cancels what of them still waits in the queue (a
downstream step Slurm has not cancelled yet), submits them in the recorded order with the
recorded batch scripts, and rewrites the record with the new job ids.

A completed upstream that is kept gives no dependency (Slurm may have forgotten its job id,
and `afterok` on an unknown id is refused); a kept upstream still queued or running gives
`afterok` on its job id, as in the first submission.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_idle.errors import SlurmIdleError
from slurm_idle.pipeline import FAILED_STATES, StepStatus, Submitter, dependency_args

#: States in which a step will not run again by itself and has not succeeded.
REDO_STATES = FAILED_STATES | {"UNKNOWN", "PREEMPTED"}


@dataclass(frozen=True)
class RetryPlan:
    redo: tuple[str, ...]  # in the recorded (topological) order
    cancel: tuple[int, ...]  # job ids of redo steps still queued or running
    kept: tuple[str, ...]


def plan_retry(steps: Sequence[StepStatus], completed: frozenset[str] = frozenset()) -> RetryPlan:
    """Failed steps (and UNKNOWN ones unless `completed` says the ledger saw them succeed),
    plus every step downstream of them. Raises when nothing failed."""
    failed = {s.name for s in steps if s.state in REDO_STATES and s.name not in completed}
    if not failed:
        raise SlurmIdleError("no step failed: nothing to retry (see `slurm-idle pipeline status`)")
    redo = set(failed)
    for s in steps:  # recorded order is topological: one pass reaches every descendant
        if any(u in redo for u in s.depends_on):
            redo.add(s.name)
    order = tuple(s.name for s in steps if s.name in redo)
    cancel = tuple(s.job_id for s in steps
                   if s.name in redo and s.state not in REDO_STATES | {"COMPLETED"})
    return RetryPlan(order, cancel, tuple(s.name for s in steps if s.name not in redo))


def retry_pipeline(
    record: Mapping[str, Any], steps: Sequence[StepStatus], slurm: Submitter, plan: RetryPlan,
    now: float,
) -> dict[str, Any]:
    """Carry out `plan`; return the new record (the caller writes it)."""
    rows = {r["name"]: dict(r) for r in record["steps"]}
    missing = [n for n in plan.redo if not rows[n].get("script")]
    if missing:
        raise SlurmIdleError(
            f"the record of {record['pipeline']!r} has no batch script for {', '.join(missing)} "
            "(submitted by an older slurm-idle): run the pipeline again"
        )
    state = {s.name: s.state for s in steps}
    if plan.cancel:
        slurm.cancel(list(plan.cancel))
    new_ids: dict[str, int] = {}
    for name in plan.redo:
        ups = []
        for up in rows[name].get("depends_on", ()):
            if up in new_ids:
                ups.append(new_ids[up])
            elif state.get(up) != "COMPLETED":
                ups.append(int(rows[up]["job_id"]))
        new_ids[name] = slurm.submit(rows[name]["script"], dependency_args(ups))
    for name, job_id in new_ids.items():
        rows[name]["previous_job_ids"] = [*rows[name].get("previous_job_ids", []),
                                          rows[name]["job_id"]]
        rows[name]["job_id"] = job_id
    return {
        **record,
        "attempt": int(record.get("attempt", 1)) + 1,
        "retried_at": now,
        "steps": [rows[r["name"]] for r in record["steps"]],
    }
