"""The callable a submitit test job runs: importable on the node (the job unpickles it by
module path), as a researcher's own module would be.

`Counter` counts `steps` steps of `step_s` seconds and returns their sum; its state (steps done,
the steps each run started from) is its own attribute, so submitit's Checkpointable pickles it at
USR2 and the requeued run resumes where it was. Each step is also appended to `progress`, so the
test can tell when to reclaim and that no step was done twice.
"""

from __future__ import annotations

import os
import time

import submitit


class Counter(submitit.helpers.Checkpointable):  # type: ignore[misc]
    def __init__(self) -> None:
        self.done = 0
        self.starts: list[int] = []

    def __call__(self, steps: int, step_s: float, progress: str) -> dict[str, object]:
        self.starts.append(self.done)
        while self.done < steps:
            time.sleep(step_s)
            self.done += 1
            with open(progress, "a") as fh:
                fh.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {self.done}\n")
        return {"sum": steps * (steps + 1) // 2, "starts": self.starts}
