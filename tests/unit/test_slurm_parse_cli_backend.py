"""The CLI backend issues the right commands and reads their captured output (fake runner)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from slurm_idle.commands import TIMEOUT_RC, ReplayRunner, SubprocessRunner
from slurm_idle.config import Config
from slurm_idle.errors import CommandError
from slurm_idle.slurm import CliBackend, make_backend
from slurm_idle.slurm.parse import JobSignal

DATA = Path(__file__).parent.parent / "data" / "slurm-json"


def sample(rel: str) -> str:
    return (DATA / rel).read_text()


def backend(responses: dict[tuple[str, ...], str | CommandError]) -> tuple[CliBackend, ReplayRunner]:
    runner = ReplayRunner(responses)
    return CliBackend(runner=runner), runner


def test_nodes_22_05_one_command() -> None:
    """On 22.05 every nodes() call is exactly one `sinfo --json`."""
    b, runner = backend({("sinfo", "--json"): sample("22.05/sinfo.json")})
    for _ in range(3):
        assert len(b.nodes()) == 4
    assert [c[0] for c in runner.calls] == [("sinfo", "--json")] * 3
    assert b.calls == 3 and b.version() == "22.05.8" and b.calls == 3


def test_nodes_24_11_switches_to_scontrol() -> None:
    """On 24.11 the first call learns the release and re-reads per node; later calls use one
    `scontrol show node --json`."""
    b, runner = backend({
        ("sinfo", "--json"): sample("24.11/sinfo.json"),
        ("scontrol", "show", "node", "--json"): sample("24.11/scontrol-show-node.json"),
    })
    assert [n.name for n in b.nodes()] == ["gpu1", "gpu2"]
    assert [n.name for n in b.nodes()] == ["gpu1", "gpu2"]
    assert [c[0][0] for c in runner.calls] == ["sinfo", "scontrol", "scontrol"]


def test_jobs_first_teaches_version() -> None:
    """When jobs() ran first on 24.11, nodes() goes straight to scontrol: one command each."""
    b, _ = backend({
        ("squeue", "--json"): sample("24.11/squeue.json"),
        ("scontrol", "show", "node", "--json"): sample("24.11/scontrol-show-node.json"),
    })
    assert len(b.jobs()) == 2 and len(b.nodes()) == 2
    assert b.calls == 2


def test_drain_resume_comment_argv() -> None:
    """Node changes are single scontrol updates, the reason kept as one argument."""
    b, runner = backend({("scontrol", "update"): ""})
    b.drain("gpu1", "slurm-idle:serving since=now")
    b.resume("gpu1")
    b.set_comment("gpu1", "phase=lent t=1")
    assert [c[0] for c in runner.calls] == [
        ("scontrol", "update", "nodename=gpu1", "state=DRAIN", "reason=slurm-idle:serving since=now"),
        ("scontrol", "update", "nodename=gpu1", "state=RESUME"),
        ("scontrol", "update", "nodename=gpu1", "comment=phase=lent t=1"),
    ]


def test_drain_needs_reason() -> None:
    """Draining without a reason is refused before Slurm is asked."""
    b, runner = backend({})
    with pytest.raises(ValueError):
        b.drain("gpu1", "")
    assert runner.calls == []


def test_resume_not_drained_is_noop() -> None:
    """RESUME of a node that is not drained (rc 1, invalid node state) is treated as done."""
    err = CommandError(["scontrol"], 1, "slurm_update error: Invalid node state specified\n")
    b, _ = backend({("scontrol", "update"): err})
    b.resume("gpu1")


def test_resume_other_errors_raise() -> None:
    """RESUME of an unknown node still fails."""
    err = CommandError(["scontrol"], 1, "slurm_update error: Invalid node name specified")
    b, _ = backend({("scontrol", "update"): err})
    with pytest.raises(CommandError, match="Invalid node name"):
        b.resume("nosuch")


def test_submit_script_on_stdin() -> None:
    """submit() sends the script on stdin and reads the id from `--parsable` (with cluster)."""
    b, runner = backend({("sbatch", "--parsable"): "42;cluster\n"})
    assert b.submit("#!/bin/sh\ntrue\n", ["-p", "idle", "--requeue"]) == 42
    assert runner.calls == [(("sbatch", "--parsable", "-p", "idle", "--requeue"), "#!/bin/sh\ntrue\n")]


def test_submit_garbage_output_raises() -> None:
    """sbatch output without a job id is a CommandError, not a crash."""
    b, _ = backend({("sbatch",): "hello\n"})
    with pytest.raises(CommandError, match="no job id"):
        b.submit("x")


def test_cancel_with_and_without_signal() -> None:
    """cancel() is one scancel for all ids, with --signal only when asked; no ids, no call."""
    b, runner = backend({("scancel",): ""})
    b.cancel([1, 2])
    b.cancel([3], signal="USR1")
    b.cancel([])
    assert [c[0] for c in runner.calls] == [("scancel", "1", "2"), ("scancel", "--signal=USR1", "3")]


def test_requeue_plain_is_one_command() -> None:
    """requeue() without grace is one `scontrol requeue` for the comma-joined ids."""
    b, runner = backend({("scontrol", "requeue"): ""})
    b.requeue([4, 5])
    assert [c[0] for c in runner.calls] == [("scontrol", "requeue", "4,5")]


def test_requeue_already_requeued_is_noop() -> None:
    """Jobs already requeued ("pending execution") or gone are not an error."""
    err = CommandError(["scontrol"], 1, "Job is pending execution for job 7\n"
                       "Invalid job id specified for job 9\n")
    b, _ = backend({("scontrol", "requeue"): err})
    b.requeue([7, 9])


def test_requeue_other_error_raises() -> None:
    """A requeue refused for another reason (e.g. not requeueable) raises."""
    err = CommandError(["scontrol"], 1, "Requested operation is presently disabled for job 7")
    b, _ = backend({("scontrol", "requeue"): err})
    with pytest.raises(CommandError):
        b.requeue([7])


def test_requeue_never_waits() -> None:
    """requeue() is one `scontrol requeue` and never polls: the grace is the caller's, under its
    tick deadline (issue 12: it used to block for the whole grace in its own loop)."""
    b, runner = backend({("scontrol", "requeue"): ""})
    b.requeue([7])
    assert [c[0] for c in runner.calls] == [("scontrol", "requeue", "7")]
    with pytest.raises(ValueError, match="no longer waits"):
        b.requeue([7], grace_s=30)


def test_requeue_of_an_interactive_job_raises_not_requeueable() -> None:
    """Slurm's answer for an srun/salloc job (captured on 22.05) is NotRequeueable, so the
    caller can cancel it instead of retrying forever."""
    from slurm_idle.slurm.protocol import NotRequeueable

    err = CommandError(["scontrol"], 1, "Only batch jobs are accepted or processed for job 2\n")
    b, _ = backend({("scontrol", "requeue"): err})
    with pytest.raises(NotRequeueable):
        b.requeue([2])


def test_signal_goes_to_steps_or_the_batch_shell() -> None:
    """signal() is one scancel --signal, with --batch only for a `B:` signal."""
    b, runner = backend({("scancel",): ""})
    b.signal([7], "TERM")
    b.signal([8], "USR2", batch_shell=True)
    assert [c[0] for c in runner.calls] == [("scancel", "--signal=TERM", "7"),
                                            ("scancel", "--signal=USR2", "--batch", "8")]


def test_workload_steps_lists_every_job_in_one_call() -> None:
    """workload_steps() counts each job's steps other than batch/extern/interactive."""
    b, runner = backend({("squeue", "--steps"): "7.0\n7.batch\n7.extern\n8.batch\n9.0\n9.1\n"})
    assert b.workload_steps() == {7: 1, 9: 2}
    assert len(runner.calls) == 1


