"""Contract tests of the CLI Slurm backend against the sandbox's real Slurm (and slurmdbd).

What the agent relies on: one query lists every node and job; drain/resume/comment round-trip;
resume is idempotent; a requeued job comes back PENDING with its restart counted (never FAILED
or CANCELLED); the graceful requeue signals steps before the batch shell; accounting sees the
runs; commands time out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.commands import TIMEOUT_RC, SubprocessRunner
from slurm_idle.config import load_config
from slurm_idle.errors import CommandError
from slurm_idle.model import SlurmJob
from slurm_idle.slurm import CliBackend, make_backend
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

NEVER = {"FAILED", "CANCELLED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "TIMEOUT"}


@pytest.fixture(scope="module")
def slurm(sandbox: Any) -> CliBackend:
    return CliBackend(runner=SubprocessRunner(env=sandbox.env()), timeout_s=30)


@pytest.fixture()
def jobs_to_cancel(slurm: CliBackend) -> Iterator[list[int]]:
    ids: list[int] = []
    yield ids
    if ids:
        slurm.cancel(ids)


def job(slurm: CliBackend, job_id: int) -> SlurmJob | None:
    return next((j for j in slurm.jobs() if j.job_id == job_id), None)


def test_nodes_lists_four_gpu_nodes_in_one_call(slurm: CliBackend) -> None:
    """nodes() is one command and shows the 4 sandbox nodes with 4 GPUs in both partitions."""
    slurm.nodes()  # the first call may learn the release
    before = slurm.calls
    nodes = {n.name: n for n in slurm.nodes()}
    assert slurm.calls == before + 1
    pool = {n: nodes[n] for n in ("gpu1", "gpu2", "gpu3", "gpu4")}
    for node in pool.values():
        assert node.gpus_total == 4
        assert {"idle", "inference"} <= set(node.partitions)
    # gpu8: the node of the `placement: jobs` model (closed unless a test opens it).
    assert nodes["gpu8"].gpus_total == 8 and {"idle", "serve"} <= set(nodes["gpu8"].partitions)


def test_version_matches_sandbox(slurm: CliBackend, sandbox: Any) -> None:
    """version() reports the release the sandbox runs."""
    assert slurm.version() == sandbox.slurm_version


def test_drain_comment_resume_round_trip(slurm: CliBackend) -> None:
    """A drain reason and a comment show up in nodes(); resume clears DRAIN and is idempotent."""
    reason = "slurm-idle:serving since=2026-12-02T10:00:00Z"
    try:
        slurm.drain("gpu4", reason)
        slurm.set_comment("gpu4", "slurm-idle phase=serving since=1796205600")
        node = {n.name: n for n in slurm.nodes()}["gpu4"]
        assert node.drained and node.reason == reason
        assert node.comment == "slurm-idle phase=serving since=1796205600"
        assert node.reason_changed_at is not None
        slurm.drain("gpu4", reason + " again")  # re-draining rewrites the reason
        assert {n.name: n for n in slurm.nodes()}["gpu4"].reason == reason + " again"
        slurm.resume("gpu4")
        slurm.resume("gpu4")  # not drained any more: a no-op, not an error
        node = {n.name: n for n in slurm.nodes()}["gpu4"]
        assert not node.drained and node.state == "idle"
        slurm.set_comment("gpu4", "")
        assert {n.name: n for n in slurm.nodes()}["gpu4"].comment == ""
    finally:
        slurm.set_comment("gpu4", "")
        slurm.resume("gpu4")


def test_resume_unknown_node_fails(slurm: CliBackend) -> None:
    """Resuming a node Slurm does not know is an error with Slurm's message."""
    with pytest.raises(CommandError, match="(?i)invalid node name"):
        slurm.resume("nosuchnode")


def test_submit_run_requeue_and_account(slurm: CliBackend, jobs_to_cancel: list[int]) -> None:
    """An idle job runs on a node with its GPU; draining the node leaves it running (draining);
    requeue empties the node (drained) and brings the job back with restarts >= 1, never
    FAILED/CANCELLED; sacct lists its runs."""
    t0 = time.time()
    job_id = slurm.submit(
        "#!/bin/sh\nsleep 300\n",
        ["-p", "idle", "--requeue", "--gres=gpu:1", "-w", "gpu3", "-J", "contract-requeue",
         "-o", "/dev/null"],
    )
    jobs_to_cancel.append(job_id)
    running = poll(lambda: (j := job(slurm, job_id)) and j.state == "RUNNING" and j,
                   30, "job running")
    assert running.nodes == ("gpu3",) and running.gpus == 1 and running.partition == "idle"
    assert running.requeue and running.restart_count == 0 and running.start_time
    assert {n.name: n for n in slurm.nodes()}["gpu3"].gpus_used == 1

    try:
        slurm.drain("gpu3", "slurm-idle:reclaiming contract")
        draining = {n.name: n for n in slurm.nodes()}["gpu3"]
        assert draining.drained and draining.state in {"mixed", "allocated"}
        assert job(slurm, job_id).state == "RUNNING"  # type: ignore[union-attr]
        slurm.requeue([job_id])
        slurm.requeue([job_id])  # already requeued: a no-op
        drained = poll(lambda: (n := {n.name: n for n in slurm.nodes()}["gpu3"]).state == "idle"
                       and n, 30, "node empty after requeue")
        assert drained.drained and drained.gpus_used == 0
    finally:
        slurm.resume("gpu3")
    seen: list[str] = []

    def back_in_queue() -> SlurmJob | None:
        j = job(slurm, job_id)
        assert j is not None
        seen.append(j.state)
        assert j.state not in NEVER, f"requeued job went {j.state}"
        return j if j.restart_count >= 1 and j.state in {"PENDING", "RUNNING"} else None

    requeued = poll(back_in_queue, 30, "job back in the queue")
    assert requeued.restart_count >= 1

    runs = poll(lambda: [r for r in slurm.accounting(t0 - 60, None, "idle", [job_id])
                         if r.state == "REQUEUED"], 30, "REQUEUED run in sacct")
    assert runs[0].job_id == job_id and runs[0].gpus == 1 and runs[0].nodes == ("gpu3",)
    assert runs[0].restarts == 0


