"""In-memory fakes of the Slurm backend, engine control, metrics source and GPU readings.

They follow the same protocols as the real adapters, for pure tests of the agent's glue and
for users who want to dry-run their own policy code. They are NOT used to claim anything about
Slurm or vLLM behaviour: contract tests run the real adapters against the real services.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from slurm_idle.config import ModelConfig, ReplicaConfig
from slurm_idle.engine import EngineHealth, Identity
from slurm_idle.errors import EngineError
from slurm_idle.model import GpuReading, ModelLoad, ReplicaLoad, SlurmJob, SlurmNode
from slurm_idle.replicatrust import agent_user
from slurm_idle.slurm.parse import JobSignal
from slurm_idle.slurm.protocol import AcctJob


def _sbatch_lines(script: str) -> list[str]:
    """The options of a script's `#SBATCH` lines, in order."""
    return [arg for line in script.splitlines() if line.startswith("#SBATCH")
            for arg in line.split()[1:]]


def _sbatch_options(args: Sequence[str]) -> dict[str, str]:
    """`--name=value`, `--name value` and `-J value`/`-p value` options by long name."""
    short = {"-J": "job-name", "-p": "partition"}
    out: dict[str, str] = {}
    it = iter(args)
    for arg in it:
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            out[key] = value
        elif arg in short or arg in {"--job-name", "--partition"}:
            out[short.get(arg, arg[2:])] = next(it, "")
    return out