def test_job_signal_is_read_from_the_batch_script() -> None:
    """The job's own --signal comes from its batch script (captured 22.05 output); a job
    without a script (srun) has none."""
    script = (DATA / "22.05" / "batch-script-signal.txt").read_text()
    b, _ = backend({("scontrol", "write", "batch_script", "3"): script,
                    ("scontrol", "write", "batch_script", "4"):
                        CommandError(["scontrol"], 1, "job script retrieval failed")})
    assert b.job_signal(3) == JobSignal("USR2", batch_shell=True)
    assert b.job_signal(4) is None


def test_bad_json_is_command_error() -> None:
    """Output that is not JSON raises CommandError naming the command."""
    b, _ = backend({("squeue",): "squeue: error: oops"})
    with pytest.raises(CommandError, match="not JSON"):
        b.jobs()


def test_accounting_args_and_parse() -> None:
    """accounting() asks sacct for every run in the window, for the partition and jobs given."""
    doc = '{"jobs": [{"job_id": 3, "name": "d", "partition": "idle", "nodes": "gpu1",' \
          '"state": {"current": "COMPLETED"}, "time": {"start": 10, "end": 20, "elapsed": 10},' \
          '"tres": {"allocated": [{"type": "gres", "name": "gpu", "count": 1}]}}]}'
    b, runner = backend({("sacct",): doc})
    (run,) = b.accounting(0.0, 100.0, partition="idle", job_ids=[3])
    assert run.job_id == 3 and run.gpus == 1 and run.state == "COMPLETED"
    argv = runner.calls[0][0]
    assert "--duplicates" in argv and "--partition=idle" in argv and "--jobs=3" in argv
    assert any(a.startswith("--starttime=") for a in argv)
    assert any(a.startswith("--endtime=") for a in argv)