GRACEFUL_JOB = """\
#!/bin/bash
log={log}
srun bash -c 'trap "echo step-term >> {log}; exit 0" TERM; echo step-start >> {log}; \
while true; do sleep 0.1; done'
echo step-ended >> $log
trap 'echo batch-term >> {log}; exit 0' TERM
while true; do sleep 0.1; done
"""


def test_signal_list_then_requeue_gives_the_step_its_grace(
    slurm: CliBackend, jobs_to_cancel: list[int], tmp_path: Path
) -> None:
    """The agent's reclaim through the adapter: signal() TERMs the srun step (not the batch
    shell), workload_steps() sees it end, requeue() then TERMs the batch shell and requeues
    the job. None of these calls waits (the driver does, under its tick deadline)."""
    log = tmp_path / "signals.log"
    log.touch()
    job_id = slurm.submit(
        GRACEFUL_JOB.format(log=log),
        ["-p", "idle", "--requeue", "--gres=gpu:1", "-w", "gpu2", "-J", "contract-grace",
         "-o", "/dev/null"],
    )
    jobs_to_cancel.append(job_id)
    poll(lambda: "step-start" in log.read_text(), 30, "srun step started")
    assert slurm.workload_steps().get(job_id, 0) >= 1
    start = time.monotonic()
    slurm.signal([job_id], "TERM")
    assert time.monotonic() - start < 5, "signal() must not wait"
    poll(lambda: slurm.workload_steps().get(job_id, 0) == 0, 15, "the step ended on SIGTERM")
    slurm.requeue([job_id])
    poll(lambda: "batch-term" in log.read_text(), 15, "batch shell got SIGTERM from the requeue")
    assert log.read_text().split() == ["step-start", "step-term", "step-ended", "batch-term"]
    requeued = poll(lambda: (j := job(slurm, job_id)) and j.restart_count >= 1 and j, 20,
                    "restart counted")
    assert requeued.state not in NEVER


