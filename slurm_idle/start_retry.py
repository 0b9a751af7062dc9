"""A start or wake that fails is retried with a bounded backoff, then once cold, then given up.

vLLM answers a wake on a GPU someone else still holds with HTTP 500 (`CUDA error: out of
memory`) and leaks what it had mapped, so the next wakes can fail even after the holder is
gone. Retrying every tick hammers it; counting the replica as coming back for
`timeouts.start_s` keeps the model short while a wake is expected within seconds. So: each
failure is counted in the engine notes (engine_notes.py) and the next try waits 15 s, 30 s,
60 s ... (at most `engine.start_timeout_s`); after `engine.wake_attempts` failures the engine
is restarted cold once where its kind can (http-sleep with start/stop commands); after that the
replica is given up: the node goes to the admin (handover.py) and the planner, which stopped
counting a failing replica at its first failure, has taken capacity elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.engine_notes import EngineNotes
from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import iso

if TYPE_CHECKING:
    from slurm_idle.engine import Engine


class After(StrEnum):
    """What a failed start or wake leads to."""

    RETRY = "retry"  # an error now, the next try after the backoff
    COLD = "cold"  # the cold restart was issued: wait for its start
    GIVE_UP = "give_up"  # every attempt spent: the node goes to the admin


class StartRetries:
    """Per replica: may a start be tried now, and what a failure leads to."""

    def __init__(self, config: Config, notes: EngineNotes, engine_for: Callable[[str], Engine],
                 clock: Callable[[], float]) -> None:
        self.config, self.notes, self.engine_for, self.clock = config, notes, engine_for, clock

    def given_up(self, model: str, replica: ReplicaConfig) -> str | None:
        """Why the replica is given up (every attempt and the cold restart spent), else None."""
        failures = self.notes.failures(replica.name)
        if failures is None or not failures.given_up:
            return None
        return f"{replica.name}: {failures.attempts} starts or wakes failed (last: {failures.last_error})"

    def backing_off(self, model: str, replica: ReplicaConfig) -> str | None:
        """Why no start is tried now (the backoff after a failure), else None."""
        failures = self.notes.failures(replica.name)
        if failures is None:
            return None
        at = failures.next_try(self._cap(model))
        if self.clock() >= at:
            return None
        what = ("cold restart issued" if failures.cold_restarted
                else f"start or wake failed {failures.attempts} of {self._attempts(model)} time(s)")
        return f"{replica.name}: {what} (last: {failures.last_error}); next try at {iso(at)}"

    def failed(self, model: str, replica: ReplicaConfig, error: SlurmIdleError,
               timeout_s: float) -> tuple[After, str]:
        """Count a failed start or wake: what follows, and why."""
        now = self.clock()
        failures = self.notes.failed(replica.name, str(error), now)
        attempts = self._attempts(model)
        if failures.attempts < attempts:
            at = failures.next_try(self._cap(model))
            return After.RETRY, (f"{replica.name}: start or wake {failures.attempts} of {attempts} failed: "
                          f"{error}; next try at {iso(at)}")
        if not failures.cold_restarted:
            self.notes.cold_restarted(replica.name, now)
            try:
                issued = self.engine_for(model).cold_restart(replica, timeout_s)
            except SlurmIdleError as exc:
                self.notes.give_up(replica.name)
                return After.GIVE_UP, (f"{replica.name}: {attempts} starts or wakes failed ({error}); "
                                       f"cold restart failed: {exc}")
            if issued:
                return After.COLD, (f"{replica.name}: {attempts} starts or wakes failed ({error}): cold "
                              "restart issued (engine stop_command, then start_command)")
        self.notes.give_up(replica.name)
        return After.GIVE_UP, f"{replica.name}: {failures.attempts} starts or wakes failed (last: {error})"

    def served(self, replica: ReplicaConfig) -> None:
        self.notes.served(replica.name)

    def failures(self, replica: ReplicaConfig) -> int:
        """Starts or wakes of the replica that failed since it last served (0: none)."""
        failures = self.notes.failures(replica.name)
        return failures.attempts if failures is not None else 0

    def _attempts(self, model: str) -> int:
        return self.config.engine_for(model).wake_attempts

    def _cap(self, model: str) -> float:
        return self.config.engine_for(model).start_timeout_s
