"""The default Slurm backend: the ordinary commands with `--json`, run through a CommandRunner.

Reads are one command each (`sinfo --json` or, on 23.02+, `scontrol show node --json`, whose
per-node records keep each node's Comment; one `squeue --json` for every job). The Slurm
release is learnt from the `meta` block of whatever JSON came back first, so no extra
`--version` call is made in a tick; a 23.02+ cluster costs one extra command the first time.

Requeue, as measured on 22.05 (see docs in `requeue`): `scontrol requeue` itself sends SIGCONT +
SIGTERM to every process of the job at once and SIGKILL after the cluster's KillWait; the run
is recorded as requeued (never FAILED), the job shows COMPLETING on its node meanwhile.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from slurm_idle.commands import CommandRunner, CompletedResult, SubprocessRunner
from slurm_idle.errors import CommandError
from slurm_idle.model import SlurmJob, SlurmNode
from slurm_idle.slurm import parse
from slurm_idle.slurm.protocol import AccountingDisabled, AcctJob, NotRequeueable

#: First release whose `scontrol show node` knows `--json`.
SCONTROL_JSON_SINCE = (23, 2)
#: Steps that are not workload steps: they exist as long as the job does.
_HOUSEKEEPING_STEPS = ("batch", "extern", "interactive")
#: `scontrol requeue` complaints that mean there is nothing left to do for that job.
_REQUEUE_DONE = ("job is pending execution", "invalid job id specified")
#: What `scontrol requeue` says of an srun/salloc job (22.05: "Only batch jobs are accepted or
#: processed for job 2").
_NOT_BATCH = "only batch jobs are accepted"


class CliBackend:
    """SlurmBackend over sinfo/squeue/sacct/scontrol/sbatch/scancel."""

    def __init__(
        self,
        runner: CommandRunner | None = None,
        bin_dir: str | None = None,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        poll_s: float = 1.0,
    ) -> None:
        self.runner = runner or SubprocessRunner()
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s
        self.clock = clock
        self.sleep = sleep
        self.poll_s = poll_s
        self.calls = 0
        self._version: str | None = None
        self._cluster: str | None = None

    # --- plumbing ------------------------------------------------------------------------

    def _argv(self, command: str, *args: str) -> list[str]:
        exe = os.path.join(self.bin_dir, command) if self.bin_dir else command
        return [exe, *args]

    def _run(self, command: str, *args: str, input: str | None = None) -> CompletedResult:
        self.calls += 1
        return self.runner.run(self._argv(command, *args), input=input, timeout=self.timeout_s)

    def _json(self, command: str, *args: str) -> dict[str, Any]:
        result = self._run(command, *args)
        try:
            doc = json.loads(result.stdout)
        except json.JSONDecodeError as exc:
            raise CommandError(
                result.argv, result.rc, f"output is not JSON ({exc.msg} at char {exc.pos})"
            ) from None
        if not isinstance(doc, dict):
            raise CommandError(result.argv, result.rc, "JSON output is not an object")
        release = parse.meta_release(doc)
        if release and self._version is None:
            self._version = release
        return doc

    def _scontrol_has_json(self) -> bool:
        return self._version is not None and parse.major_minor(self._version) >= SCONTROL_JSON_SINCE

    # --- reads ---------------------------------------------------------------------------

    def nodes(self) -> list[SlurmNode]:
        if self._scontrol_has_json():
            return parse.parse_nodes(self._json("scontrol", "show", "node", "--json"))
        doc = self._json("sinfo", "--json")
        if "sinfo" in doc:
            # 23.02+ sinfo groups nodes per partition and state: ask for per-node records.
            return parse.parse_nodes(self._json("scontrol", "show", "node", "--json"))
        return parse.parse_nodes(doc)

    def jobs(self) -> list[SlurmJob]:
        return parse.parse_jobs(self._json("squeue", "--json", "--all"))

    def jobs_named(self, name: str) -> list[SlurmJob]:
        """The jobs of that name (the leadership lease's read: not the whole queue every few
        seconds). A release whose `--json` ignores the filter returns more: callers filter too."""
        return parse.parse_jobs(self._json("squeue", "--json", "--all", f"--name={name}"))

    def accounting(
        self,
        since: float | None,
        until: float | None,
        partition: str | None = None,
        job_ids: Sequence[int] = (),
    ) -> list[AcctJob]:
        args = ["--json", "--allusers", "--duplicates", "--allocations"]
        # Without explicit times sacct shows only today's jobs; with job ids it shows them all.
        if since is not None:
            args.append(f"--starttime={_slurm_time(since)}")
        elif not job_ids:
            args.append("--starttime=1970-01-01T00:00:00")
        if until is not None:
            args.append(f"--endtime={_slurm_time(until)}")
        if partition:
            args.append(f"--partition={partition}")
        if job_ids:
            args.append("--jobs=" + ",".join(str(j) for j in job_ids))
        try:
            doc = self._json("sacct", *args)
        except CommandError as exc:
            if "disabled" in exc.stderr.lower():
                raise AccountingDisabled(exc.argv, exc.rc, exc.stderr) from None
            raise
        return self._mend_exit_codes(parse.parse_accounting(doc))

    def _mend_exit_codes(self, records: list[AcctJob]) -> list[AcctJob]:
        """Exit codes of failed runs from sacct's text output: 22.05's `sacct --json` reports
        every job's `exit_code` as SUCCESS 0 (measured: a job that ran `exit 3` is FAILED
        with return_code 0 there, `3:0` in `-o ExitCode`). Asked only for failed runs that
        say 0, so a week of successes costs no second call."""
        suspect = sorted({r.job_id for r in records
                          if r.state in parse.EXIT_SUSPECT_STATES and not r.exit_code
                          and not r.signal})
        if not suspect:
            return records
        out = self._run("sacct", "--noheader", "--parsable2", "--allusers", "--duplicates",
                        "--allocations", "--format=JobIDRaw,ExitCode",
                        "--jobs=" + ",".join(map(str, suspect))).stdout
        codes = parse.parse_exit_codes(out)
        mended = []
        for rec in records:
            queue = codes.get(rec.job_id)
            if rec.job_id in suspect and queue:
                code, sig = queue.pop(0)
                rec = replace(rec, exit_code=code, signal=sig or None)
            mended.append(rec)
        return mended

    def cluster_name(self) -> str:
        from slurm_idle.slurm.text import is_unset, parse_show_config

        if self._cluster is None:
            name = parse_show_config(self._run("scontrol", "show", "config").stdout).get(
                "ClusterName")
            self._cluster = "" if is_unset(name) else str(name)
        return self._cluster

    def version(self) -> str:
        if self._version is None:
            self._version = parse.parse_version_output(self._run("sinfo", "--version").stdout)
        return self._version

    # --- node changes --------------------------------------------------------------------

    def drain(self, node: str, reason: str) -> None:
        if not reason:
            raise ValueError("Slurm requires a reason to drain a node")
        self._run("scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}")

    def resume(self, node: str) -> None:
        try:
            self._run("scontrol", "update", f"nodename={node}", "state=RESUME")
        except CommandError as exc:
            # 22.05 answers rc=1 "Invalid node state specified" for a node that is not drained.
            if exc.rc == 1 and "invalid node state" in exc.stderr.lower():
                return
            raise

    def power_up(self, node: str) -> None:
        try:
            self._run("scontrol", "update", f"nodename={node}", "state=POWER_UP")
        except CommandError as exc:
            # 22.05 answers rc=1 "Invalid node state specified" for a node that is already up
            # (or being powered up), as for a RESUME of an undrained node.
            if exc.rc == 1 and "invalid node state" in exc.stderr.lower():
                return
            raise

    def set_comment(self, node: str, comment: str) -> None:
        self._run("scontrol", "update", f"nodename={node}", f"comment={comment}")

    # --- job changes ---------------------------------------------------------------------

    def submit(self, script: str, extra_args: Sequence[str] = ()) -> int:
        result = self._run("sbatch", "--parsable", *extra_args, input=script)
        first = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        try:
            return int(first.split(";", 1)[0])
        except ValueError:
            raise CommandError(result.argv, result.rc, f"no job id in sbatch output {first!r}") from None

    def set_job_comment(self, job_id: int, comment: str) -> None:
        """Rewrite a job's Comment (a replica job's phase, `placement: jobs`); also while it runs."""
        self._run("scontrol", "update", f"jobid={job_id}", f"comment={comment}")

    def cancel(self, job_ids: Sequence[int], signal: str | None = None) -> None:
        if not job_ids:
            return
        args = [f"--signal={signal}"] if signal else []
        self._run("scancel", *args, *(str(j) for j in job_ids))

    def requeue(self, job_ids: Sequence[int], grace_s: float = 0) -> None:
        """Requeue jobs so they go back to PENDING (restart count + 1), never FAILED.

        `scontrol requeue` is graceful up to KillWait: every process of the job gets SIGTERM at
        once and SIGKILL KillWait seconds later; meanwhile the job shows COMPLETING on its node.
        An earlier warning (the job's own --signal, our runner's SIGTERM) and the wait for it
        are the caller's: `signal`, then `workload_steps` through its shared poll, under its
        deadline (the agent's NodeDriver). `grace_s` is accepted for callers of the old
        signature and must be 0: this call never waits. A job Slurm cannot requeue (an srun or
        salloc job: "Only batch jobs are accepted") raises NotRequeueable.
        """
        if grace_s:
            raise ValueError("requeue() no longer waits: signal() first and wait in the caller")
        if not job_ids:
            return
        try:
            self._run("scontrol", "requeue", ",".join(str(j) for j in job_ids))
        except CommandError as exc:
            # Slurm still requeues the other jobs of the list; a job already requeued (it
            # reads "pending execution", also while COMPLETING) or gone needs nothing more.
            lines = [line.strip().lower() for line in exc.stderr.splitlines() if line.strip()]
            if exc.rc == 1 and lines and all(any(b in ln for b in _REQUEUE_DONE) for ln in lines):
                return
            if any(_NOT_BATCH in ln for ln in lines):
                raise NotRequeueable(exc.argv, exc.rc, exc.stderr) from None
            raise

    def signal(self, job_ids: Sequence[int], signal: str, batch_shell: bool = False) -> None:
        """Send `signal` to the jobs' steps (Slurm's `--signal` default), or to their batch
        shell only (`batch_shell`, a `--signal=B:...` job). Nothing else happens to the job."""
        if not job_ids:
            return
        args = [f"--signal={signal}"] + (["--batch"] if batch_shell else [])
        self._run("scancel", *args, *(str(j) for j in job_ids))

    def workload_steps(self) -> dict[int, int]:
        """job id -> its running workload steps (not batch/extern/interactive), every job in
        one `squeue --steps` call (for a poll shared by every node being reclaimed)."""
        out = self._run("squeue", "--steps", "--all", "--noheader", "--format=%i").stdout
        counts: dict[int, int] = {}
        for line in out.splitlines():
            job, _, step = line.strip().partition(".")
            if job.split("_")[0].isdigit() and step and step not in _HOUSEKEEPING_STEPS:
                key = int(job.split("_")[0])
                counts[key] = counts.get(key, 0) + 1
        return counts

    def job_signal(self, job_id: int) -> parse.JobSignal | None:
        """The job's own `#SBATCH --signal` from its batch script (Slurm's job JSON does not
        carry the option); None without one, or for a job without a script (srun/salloc)."""
        try:
            script = self._run("scontrol", "write", "batch_script", str(job_id), "-").stdout
        except CommandError:
            return None
        return parse.signal_from_script(script)


def _slurm_time(ts: float) -> str:
    """Unix seconds as the local-time ISO form sacct's --starttime/--endtime take."""
    return datetime.fromtimestamp(ts, UTC).astimezone().strftime("%Y-%m-%dT%H:%M:%S")