@dataclass
class FakeSlurm:
    """A cluster as a dict of nodes and a list of jobs; records every call."""

    node_map: dict[str, SlurmNode] = field(default_factory=dict)
    job_list: list[SlurmJob] = field(default_factory=list)
    log: list[tuple[str, ...]] = field(default_factory=list)
    calls: int = 0
    fail_on: set[str] = field(default_factory=set)  # method names that raise CommandError
    requeues: list[tuple[tuple[int, ...], float]] = field(default_factory=list)  # (ids, grace_s)
    signals: list[tuple[tuple[int, ...], str, bool]] = field(default_factory=list)
    no_steps: set[int] = field(default_factory=set)  # jobs whose steps ended (workload_steps)
    job_signals: dict[int, JobSignal] = field(default_factory=dict)  # each job's own --signal
    fail_jobs: set[int] = field(default_factory=set)  # jobs whose requeue fails (CommandError)
    power_up_polls: int = 0  # nodes() shows POWERING_UP this many times after a power_up
    acct: list[AcctJob] = field(default_factory=list)  # what accounting() answers from
    submitted: list[tuple[int, str, tuple[str, ...]]] = field(default_factory=list)
    next_job_id: int = 1
    slurm_version: str = "22.05.8"
    cluster: str = "fake"  # ClusterName
    _powering: dict[str, int] = field(default_factory=dict)
    scripts: dict[int, str] = field(default_factory=dict)  # job id -> batch script (submit)
    # Whom submit() runs as (the job's user, as slurmctld sets it): this process's user.
    submit_user: str = field(default_factory=agent_user)

    @classmethod
    def with_nodes(cls, names: Sequence[str], gpus: int = 4) -> FakeSlurm:
        return cls({n: SlurmNode(name=n, state="idle", gpus_total=gpus, partitions=("inference", "idle"))
                    for n in names})

    def _call(self, *entry: str) -> None:
        from slurm_idle.errors import CommandError

        self.calls += 1
        self.log.append(entry)
        if entry[0] in self.fail_on:
            raise CommandError(["fake", *entry], 1, f"{entry[0]} failed (injected)")

    def nodes(self) -> list[SlurmNode]:
        self._call("nodes")
        for name, left in list(self._powering.items()):
            if left <= 0:
                n = self.node_map[name]
                self.node_map[name] = replace(n, flags=n.flags - {"POWERING_UP"})
                del self._powering[name]
            else:
                self._powering[name] = left - 1
        return list(self.node_map.values())

    def jobs(self) -> list[SlurmJob]:
        self._call("jobs")
        return list(self.job_list)

    def drain(self, node: str, reason: str) -> None:
        self._call("drain", node, reason)
        n = self.node_map[node]
        busy = any(node in j.nodes and j.state == "RUNNING" for j in self.job_list)
        flags = (n.flags - {"DRAIN", "DRAINING"}) | {"DRAINING" if busy else "DRAIN"}
        self.node_map[node] = replace(n, flags=frozenset(flags), reason=reason)

    def resume(self, node: str) -> None:
        self._call("resume", node)
        n = self.node_map[node]
        self.node_map[node] = replace(n, flags=n.flags - {"DRAIN", "DRAINING", "DRAINED"}, reason="")

    def power_up(self, node: str) -> None:
        """Clears the power-saving flags, after `power_up_polls` reads showing POWERING_UP.
        Like Slurm 22.05, the power-up clears a drained node's Reason."""
        self._call("power_up", node)
        n = self.node_map[node]
        powered = {"POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "POWER_DOWN", "POWER_UP"}
        flags = n.flags - powered
        if self.power_up_polls > 0:
            flags |= {"POWERING_UP"}
            self._powering[node] = self.power_up_polls
        self.node_map[node] = replace(n, flags=frozenset(flags), reason="" if n.drained else n.reason)

    def set_comment(self, node: str, comment: str) -> None:
        self._call("set_comment", node, comment)
        self.node_map[node] = replace(self.node_map[node], comment=comment)

    def requeue(self, job_ids: Sequence[int], grace_s: float = 0) -> None:
        from slurm_idle.slurm.protocol import NotRequeueable

        if grace_s:  # as the real backends: the caller signals and waits, under its deadline
            raise ValueError("requeue() no longer waits: signal() first and wait in the caller")
        self._call("requeue", *map(str, job_ids))
        self.requeues.append((tuple(job_ids), grace_s))
        from slurm_idle.errors import CommandError

        failing = sorted(set(job_ids) & self.fail_jobs)
        if failing:
            raise CommandError(["scontrol", "requeue"], 1, f"requeue of job {failing[0]} failed (injected)")
        interactive = [j.job_id for j in self.job_list if j.job_id in job_ids and not j.batch]
        if interactive:  # what Slurm answers for srun/salloc jobs (and requeues none of them)
            raise NotRequeueable(["scontrol", "requeue"], 1,
                                 f"Only batch jobs are accepted or processed for job {interactive[0]}")
        self.job_list = [
            replace(j, state="PENDING", nodes=(), restart_count=j.restart_count + 1)
            if j.job_id in job_ids else j
            for j in self.job_list
        ]


    def signal(self, job_ids: Sequence[int], signal: str, batch_shell: bool = False) -> None:
        self._call("signal", signal, "batch" if batch_shell else "steps", *map(str, job_ids))
        self.signals.append((tuple(job_ids), signal, batch_shell))

    def submit(self, script: str, extra_args: Sequence[str] = ()) -> int:
        """A PENDING job with the partition, name and comment of `extra_args` (`--key=value`)."""
        self._call("submit", *extra_args)
        opts = dict(a[2:].split("=", 1) for a in extra_args if a.startswith("--") and "=" in a)
        job_id = max((j.job_id for j in self.job_list), default=0) + 1
        self.job_list.append(SlurmJob(job_id, opts.get("job-name", "sbatch"),
                                      opts.get("partition", "idle"), "PENDING",
                                      comment=opts.get("comment", ""), user=self.submit_user))
        self.scripts[job_id] = script
        return job_id

    def set_job_comment(self, job_id: int, comment: str) -> None:
        self._call("set_job_comment", str(job_id), comment)
        self.job_list = [replace(j, comment=comment) if j.job_id == job_id else j
                         for j in self.job_list]

    def cancel(self, job_ids: Sequence[int], signal: str | None = None) -> None:
        """Cancels the jobs; with `signal`, only signals them (as `scancel --signal`)."""
        self._call("cancel", *map(str, job_ids))
        if signal is not None:
            self.signals.append((tuple(job_ids), signal, False))
            return
        self.job_list = [j for j in self.job_list if j.job_id not in job_ids]

    def accounting(
        self,
        since: float | None,
        until: float | None,
        partition: str | None = None,
        job_ids: Sequence[int] = (),
    ) -> list[AcctJob]:
        """The `acct` rows given, filtered as sacct filters them (partition, ids, a run that
        overlaps [since, until))."""
        self._call("accounting")
        out = []
        for job in self.acct:
            if partition is not None and job.partition != partition:
                continue
            if job_ids and job.job_id not in job_ids:
                continue
            if until is not None and job.start is not None and job.start >= until:
                continue
            if since is not None and job.end is not None and job.end < since:
                continue
            out.append(job)
        return out

    def version(self) -> str:
        self._call("version")
        return self.slurm_version

    def cluster_name(self) -> str:
        self._call("cluster_name")
        return self.cluster

    def workload_steps(self) -> dict[int, int]:
        """Running jobs have one workload step unless `no_steps` lists them."""
        self._call("workload_steps")
        return {j.job_id: 1 for j in self.job_list
                if j.state == "RUNNING" and j.job_id not in self.no_steps}

    def job_signal(self, job_id: int) -> JobSignal | None:
        return self.job_signals.get(job_id)


@dataclass
class FakeEngine:
    """Engines per replica (keyed by its name: the node in one-replica-per-node pools): up/down,
    requests running and waiting; start/stop are instant unless told. Answers with the real
    engines' types (EngineHealth, Identity)."""

    up: dict[str, bool] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)
    start_delay_polls: int = 0  # health() says not serving this many times after a start
    # replica -> the error its start (or wake) answers, e.g. a CUDA out of memory; a cold
    # restart clears it when `cold` (an engine whose kind can restart cold).
    fail_starts: dict[str, str] = field(default_factory=dict)
    cold: bool = False
    failing: set[str] = field(default_factory=set)  # running, but its /health fails
    asleep: set[str] = field(default_factory=set)  # running, asleep
    # running, an engine that sleeps (http-sleep) whose sleep state cannot be told
    sleep_unknown: set[str] = field(default_factory=set)
    log: list[tuple[str, str]] = field(default_factory=list)
    _pending: dict[str, int] = field(default_factory=dict)

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        self.log.append(("start", replica.name))
        if replica.name in self.fail_starts:
            raise EngineError(f"{replica.name}: {self.fail_starts[replica.name]}")
        if not self.up.get(replica.name):
            self._pending[replica.name] = self.start_delay_polls
        self.up[replica.name] = True

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        self.log.append(("stop", replica.name))
        self.up[replica.name] = False

    def cold_restart(self, replica: ReplicaConfig, timeout_s: float | None = None) -> bool:
        """Stop and start afresh when `cold`: a fresh server no longer fails its start."""
        self.log.append(("cold_restart", replica.name))
        if not self.cold:
            return False
        self.fail_starts.pop(replica.name, None)
        self.up[replica.name] = True
        self._pending[replica.name] = self.start_delay_polls
        return True

    def released(self, replica: ReplicaConfig) -> bool:
        """Stopped at once: released as soon as it is not up."""
        return not self.up.get(replica.name)

    def stop_drops_requests(self, replica: ReplicaConfig) -> str | None:
        """A fake engine's stop keeps its requests (a current vLLM's would)."""
        return None

    def in_flight(self, replica: ReplicaConfig) -> float | None:
        """Running plus waiting, like the real engines (a waiting request is dropped too)."""
        if not self.up.get(replica.name):
            return None
        return self.running.get(replica.name, 0.0) + self.waiting.get(replica.name, 0.0)

    def health(self, replica: ReplicaConfig) -> EngineHealth:
        if not self.up.get(replica.name):
            return EngineHealth(up=False, awake=None, error="connection refused (fake)")
        if self._pending.get(replica.name, 0) > 0:
            self._pending[replica.name] -= 1
            return EngineHealth(up=False, awake=None, error="starting (fake)")
        if replica.name in self.failing:
            return EngineHealth(up=False, awake=None, error="/health answered 503")
        if replica.name in self.sleep_unknown:
            return EngineHealth(up=True, awake=None, may_sleep=True)
        return EngineHealth(up=True, awake=replica.name not in self.asleep,
                            running=self.running.get(replica.name, 0.0),
                            waiting=self.waiting.get(replica.name, 0.0))

    def identify(self, replica: ReplicaConfig) -> Identity:
        """Ours while up; a down engine is proven absent, as a refused connection is."""
        if not self.up.get(replica.name):
            return Identity(False, "nothing answers /v1/models (fake)")
        return Identity(True, "fake engine")

    def check(self, replica: ReplicaConfig) -> EngineHealth:
        """The tick's probe as the real engines answer it: a down engine is proven absent
        (refused), one in `failing` runs but its /health fails, one in `asleep` sleeps."""
        if not self.up.get(replica.name):
            why = "nothing answers /v1/models (fake)"
            return EngineHealth(up=False, awake=None, error=why, foreign=why, foreign_proven=True)
        if replica.name in self.failing:
            return EngineHealth(up=False, awake=None, error="/health answered 503")
        return EngineHealth(up=True, awake=replica.name not in self.asleep)


