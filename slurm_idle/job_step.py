"""The srun step of every generated batch script (`python -m slurm_idle.job_step`, and the
`slurm-idle-run` command): holds Slurm's signals from the first line, then runs the runner.

Why a module of its own, with nothing but the standard library above the runner's import:
Slurm may send the time-limit warning (`--signal=USR1@N`) as soon as the step starts (it checks
on its own ~30 s beat and may signal up to a minute early), and a preemption's SIGTERM at any
time. The default action of SIGUSR1 is death, and importing the runner (pydantic, the docker
SDK) takes seconds on a busy node: a warning in that window killed the step ("task 0: User
defined signal 1") and the job ended FAILED instead of being requeued. So the signals are only
recorded here, in the order they came, and the runner's `Signals` replays them once its own
handlers are installed.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from types import FrameType

#: The signals the runner acts on (runner.supervise.Signals.install).
HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def hold_signals() -> list[int]:
    """Record HELD signals instead of dying of them; the list fills as they come."""
    held: list[int] = []

    def record(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    for signum in HELD:
        signal.signal(signum, record)
    return held


def main(argv: Sequence[str] | None = None) -> int:
    """Hold the signals, then run `slurm-idle-run` with what came meanwhile."""
    held = hold_signals()
    # Only now, with the signals held: this import takes seconds on a busy node.
    from slurm_idle.runner.cli import main as run

    return run(argv, held=held)


if __name__ == "__main__":
    sys.exit(main())
