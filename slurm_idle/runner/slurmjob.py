"""What the runner asks Slurm about its own job, through the command runner.

`scontrol show job` text is parsed by slurm/text.py (beside the other Slurm parsers); the
commands run through a `CommandRunner` (slurm_idle.commands), so tests replay captured output.
"""

from __future__ import annotations

from slurm_idle.commands import CommandRunner
from slurm_idle.errors import CommandError
from slurm_idle.slurm.text import ENDING_STATES, preempted_in_this_run, show_job_state

#: `scontrol show job` while the job is being stopped: short, it runs inside the grace (maybe
#: inside KillWait).
ENDING_CHECK_TIMEOUT_S = 2.0
#: The early requeue runs after the container is gone: Slurm's usual command timeout.
REQUEUE_TIMEOUT_S = 30.0


def _show_job(job_id: str, runner: CommandRunner, timeout_s: float) -> str | None:
    """`scontrol show job JOBID` text, None when scontrol fails or times out."""
    try:
        return runner.run(["scontrol", "show", "job", job_id], timeout=timeout_s).stdout
    except (CommandError, OSError):
        return None


def job_is_ending(job_id: str, runner: CommandRunner,
                  timeout_s: float = ENDING_CHECK_TIMEOUT_S) -> bool:
    """True when Slurm says the job is already being ended (see ENDING_STATES).

    Unknown (no job id, scontrol failing) is False: the runner then keeps the grace, and a
    second SIGTERM still stops it at once.
    """
    if not job_id:
        return False
    out = _show_job(job_id, runner, timeout_s)
    return out is not None and show_job_state(out) in ENDING_STATES


def was_preempted(job_id: str, runner: CommandRunner,
                  timeout_s: float = ENDING_CHECK_TIMEOUT_S) -> bool:
    """True when Slurm says this run of the job is being preempted (its PreemptTime is set,
    measured on 22.05 during GraceTime); unknown is False (the stop stays a time-limit one)."""
    if not job_id:
        return False
    out = _show_job(job_id, runner, timeout_s)
    return out is not None and preempted_in_this_run(out)


def requeue_if_preempted(job_id: str, runner: CommandRunner,
                         timeout_s: float = REQUEUE_TIMEOUT_S) -> str:
    """After a clean stop, requeue a preempted job at once instead of idling out GraceTime.

    Slurm would requeue it anyway when GraceTime ends; doing it as soon as the checkpoint is
    taken hands the node back to inference earlier. A job stopped for another reason (a
    step-only signal, `scontrol requeue` already under way) is left to whoever signalled it.
    """
    if not job_id:
        return "not in a Slurm job: nothing to requeue"
    out = _show_job(job_id, runner, timeout_s)
    if out is None or not preempted_in_this_run(out):
        return "not preempted by Slurm: leaving the requeue to whoever stopped the job"
    try:
        runner.run(["scontrol", "requeue", job_id], timeout=timeout_s)
    except (CommandError, OSError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, CommandError) else str(exc)
        return (f"early requeue of job {job_id} failed (Slurm requeues it after GraceTime): "
                f"{detail}")
    return f"preempted: requeued job {job_id} at once to hand the node back early"