@dataclass
class FakeMetrics:
    """Returns the loads it was given (unknown for the other replicas asked for, as the real
    sources do); `fail` makes it raise MetricsUnavailable."""

    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    models: dict[str, ModelLoad] = field(default_factory=dict)
    fail: bool = False
    queries: int = 0

    def replica_loads(
        self,
        replicas: Sequence[tuple[str, ReplicaConfig]],
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ReplicaLoad]:
        from slurm_idle.errors import MetricsUnavailable

        self.queries += 1
        if self.fail:
            raise MetricsUnavailable("fake metrics source is down")
        # One per replica asked, in order, like the real sources: one it was not given reads
        # unknown (a real source's missing or stale series), never absent.
        return [self.replicas.get(r.name) or ReplicaLoad(model=m, node=r.node, url=r.url, known=False)
                for m, r in replicas]

    def model_loads(
        self,
        models: Sequence[ModelConfig],
        now: float,
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ModelLoad]:
        from slurm_idle.errors import MetricsUnavailable

        self.queries += 1
        if self.fail:
            raise MetricsUnavailable("fake metrics source is down")
        return [self.models.get(m.name, ModelLoad(model=m.name, known=False)) for m in models]


@dataclass
class FakeGpus:
    """GPU readings per node as given (a node not given has no series, like one without an
    exporter); `fail` makes it raise MetricsUnavailable. Records the nodes each call asked for."""

    nodes: dict[str, tuple[GpuReading, ...]] = field(default_factory=dict)
    fail: bool = False
    asked: list[tuple[str, ...]] = field(default_factory=list)

    def readings(self, nodes: Sequence[str], *, budget_s: float) -> dict[str, tuple[GpuReading, ...]]:
        from slurm_idle.errors import MetricsUnavailable

        self.asked.append(tuple(nodes))
        if self.fail:
            raise MetricsUnavailable("fake GPU exporter is down")
        return {n: self.nodes[n] for n in nodes if n in self.nodes}

    def hold(self, node: str, index: int, used_mib: int, holder: str | None = None,
             total_mib: int = 81559) -> None:
        """Set one GPU's reading (the node's others kept)."""
        others = tuple(g for g in self.nodes.get(node, ()) if g.index != index)
        reading = GpuReading(index=index, used_mib=used_mib, total_mib=total_mib, holder=holder)
        self.nodes[node] = tuple(sorted((*others, reading), key=lambda g: g.index))
