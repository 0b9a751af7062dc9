"""The pyslurm backend maps pyslurm objects onto the domain types (a stand-in module).

Only the mapping is checked here; real pyslurm is exercised by tests/contract/
test_slurm_pyslurm.py wherever it imports.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from slurm_idle.commands import ReplayRunner
from slurm_idle.errors import CommandError
from slurm_idle.slurm import CliBackend
from slurm_idle.slurm.pyslurm_backend import PyslurmBackend


def fake_pyslurm(nodes: dict[str, Any], jobs: dict[int, Any], fail: str = "") -> Any:
    log: list[tuple[str, Any, dict[str, Any]]] = []

    class Node:
        def __init__(self, name: str | None = None, **changes: Any) -> None:
            self.name, self.changes = name, changes

        def modify(self, changes: Any) -> None:
            if fail:
                raise RuntimeError(fail)
            log.append(("modify", self.name, changes.changes))

    class Job:
        def __init__(self, job_id: int) -> None:
            self.id = job_id

        def requeue(self) -> None:
            log.append(("requeue", self.id, {}))

        def cancel(self) -> None:
            log.append(("cancel", self.id, {}))

        def send_signal(self, signal: str) -> None:
            log.append(("signal", self.id, {"signal": signal}))

    return SimpleNamespace(
        __version__="25.11.0", log=log, Node=Node, Job=Job,
        Nodes=SimpleNamespace(load=lambda: nodes), Jobs=SimpleNamespace(load=lambda: jobs))


def backend(module: Any) -> PyslurmBackend:
    return PyslurmBackend(CliBackend(runner=ReplayRunner({})), module)


def test_nodes_and_jobs_mapped() -> None:
    """Node state strings, GRES dicts and job fields become SlurmNode/SlurmJob values."""
    node = SimpleNamespace(name="gpu1", state="MIXED+DRAIN", reason="slurm-idle:x",
                           configured_gres={"gpu": 4}, allocated_gres={"gpu:a100": 2},
                           partitions=["idle"], comment="c", reason_time=100)
    job = SimpleNamespace(id=7, name="j", partition="idle", state="RUNNING",
                          allocated_nodes="gpu[1-2]", gres_per_node={"gpu": 1}, restart_count=2,
                          requeue=True, start_time=50, comment="", user_name="u", state_reason="None")
    b = backend(fake_pyslurm({"gpu1": node}, {7: job}))
    (n,) = b.nodes()
    assert (n.state, n.flags, n.gpus_total, n.gpus_used) == ("mixed", frozenset({"DRAIN"}), 4, 2)
    assert n.reason_changed_at == 100.0
    (j,) = b.jobs()
    assert j.nodes == ("gpu1", "gpu2") and j.gpus == 2 and j.restart_count == 2
    assert b.calls == 2 and b.version() == "25.11.0"


def test_node_changes_and_requeue() -> None:
    """drain/resume/comment modify the node; requeue and cancel act per job."""
    module = fake_pyslurm({}, {})
    b = backend(module)
    b.drain("gpu1", "why")
    b.resume("gpu1")
    b.set_comment("gpu1", "c")
    b.requeue([3])
    b.cancel([4], signal="USR1")
    assert module.log == [
        ("modify", "gpu1", {"state": "DRAIN", "reason": "why"}),
        ("modify", "gpu1", {"state": "RESUME"}),
        ("modify", "gpu1", {"comment": "c"}),
        ("requeue", 3, {}),
        ("signal", 4, {"signal": "USR1"}),
    ]


def test_resume_not_drained_is_noop_and_errors_wrap() -> None:
    """An invalid-state resume is a no-op; other library errors become CommandError."""
    backend(fake_pyslurm({}, {}, fail="Invalid node state specified")).resume("gpu1")
    with pytest.raises(CommandError, match="boom"):
        backend(fake_pyslurm({}, {}, fail="boom")).drain("gpu1", "x")
