"""SlurmBackend over pyslurm (25.11 API): library calls instead of commands, same protocol.

pyslurm builds only against its own Slurm release, which no Debian release ships (see NOTES),
so this backend cannot run on the test machines; its contract tests skip with that reason and
it is chosen only when `slurm.backend` says so, or on `auto` when pyslurm imports and its
version matches the cluster's. Attribute names differ between pyslurm releases, so reads go
through `_attr` with the known spellings. Submitting and accounting stay on the CLI backend
(sbatch arguments and sacct filters have no one-to-one pyslurm form).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from slurm_idle.errors import CommandError, ConfigError
from slurm_idle.hostlist import expand_hostlist
from slurm_idle.model import SlurmJob, SlurmNode
from slurm_idle.slurm import parse
from slurm_idle.slurm.cli_backend import CliBackend
from slurm_idle.slurm.protocol import AcctJob, NotRequeueable


def import_pyslurm() -> ModuleType:
    """Import pyslurm or say what to do instead."""
    try:
        return importlib.import_module("pyslurm")
    except ImportError as exc:
        raise ConfigError(
            f"slurm.backend is 'pyslurm' but pyslurm does not import ({exc}); "
            "install the pyslurm matching your Slurm release or use backend: cli"
        ) from None


def pyslurm_version(module: ModuleType) -> str:
    """pyslurm's release, e.g. "25.11.0" (its major.minor is the Slurm it was built for)."""
    version = getattr(module, "__version__", None)
    if version is None and callable(getattr(module, "version", None)):
        version = module.version()
    return str(version or "0.0.0")


def _attr(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


def _gres_total(gres: Any, name: str = "gpu") -> int:
    """pyslurm reports GRES as a dict ({"gpu": 4} or {"gpu:tesla": 4}) or as a string."""
    if isinstance(gres, dict):
        untyped = sum(int(v) for k, v in gres.items() if k == name)
        typed = sum(int(v) for k, v in gres.items() if k.startswith(name + ":"))
        return untyped or typed
    return parse.gres_count(gres or "", name)


class PyslurmBackend:
    """SlurmBackend through pyslurm; submit/accounting delegated to a CliBackend."""

    def __init__(self, cli: CliBackend, module: ModuleType | None = None) -> None:
        self.pyslurm = module or import_pyslurm()
        self.cli = cli
        self._own_calls = 0

    @property
    def calls(self) -> int:
        return self._own_calls + self.cli.calls

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._own_calls += 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - pyslurm raises RPCError, ValueError, ...
            raise CommandError(["pyslurm", what], 1, str(exc)) from None

    def nodes(self) -> list[SlurmNode]:
        loaded = self._call("Nodes.load", self.pyslurm.Nodes.load)
        result = []
        for node in loaded.values():
            base, flags = parse._split_state(_attr(node, "state", default="UNKNOWN"))
            result.append(
                SlurmNode(
                    name=str(node.name),
                    state=base,
                    flags=flags,
                    reason=str(_attr(node, "reason", default="")),
                    gpus_total=_gres_total(_attr(node, "configured_gres", "gres")),
                    gpus_used=_gres_total(_attr(node, "allocated_gres", "gres_used")),
                    partitions=tuple(_attr(node, "partitions", default=()) or ()),
                    comment=str(_attr(node, "comment", default="")),
                    reason_changed_at=parse.timestamp(_attr(node, "reason_time")),
                )
            )
        return result

    def jobs(self) -> list[SlurmJob]:
        loaded = self._call("Jobs.load", self.pyslurm.Jobs.load)
        result = []
        for job in loaded.values():
            state = parse.job_state(str(_attr(job, "state", default="UNKNOWN")))
            hosts = str(_attr(job, "allocated_nodes", "nodes", default="") or "")
            nodes = tuple(expand_hostlist(hosts)) if hosts else ()
            gpus = _gres_total(_attr(job, "gres_per_node", default={})) * max(len(nodes), 1)
            result.append(
                SlurmJob(
                    job_id=int(_attr(job, "id", "job_id")),
                    name=str(_attr(job, "name", default="")),
                    partition=str(_attr(job, "partition", default="")),
                    state=state,
                    nodes=nodes,
                    restart_count=int(_attr(job, "restart_count", "requeue_count", default=0)),
                    requeue=bool(_attr(job, "requeue", "is_requeueable", default=True)),
                    start_time=None if state == "PENDING" else parse.timestamp(
                        _attr(job, "start_time")
                    ),
                    gpus=gpus,
                    comment=str(_attr(job, "comment", default="") or ""),
                    user=str(_attr(job, "user_name", default="") or ""),
                    state_reason=str(_attr(job, "state_reason", default="") or ""),
                    account=str(_attr(job, "account", default="") or ""),
                    submit_time=parse.timestamp(_attr(job, "submit_time")),
                )
            )
        return result

    def _modify_node(self, node: str, **changes: Any) -> None:
        target = self.pyslurm.Node(node)
        self._call("Node.modify", target.modify, self.pyslurm.Node(**changes))

    def drain(self, node: str, reason: str) -> None:
        if not reason:
            raise ValueError("Slurm requires a reason to drain a node")
        self._modify_node(node, state="DRAIN", reason=reason)

    def resume(self, node: str) -> None:
        try:
            self._modify_node(node, state="RESUME")
        except CommandError as exc:
            if "invalid node state" in exc.stderr.lower():
                return  # not drained: nothing to resume
            raise

    def power_up(self, node: str) -> None:
        try:
            self._modify_node(node, state="POWER_UP")
        except CommandError as exc:
            if "invalid node state" in exc.stderr.lower():
                return  # already up: nothing to do
            raise

    def set_comment(self, node: str, comment: str) -> None:
        self._modify_node(node, comment=comment)

    def requeue(self, job_ids: Sequence[int], grace_s: float = 0) -> None:
        if grace_s:
            raise ValueError("requeue() no longer waits: signal() first and wait in the caller")
        for job_id in job_ids:
            try:
                self._call("Job.requeue", self.pyslurm.Job(job_id).requeue)
            except CommandError as exc:
                if "only batch jobs are accepted" in exc.stderr.lower():
                    raise NotRequeueable(exc.argv, exc.rc, exc.stderr) from None
                if "pending execution" not in exc.stderr.lower():
                    raise

    def signal(self, job_ids: Sequence[int], signal: str, batch_shell: bool = False) -> None:
        # scancel's --batch has no stable pyslurm spelling across releases: the CLI's.
        self.cli.signal(job_ids, signal, batch_shell)

    def workload_steps(self) -> dict[int, int]:
        return self.cli.workload_steps()

    def job_signal(self, job_id: int) -> Any:
        return self.cli.job_signal(job_id)

    def cancel(self, job_ids: Sequence[int], signal: str | None = None) -> None:
        for job_id in job_ids:
            job = self.pyslurm.Job(job_id)
            if signal:
                self._call("Job.send_signal", job.send_signal, signal)
            else:
                self._call("Job.cancel", job.cancel)

    def submit(self, script: str, extra_args: Sequence[str] = ()) -> int:
        return self.cli.submit(script, extra_args)

    def set_job_comment(self, job_id: int, comment: str) -> None:
        self.cli.set_job_comment(job_id, comment)

    def accounting(
        self,
        since: float | None,
        until: float | None,
        partition: str | None = None,
        job_ids: Sequence[int] = (),
    ) -> list[AcctJob]:
        return self.cli.accounting(since, until, partition, job_ids)

    def version(self) -> str:
        return pyslurm_version(self.pyslurm)

    def cluster_name(self) -> str:
        return self.cli.cluster_name()