def test_bin_dir_and_timeout_from_config(tmp_path: Path) -> None:
    """make_backend honours bin_dir (command path) and command_timeout_s."""
    seen: list[tuple[list[str], float | None]] = []

    class Recorder:
        def run(self, argv, input=None, timeout=None):  # type: ignore[no-untyped-def]
            seen.append((list(argv), timeout))
            from slurm_idle.commands import CompletedResult
            return CompletedResult(tuple(argv), 0, sample("22.05/sinfo.json"), "")

    config = Config.model_validate({
        "slurm": {"bin_dir": "/opt/slurm/bin", "command_timeout_s": 7},
        "engine": {"kind": "http-sleep"},
        "models": [{"name": "m", "nodes": "gpu[1-2]"}],
    })
    b = make_backend(config, runner=Recorder())
    b.nodes()
    assert seen == [(["/opt/slurm/bin/sinfo", "--json"], 7.0)]


def test_auto_without_pyslurm_is_cli() -> None:
    """backend: auto falls back to the CLI when pyslurm does not import."""
    if importlib.util.find_spec("pyslurm") is not None:
        pytest.skip("pyslurm imports here; the fallback cannot be observed")
    config = Config.model_validate({
        "slurm": {"backend": "auto"},
        "engine": {"kind": "http-sleep"},
        "models": [{"name": "m", "nodes": "gpu1"}],
    })
    assert isinstance(make_backend(config, runner=ReplayRunner({})), CliBackend)


def test_subprocess_runner_timeout_kills_group() -> None:
    """A command past its timeout raises rc=-1 promptly, even when a child holds the pipes."""
    runner = SubprocessRunner()
    start = time.monotonic()
    with pytest.raises(CommandError) as info:
        runner.run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.3)
    assert info.value.rc == TIMEOUT_RC and "timed out" in str(info.value)
    assert time.monotonic() - start < 5


def test_subprocess_runner_errors() -> None:
    """Non-zero exit gives rc and stderr; a missing program says how to fix it."""
    runner = SubprocessRunner()
    with pytest.raises(CommandError) as info:
        runner.run(["sh", "-c", "echo bad >&2; exit 3"])
    assert info.value.rc == 3 and "bad" in info.value.stderr
    with pytest.raises(CommandError, match="bin_dir"):
        runner.run(["/nonexistent/sinfo"])
    assert runner.run(["cat"], input="hi").stdout == "hi"
