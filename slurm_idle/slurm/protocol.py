"""The narrow interface the agent uses to read and change Slurm, whatever the backend.

Two backends implement it: the CLI one (`sinfo`/`squeue`/`sacct --json`, `scontrol`, `sbatch`)
and the pyslurm one. Reads are batched: one command for all nodes and one for all jobs, so the
number of Slurm calls per tick does not grow with the fleet. Writes are idempotent where Slurm
lets them be (resuming a node that is not drained is a no-op, not an error).

The core types each use by the narrowest protocol that covers it: `ClusterReader` (observe),
`NodeWriter` (phase writes, pin), `JobControl` (eviction), `PoolSlurm` (all three: the tick's
driver) and `SlurmBackend` (everything, with submit/accounting/version). The fake in
`slurm_idle.testing.fakes` implements `SlurmBackend` too; `slurm_idle.testing.conformance`
makes mypy prove it, and tests/contract/test_protocols.py runs the same checks on both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from slurm_idle.errors import CommandError
from slurm_idle.model import SlurmJob, SlurmNode


class NotRequeueable(CommandError):
    """Slurm refuses to requeue the job: it is not a batch job (srun/salloc)."""


class AccountingDisabled(CommandError):
    """sacct says accounting is disabled (accounting_storage/none): the message says what to
    configure. A CommandError still, so callers that tolerate a failing sacct keep doing so."""

    HINT = ("Slurm accounting is disabled: the report needs slurmdbd "
            "(AccountingStorageType=accounting_storage/slurmdbd, AccountingStorageTRES=gres/gpu)")

    def __init__(self, argv: Sequence[str], rc: int, stderr: str) -> None:
        super().__init__(argv, rc, stderr)
        self.args = (self.HINT,)


@dataclass(frozen=True)
class AcctJob:
    """One job from accounting (`sacct`), for reports: what ran where, how long, on how many GPUs.

    `state` is the upper-case base state of the job's latest run (COMPLETED, PREEMPTED,
    REQUEUED, RUNNING, ...); `restarts` counts requeues when the accounting reports it.
    """

    job_id: int
    name: str
    partition: str
    state: str
    start: float | None  # unix seconds, None if it never started
    end: float | None  # unix seconds, None while running / never ran
    elapsed_s: float
    gpus: int
    restarts: int = 0
    nodes: tuple[str, ...] = ()
    comment: str = ""
    time_limit_s: float | None = None  # the job's time limit; None when unlimited or unknown
    user: str = ""
    exit_code: int | None = None  # the run's exit code (its batch script's); None when unknown
    signal: int | None = None  # the signal that ended the run, when one did
    reason: str = ""  # Slurm's state reason ("" for its "None")


@runtime_checkable
class ClusterReader(Protocol):
    """What observing the pool reads from Slurm: every node and every job, one query each
    (the agent's `observe` and the driver's shared polls need nothing else)."""

    def nodes(self) -> list[SlurmNode]:
        """Every node, in one query."""
        ...

    def jobs(self) -> list[SlurmJob]:
        """Every job the controller knows (pending, running, completing...), in one query."""
        ...


@runtime_checkable
class NodeWriter(Protocol):
    """What moving a node along its lifecycle writes into Slurm (and `pin` / `unpin`): its
    state, Reason and Comment. Each write is idempotent."""

    def drain(self, node: str, reason: str) -> None:
        """DRAIN a node with a Reason (also rewrites the Reason of an already drained node)."""
        ...

    def resume(self, node: str) -> None:
        """RESUME a node; a node that is not drained is left as it is (idempotent)."""
        ...

    def power_up(self, node: str) -> None:
        """Ask Slurm to power up a node its power saving suspended (`state=POWER_UP`); a node
        that is already up is left as it is (idempotent)."""
        ...

    def set_comment(self, node: str, comment: str) -> None:
        """Set the node's free-text Comment (our machine-readable phase data)."""
        ...


@runtime_checkable
class JobControl(Protocol):
    """What a reclaim does to the lend partition's jobs (eviction.py): warn, requeue, cancel,
    and watch their workload steps end."""

    def requeue(self, job_ids: Sequence[int], grace_s: float = 0) -> None:
        """Requeue jobs at once (grace_s must be 0, else ValueError: the caller signals and
        waits); a job that is not a batch job raises NotRequeueable."""
        ...

    def signal(self, job_ids: Sequence[int], signal: str, batch_shell: bool = False) -> None:
        """Send `signal` to the jobs' steps, or to their batch shell only."""
        ...

    def cancel(self, job_ids: Sequence[int], signal: str | None = None) -> None:
        """Cancel jobs, or only send them `signal` (e.g. "TERM") when it is given."""
        ...

    def workload_steps(self) -> dict[int, int]:
        """job id -> running workload steps, for every job, in one query."""
        ...


@runtime_checkable
class PoolSlurm(ClusterReader, NodeWriter, JobControl, Protocol):
    """Everything the agent's tick (observe, then the NodeDriver) needs from Slurm."""


@runtime_checkable
class SlurmBackend(PoolSlurm, Protocol):
    """Read and change the cluster: nodes, jobs, accounting (every backend implements all)."""

    @property
    def calls(self) -> int:
        """Commands (or API round trips) issued so far; the tick benchmark reads it."""
        ...

    def submit(self, script: str, extra_args: Sequence[str] = ()) -> int:
        """Submit a batch script (given as text) and return the job id."""
        ...

    def set_job_comment(self, job_id: int, comment: str) -> None:
        """Set a job's Comment (where a replica job of `placement: jobs` keeps its phase)."""
        ...

    def accounting(
        self,
        since: float | None,
        until: float | None,
        partition: str | None = None,
        job_ids: Sequence[int] = (),
    ) -> list[AcctJob]:
        """Finished and running jobs from accounting in a time window."""
        ...

    def version(self) -> str:
        """The Slurm release, e.g. "22.05.8"."""
        ...

    def cluster_name(self) -> str:
        """Slurm's ClusterName ("" when unset): with a job id, what names a job everywhere
        (two clusters, or a sandbox beside a cluster, reach the same job ids)."""
        ...
