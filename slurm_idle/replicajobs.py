"""`placement: jobs`: a model's vLLM replicas as Slurm batch jobs. Pure text work and reading.

Where vLLM itself runs as Slurm jobs, the idle GPUs are just the GPUs no replica job holds:
lending a replica is cancelling its job (its GPUs go to the idle partition at once, GPU by
GPU), reclaiming it is submitting the job again, and Slurm's own preemption (PriorityTier,
PreemptMode=REQUEUE, GraceTime) empties the GPUs it needs.

The state lives in Slurm, as in node mode: each replica job carries our Comment
(`slurm-idle:serving since=... index=1 port=8101 model=NAME`), and the fleet is rebuilt from
`squeue` every tick (`replica_views`). A job's phase: PENDING is RECLAIMING; running is
STARTING until the Comment says serving (or retiring, lending); COMPLETING is LENDING; no job
is LENT; a running job whose script waits for a GPU someone else holds says `held` (HELD:
render_script's GPU wait). A job is ours only when its Comment parses, it runs in the model's
partition, its index and port are the model's, and it passes replicatrust.py (the agent's user
and a signed Comment: a Comment alone can be forged by any user): anything else is never
touched. Nothing here runs a command; the driver (jobdriver.py) does.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from slurm_idle.journal import iso
from slurm_idle.model import ForeignReplicaJob, JobReplica, Phase, SlurmJob, SlurmNode

if TYPE_CHECKING:  # config.py imports this module in its validators
    from slurm_idle.config import Config, ModelConfig


class ReplicaTrust(Protocol):
    """Signs our Comments and tells a look-alike job from ours (replicatrust.py keeps the key);
    a protocol here so the rendering and reading of replica jobs stay pure."""

    def sign(self, text: str) -> str: ...

    def foreign_reason(self, job: SlurmJob, unsigned_text: str, sig: str | None,
                       account: str | None) -> str | None: ...

#: Options the agent sets itself on every replica job (a site's sbatch_args may not).
OWN_OPTIONS = ("--partition", "-p", "--job-name", "-J", "--comment", "--parsable", "--gres",
               "--gpus", "-G", "--nodes", "-N")
#: Phase words we write into a replica job's Comment.
_WORDS = {Phase.RECLAIMING, Phase.HELD, Phase.SERVING, Phase.RETIRING, Phase.LENDING}
#: Job states in which the job still holds (or is about to hold) its GPUs.
_PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
_RUNNING = frozenset({"RUNNING", "CONFIGURING", "RESIZING"})
_ENDING = frozenset({"COMPLETING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED"})
_COMMAND_FIELDS = ("port", "model", "index")
#: `sbatch --prefer` (soft node features): Slurm 22.05's sbatch documents and honours it
#: (tests/e2e/test_jobs_placement.py checks the job's `prefer` on 22.05 and 24.11).
PREFER_SINCE = (22, 5)
_URL_FIELDS = ("node", "port")


def check_sbatch_args(args: Sequence[str]) -> None:
    """sbatch_args are options (start with '-'), none of those the agent sets itself."""
    for arg in args:
        if not arg.startswith("-") or any(c in arg for c in "\n\r\0"):
            raise ValueError(f"sbatch_args: {arg!r} is not an sbatch option (e.g. --qos=inference)")
        name = arg.split("=", 1)[0]
        if name in OWN_OPTIONS:
            raise ValueError(f"sbatch_args: {name} is set by slurm-idle itself (partition, job "
                             "name, comment, GPUs and nodes come from the job: block)")


def _check(template: str, fields: tuple[str, ...], what: str) -> None:
    try:
        template.format(**{f: 0 for f in fields})
    except (KeyError, IndexError, ValueError) as exc:
        detail = f"unknown placeholder {{{exc.args[0]}}}" if isinstance(exc, KeyError) else str(exc)
        names = ", ".join(f"{{{f}}}" for f in fields)
        raise ValueError(f"{what} {template!r}: {detail}; the placeholders are {names}") from None


def check_templates(command: str | None, url: str) -> None:
    """`job.command` may use {port} {model} {index}; `job.url` {node} {port}."""
    if command is not None:
        if not command.strip():
            raise ValueError("job.command is empty")
        _check(command, _COMMAND_FIELDS, "job.command")
    _check(url, _URL_FIELDS, "job.url")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"job.url {url!r} must be an http:// or https:// URL template")


def port_of(model: ModelConfig, index: int) -> int:
    assert model.job is not None
    return model.job.port_base + index


def job_name(tag: str, model: str, index: int) -> str:
    """The job's name, for humans in squeue (the Comment is what we read back)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)[:64]
    return f"{tag}-{safe}-{index}"