def test_an_interactive_job_cannot_be_requeued_only_cancelled(
    slurm: CliBackend, sandbox: Any
) -> None:
    """Slurm refuses `scontrol requeue` for an srun job (NotRequeueable, so the agent cancels
    it instead); its job record says batch=False. Run with job_submit.lua relaxed, since the
    shipped one refuses srun on the lend partition."""
    import subprocess

    from slurm_idle.slurm.protocol import NotRequeueable

    lua = Path(sandbox.env()["SLURM_CONF"]).with_name("job_submit.lua")
    original = lua.read_text()
    lua.write_text(original.replace("local ALLOW_INTERACTIVE = false", "local ALLOW_INTERACTIVE = true"))
    srun = None
    try:
        time.sleep(1.5)  # slurmctld re-reads the script when it changes
        srun = subprocess.Popen(["srun", "-p", "idle", "-w", "gpu3", "-J", "contract-srun",
                                 "sleep", "300"], env={**os.environ, **sandbox.env()},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = poll(lambda: next((j for j in slurm.jobs() if j.name == "contract-srun"
                                   and j.state == "RUNNING"), None), 30, "srun job running")
        assert found.batch is False
        with pytest.raises(NotRequeueable):
            slurm.requeue([found.job_id])
        slurm.cancel([found.job_id])
        srun.wait(timeout=30)
    finally:
        lua.write_text(original)
        if srun is not None and srun.poll() is None:
            srun.terminate()


PLAIN_JOB = """\
#!/bin/bash
srun bash -c 'trap "echo checkpoint >> {log}; exit 0" TERM; echo start >> {log}; \
while true; do sleep 0.1; done'
"""


def test_plain_job_ending_with_its_step_is_requeued_not_completed(
    slurm: CliBackend, jobs_to_cancel: list[int], tmp_path: Path
) -> None:
    """The plain `sbatch --requeue` job of the README (its last line an srun step) gets SIGTERM
    from a direct requeue (grace 0, how the agent requeues jobs it did not submit) and comes
    back PENDING with its run REQUEUED in sacct: never COMPLETED, FAILED or CANCELLED."""
    t0 = time.time()
    log = tmp_path / "plain.log"
    log.touch()
    job_id = slurm.submit(
        PLAIN_JOB.format(log=log),
        ["-p", "idle", "--requeue", "--gres=gpu:1", "-w", "gpu1", "-J", "contract-plain",
         "-o", "/dev/null"],
    )
    jobs_to_cancel.append(job_id)
    poll(lambda: "start" in log.read_text(), 30, "srun step started")
    slurm.requeue([job_id], grace_s=0)
    poll(lambda: "checkpoint" in log.read_text(), 30, "the step got SIGTERM")

    def back_in_queue() -> SlurmJob | None:
        j = job(slurm, job_id)
        assert j is not None and j.state not in NEVER | {"COMPLETED"}, j
        return j if j.restart_count >= 1 and j.state in {"PENDING", "RUNNING"} else None

    poll(back_in_queue, 30, "job back in the queue")
    runs = poll(lambda: slurm.accounting(t0 - 60, None, "idle", [job_id]) or None, 30, "sacct runs")
    assert runs[0].state == "REQUEUED", [r.state for r in runs]


def test_replica_job_submit_comment_cancel(slurm: CliBackend, sandbox: Any,
                                           jobs_to_cancel: list[int]) -> None:
    """A replica job (placement: jobs) as the agent submits it: pending in the serve partition
    with our Comment, readable back from squeue; its Comment rewritten while it waits (as while
    it runs); scancel makes it leave the queue."""
    from slurm_idle.config import load_config as load
    from slurm_idle.model import Phase
    from slurm_idle.replicajobs import format_comment, render_script, replica_views, submit_args
    from slurm_idle.replicatrust import ReplicaTrust, agent_user

    config = load(sandbox.layout.jobs_config_path)
    model = config.models[0]
    # gpu8 is closed (drained) here: the job stays PENDING, which is all this test needs.
    # The job's user (as slurmctld sets it) and the signed Comment make it ours.
    trust = ReplicaTrust(agent_user(), b"k" * 32, time.time())
    job_id = slurm.submit(render_script(config, model, 0),
                          submit_args(config, model, 0, time.time(), trust=trust))
    jobs_to_cancel.append(job_id)
    views = replica_views(config, slurm.jobs(), trust)
    assert (views[0].job_id, views[0].phase) == (job_id, Phase.RECLAIMING)
    assert views[0].state_reason  # Slurm says why it waits (the node is drained)
    text = format_comment(config.slurm.tag, Phase.SERVING, time.time(), model.name, 0, views[0].port,
                          trust=trust)
    slurm.set_job_comment(job_id, text)
    assert job(slurm, job_id).comment == text  # type: ignore[union-attr]
    slurm.cancel([job_id])
    poll(lambda: replica_views(config, slurm.jobs(), trust)[0].phase is Phase.LENT, 15, "job gone")


def test_command_timeout_raises(sandbox: Any) -> None:
    """A Slurm command past the configured timeout raises CommandError with rc -1."""
    slow = CliBackend(runner=SubprocessRunner(env=sandbox.env()), timeout_s=0.001)
    with pytest.raises(CommandError) as info:
        slow.jobs()
    assert info.value.rc == TIMEOUT_RC and "timed out" in str(info.value)


def test_make_backend_from_sandbox_config(sandbox: Any) -> None:
    """The sandbox's generated config yields a working CLI backend."""
    backend = make_backend(load_config(sandbox.config_path),
                           runner=SubprocessRunner(env=sandbox.env()))
    assert isinstance(backend, CliBackend)
    assert len(backend.nodes()) == 8  # gpu1-4, gpu5-7 (8 GPUs, issue 13), gpu8 (placement: jobs)


def test_phases_survive_a_slurmctld_restart(slurm: CliBackend, sandbox: Any) -> None:
    """Our state lives in Slurm: a drained node's Reason and a lent node's Comment (and so the
    phases read back from them) are still there after slurmctld restarts from its saved state."""
    from slurm_idle.lifecycle import derive_phase, format_lent_comment, format_reason
    from slurm_idle.model import Phase

    tag, since = "slurm-idle", 1796205600.0
    try:
        slurm.drain("gpu4", format_reason(tag, Phase.SERVING, since, pinned=True))
        slurm.set_comment("gpu3", format_lent_comment(tag, since))
        before = {n.name: derive_phase(n, tag) for n in slurm.nodes()}
        assert before["gpu4"].phase is Phase.SERVING and before["gpu3"].phase is Phase.LENT
        seconds = sandbox.restart_slurmctld()
        print(f"MEASURE slurmctld restart to nodes answering: {seconds} s")
        after = {n.name: derive_phase(n, tag) for n in slurm.nodes()}
        assert after == before
    finally:
        slurm.set_comment("gpu3", "")
        slurm.resume("gpu4")