def format_comment(tag: str, phase: Phase, since: float, model: str, index: int, port: int,
                   pinned: bool = False, trust: ReplicaTrust | None = None) -> str:
    """Our Comment on a replica job; the model last, so any name reads back whole. `pinned`
    (an admin's `slurm-idle pin MODEL#INDEX`): the planner never lends the replica. `trust`
    signs it (`sig=`, replicatrust.py): without the sig no job is adopted as ours."""
    if phase not in _WORDS:
        raise ValueError(f"phase {phase.value} is not written into a replica job's Comment")
    head = f"{tag}:{phase.value} since={iso(since)} index={index} port={port}"
    flag = " pinned" if pinned else ""
    sig = trust.sign(f"{head}{flag} model={model}") if trust is not None else ""
    return f"{head}{flag}{f' sig={sig}' if sig else ''} model={model}"


@dataclass(frozen=True)
class JobComment:
    word: str
    since: float
    index: int
    port: int
    model: str
    pinned: bool = False
    sig: str | None = None  # None: unsigned (an older agent's, or not ours at all)
    unsigned: str = ""  # the text the sig signs (the Comment without it)


def parse_comment(text: str, tag: str) -> JobComment | None:
    """Our Comment read back, or None for anything not in exactly the shape we write."""
    m = re.fullmatch(re.escape(tag) + r":([a-z]+) (since=\S+) index=([0-9]{1,6}) port=([0-9]{1,5})"
                     r"( pinned)?( sig=[0-9a-f]{1,64})? model=(.+)", text.strip())
    if m is None:
        return None
    try:
        since = datetime.strptime(m.group(2), "since=%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None
    sig = m.group(6)
    unsigned = m.string if sig is None else m.string[:m.start(6)] + m.string[m.end(6):]
    return JobComment(m.group(1), since, int(m.group(3)), int(m.group(4)), m.group(7),
                      m.group(5) is not None, None if sig is None else sig[5:], unsigned)


def derive_job_phase(job: SlurmJob, comment: JobComment) -> Phase | None:
    """The phase a replica job's state and our Comment say; None when it holds nothing any more
    (ended: the replica is LENT)."""
    if job.state in _PENDING:
        return Phase.RECLAIMING
    if job.state in _ENDING:
        return Phase.LENDING
    if job.state in _RUNNING:
        return {"serving": Phase.SERVING, "retiring": Phase.RETIRING, "lending": Phase.LENDING,
                "held": Phase.HELD}.get(comment.word, Phase.STARTING)
    return None


def partition_of(config: Config, model: ModelConfig) -> str:
    assert model.job is not None
    return model.job.partition or config.slurm.serve_partition


def placement_nodes_of(config: Config, nodes: Iterable[SlurmNode]) -> list[SlurmNode]:
    """The nodes replica jobs may run on: those in a partition of a `placement: jobs` model
    (none without such a model)."""
    parts = {partition_of(config, m) for m in config.models if m.job is not None}
    return [n for n in nodes if parts & set(n.partitions)]


def account_of(model: ModelConfig) -> str | None:
    """The account the model's replica jobs are submitted under (`--account`/`-A` in
    job.sbatch_args), None when the site sets none (Slurm's default account: not checked)."""
    assert model.job is not None
    args = list(model.job.sbatch_args)
    for i, arg in enumerate(args):
        if arg.startswith("--account="):
            return arg.split("=", 1)[1]
        if arg.startswith("-A") and len(arg) > 2:
            return arg[2:].lstrip("=")
        if arg in ("-A", "--account") and i + 1 < len(args):
            return args[i + 1]
    return None


_Found = dict[tuple[str, int], list[tuple[SlurmJob, JobComment, Phase]]]


def _sort_jobs(config: Config, jobs: Sequence[SlurmJob],
               trust: ReplicaTrust) -> tuple[_Found, list[ForeignReplicaJob]]:
    """Our replica jobs by (model, index), and the look-alikes that are not ours."""
    tag = config.slurm.tag
    models = {m.name: m for m in config.models if m.placement == "jobs" and m.job is not None}
    found: _Found = {}
    foreign: list[ForeignReplicaJob] = []
    for job in jobs:
        comment = parse_comment(job.comment, tag)
        if comment is None:
            continue
        model = models.get(comment.model)
        if model is None or job.partition != partition_of(config, model):
            continue
        assert model.job is not None
        if comment.index >= model.job.replicas or comment.port != port_of(model, comment.index):
            continue
        phase = derive_job_phase(job, comment)
        if phase is None:
            continue
        why = trust.foreign_reason(job, comment.unsigned, comment.sig, account_of(model))
        if why is not None:
            foreign.append(ForeignReplicaJob(job.job_id, job.user, job.nodes,
                                             f"{model.name}#{comment.index}", why))
            continue
        found.setdefault((model.name, comment.index), []).append((job, comment, phase))
    return found, foreign


def foreign_replica_jobs(config: Config, jobs: Sequence[SlurmJob],
                         trust: ReplicaTrust) -> list[ForeignReplicaJob]:
    """Jobs with our Comment's shape, in a replica's partition, that fail the trust check."""
    return _sort_jobs(config, jobs, trust)[1]


def replica_views(config: Config, jobs: Sequence[SlurmJob],
                  trust: ReplicaTrust) -> tuple[JobReplica, ...]:
    """Every replica of every jobs-placement model (index order), from one `squeue` answer.
    Only jobs `trust` says are the agent's own count: a look-alike leaves its slot empty."""
    models = {m.name: m for m in config.models if m.placement == "jobs" and m.job is not None}
    if not models:
        return ()
    found, _ = _sort_jobs(config, jobs, trust)
    out = []
    for model in models.values():
        assert model.job is not None
        for index in range(model.job.replicas):
            port = port_of(model, index)
            mine = found.get((model.name, index), [])
            if not mine:
                out.append(JobReplica(model.name, index, port, Phase.LENT))
                continue
            # A running job beats a pending one, then the oldest: the others are duplicates.
            mine.sort(key=lambda t: (t[2] is Phase.RECLAIMING, t[0].job_id))
            job, comment, phase = mine[0]
            # The job's own start: the Comment's time is its submission (the script writes
            # `held`, and `reclaiming` back, from texts signed then: see render_script).
            since = job.start_time if phase in (Phase.STARTING, Phase.HELD) else comment.since
            url = model.job.url.format(node=job.nodes[0], port=port) if job.nodes else ""
            out.append(JobReplica(
                model.name, index, port, phase, since, job.job_id, job.state, job.nodes, url,
                job.state_reason if phase is Phase.RECLAIMING else "",
                tuple(j.job_id for j, _, _ in mine[1:]), job.gpus, pinned=comment.pinned))
    return tuple(out)


@dataclass(frozen=True)
class GpuReport:
    """The Comments a replica job's script writes on its own job while it waits for its GPUs:
    `held` once it finds one held, `back` (the submission's `reclaiming`) once they are all
    free. The agent signs both when it submits the job (the script cannot sign), so the job
    stays ours while it reports, and the agent reads HELD back like any phase of ours."""

    held: str
    back: str


def gpu_report(config: Config, model: ModelConfig, index: int, now: float, pinned: bool = False,
               trust: ReplicaTrust | None = None) -> GpuReport:
    tag, port = config.slurm.tag, port_of(model, index)
    return GpuReport(format_comment(tag, Phase.HELD, now, model.name, index, port, pinned, trust),
                     format_comment(tag, Phase.RECLAIMING, now, model.name, index, port, pinned, trust))


#: The check gpu_wait repeats: true (and each held GPU named) while one holds over {max} MiB.
_GPU_CHECK = """\
# slurm-idle: start vLLM only once no one else holds memory on this job's GPUs.
slurm_idle_gpus_held() {{
  command -v nvidia-smi >/dev/null 2>&1 || {{
    echo 'slurm-idle: nvidia-smi not found: GPUs not checked before vLLM starts'; return 1; }}
  [ -n "${{CUDA_VISIBLE_DEVICES:-}}" ] || {{
    echo 'slurm-idle: no CUDA_VISIBLE_DEVICES: GPUs not checked before vLLM starts'; return 1; }}
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -i "$CUDA_VISIBLE_DEVICES" |
    awk -F', *' -v max={max} '$2 + 0 > max {{ held = 1
      printf "slurm-idle: GPU %s holds %s MiB (allowed %s): not starting vLLM\\n", $1, $2, max }}
      END {{ exit !held }}'
}}"""


def gpu_wait(tolerance_mib: int, report: GpuReport | None) -> list[str]:
    """Shell lines that keep vLLM from starting on a GPU of the job someone else still holds
    (a process Slurm no longer tracks: vLLM would fail out of memory there). Every ~10 s each
    such GPU is named on stderr; the job's Comment says `held` meanwhile. Without nvidia-smi
    (or without GPUs in CUDA_VISIBLE_DEVICES) it says so and never blocks. It checks the GPUs
    of the node the batch script runs on (a multi-node replica's first node)."""
    lines = _GPU_CHECK.format(max=tolerance_mib).splitlines()
    lines.append("if slurm_idle_gpus_held >&2; then")
    if report is not None:
        lines.append(f'  scontrol update JobId="$SLURM_JOB_ID" Comment={shlex.quote(report.held)} || true')
    lines.append("  while sleep 10 && slurm_idle_gpus_held >&2; do :; done")
    if report is not None:
        # Tried until it takes (a slurmctld busy for a moment): a Comment left `held` while
        # vLLM serves would keep the replica out of the count (the agent's check of health
        # first is the second line of defence).
        lines.append(f'  for _ in 1 2 3 4 5 6; do scontrol update JobId="$SLURM_JOB_ID" '
                     f'Comment={shlex.quote(report.back)} && break; sleep 5; done')
    return [*lines, "fi"]


def render_script(config: Config, model: ModelConfig, index: int, script_text: str | None = None,
                  report: GpuReport | None = None) -> str:
    """The batch script of one replica job: resources from `job:`, the wait for its GPUs
    (gpu_wait; `report`: the Comments it writes meanwhile), then `srun` of the command (or
    the site's own script, `script_text`, with SLURM_IDLE_* set before it)."""
    job = model.job
    assert job is not None
    port = port_of(model, index)
    gpus = model.job_gpus_per_replica
    per_node = max(1, gpus // job.nodes_per_replica)
    lines = ["#!/bin/bash",
             f"#SBATCH --nodes={job.nodes_per_replica}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gres=gpu:{per_node}"]
    if job.cpus is not None:
        lines.append(f"#SBATCH --cpus-per-task={job.cpus}")
    if job.mem is not None:
        lines.append(f"#SBATCH --mem={job.mem}")
    if job.time is not None:
        lines.append(f"#SBATCH --time={job.time}")
    lines += [f"#SBATCH {arg}" for arg in job.sbatch_args]
    lines.append(f"export SLURM_IDLE_MODEL={shlex.quote(model.name)} SLURM_IDLE_INDEX={index} "
                 f"SLURM_IDLE_PORT={port}")
    lines += gpu_wait(config.gpu.free_tolerance_mib, report)
    if script_text is not None:
        body = script_text.split("\n", 1)[1] if script_text.startswith("#!") else script_text
        return "\n".join([*lines, body.rstrip("\n")]) + "\n"
    assert job.command is not None
    command = job.command.format(port=port, model=shlex.quote(model.name), index=index)
    return "\n".join([*lines, f"exec srun --kill-on-bad-exit=1 {command}"]) + "\n"


def submit_args(config: Config, model: ModelConfig, index: int, now: float,
                pinned: bool = False, trust: ReplicaTrust | None = None) -> list[str]:
    """sbatch options on the command line (the Comment has spaces: no #SBATCH quoting)."""
    tag = config.slurm.tag
    comment = format_comment(tag, Phase.RECLAIMING, now, model.name, index, port_of(model, index),
                             pinned, trust)
    return [f"--partition={partition_of(config, model)}",
            f"--job-name={job_name(tag, model.name, index)}", f"--comment={comment}"]


def steer_args(node: str, slurm_version: str | None, prefer_feature: str | None) -> list[str]:
    """sbatch options that steer a replica job towards `node` (policy/jobs.py steer()).

    `--nodelist` (hard: the job waits for that node) everywhere; with `slurm.prefer_feature`
    (a feature naming each node) on Slurm >= 22.05 `--prefer`
    instead, which Slurm treats as a wish: when that node cannot take the job, it goes where
    Slurm can place it rather than pending behind the choice."""
    if not node:
        return []
    if prefer_feature is not None and slurm_version is not None:
        from slurm_idle.errors import SlurmIdleError
        from slurm_idle.slurm.parse import major_minor

        try:
            new_enough = major_minor(slurm_version) >= PREFER_SINCE
        except SlurmIdleError:
            new_enough = False
        if new_enough:
            return [f"--prefer={prefer_feature.format(node=node)}"]
    return [f"--nodelist={node}"]
