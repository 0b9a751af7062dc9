"""Domain types shared by the adapters, the planner and the agent.

Everything here is a frozen value: the agent builds one `Observation` per tick from Slurm and
the metrics, hands it to the pure planner, and gets back `Action`s. No module below this one
knows about subprocesses, HTTP or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Phase(StrEnum):
    """Where a pool node is in its serve/lend lifecycle (see lifecycle.py for the edges)."""

    SERVING = "serving"  # drained in Slurm, vLLM replica up and taking traffic
    RETIRING = "retiring"  # drained, waiting for in-flight requests to finish before stopping vLLM
    LENDING = "lending"  # drained, vLLM being stopped/slept, node about to be RESUMEd
    LENT = "lent"  # schedulable in the idle partition, vLLM stopped
    RECLAIMING = "reclaiming"  # drained again, idle jobs requeued, waiting for the node to empty
    HELD = "held"  # drained and empty of jobs, but a GPU still holds memory that is not the engine's
    STARTING = "starting"  # drained and empty, vLLM starting/waking, waiting for health
    ADMIN = "admin"  # drained/down by someone else: never touched
    UNKNOWN = "unknown"  # not in a state we recognise (e.g. never adopted, or DOWN with our tag)


@dataclass(frozen=True)
class Replica:
    """One vLLM endpoint on a set of GPUs: part of a node, a node, or several nodes.

    `nodes[0]` is the head (where `url` points). `gpus` are its GPU indexes on each node, None
    for whole nodes. The planner decides replicas per model; Slurm lends whole nodes, so a
    replica leaves and comes back with its `LendGroup`.
    """

    name: str
    model: str
    nodes: tuple[str, ...]
    url: str
    gpus: tuple[int, ...] | None = None
    port: int | None = None
    index: int = 0  # position among the replicas on its head node

    @property
    def node(self) -> str:
        return self.nodes[0]


@dataclass(frozen=True)
class LendGroup:
    """The unit Slurm can lend: the nodes joined by replicas (a node with two replicas, or the
    two nodes of a replica that spans both). Lent only when every replica on it is retired;
    its phase lives on every one of its nodes."""

    nodes: tuple[str, ...]
    replicas: tuple[Replica, ...]

    @property
    def name(self) -> str:
        """The group's key node: actions and journal lines name the group by it."""
        return self.nodes[0]

    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.model for r in self.replicas))


@dataclass(frozen=True)
class SlurmNode:
    """One node as Slurm reports it, version differences already parsed away."""

    name: str
    state: str  # base state, lower case: idle, mixed, allocated, down, ...
    flags: frozenset[str] = frozenset()  # upper case: DRAIN, DRAINING, NOT_RESPONDING, ...
    reason: str = ""
    gpus_total: int = 0
    gpus_used: int = 0
    partitions: tuple[str, ...] = ()
    comment: str = ""
    reason_changed_at: float | None = None  # unix seconds

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or "DRAINING" in self.flags or "DRAINED" in self.flags

    @property
    def down(self) -> bool:
        # NOT_RESPONDING alone is not down: Slurm shows it for a second after every RESUME until
        # slurmd answers the next ping, and marks a node that stays silent DOWN itself.
        return self.state in {"down", "fail", "future", "unknown"} or bool(
            self.flags & {"DOWN", "FAIL", "POWERED_DOWN"}
        )


@dataclass(frozen=True)
class SlurmJob:
    """One job as Slurm reports it."""

    job_id: int
    name: str
    partition: str
    state: str  # upper case base state: PENDING, RUNNING, COMPLETING, PREEMPTED, ...
    nodes: tuple[str, ...] = ()
    restart_count: int = 0
    requeue: bool = True
    start_time: float | None = None  # unix seconds, None if not started
    gpus: int = 0
    comment: str = ""
    user: str = ""
    state_reason: str = ""
    # A batch job (sbatch). srun/salloc jobs are not: Slurm refuses to requeue them ("Only
    # batch jobs are accepted"), so a reclaim signals them, waits the grace, then cancels them.
    batch: bool = True
    account: str = ""
    submit_time: float | None = None  # unix seconds (replica jobs of an older agent: replicatrust)
    # Per node of `nodes`, the indexes of the GPUs Slurm gave the job there (gres_detail).
    gpu_indexes: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class ForeignReplicaJob:
    """A job shaped like one of our replica jobs that is not ours (replicatrust.py): ignored."""

    job_id: int
    user: str
    nodes: tuple[str, ...]
    replica: str  # the replica it claims, MODEL#INDEX
    why: str

    def describe(self) -> str:
        node = ",".join(self.nodes) or "no node yet"
        return (f"foreign replica-like job {self.job_id} of user {self.user or '?'} on {node}: "
                f"ignored (claims {self.replica}; {self.why})")


@dataclass(frozen=True)
class ReplicaLoad:
    """The load signals of one vLLM replica (one server; data-parallel engines summed).

    `known` is False when the series were missing or stale: the planner must then not lend on
    this evidence. `sleeping` (vllm:engine_sleep_state): the engine is asleep, so the replica
    serves nothing whatever its phase says. Rates are per second over the configured window;
    latencies in seconds.
    """

    model: str
    node: str
    url: str = ""
    known: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0  # 0..1
    sleeping: bool = False
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    ttft_p95_s: float | None = None
    queue_time_p95_s: float | None = None
    healthy: bool | None = None  # /health answered 200 (None: not checked this tick)
    name: str = ""  # the replica's name (Replica.name); "" in one-replica-per-node setups
    # The endpoint proved not to be the expected engine this tick (agent.observe's identity
    # check): it serves nothing of ours whatever its phase says, like a sleeping one.
    foreign: bool = False


@dataclass(frozen=True)
class ModelLoad:
    """Fleet-wide demand signals of one model, from Prometheus (range queries) or scrapes.

    `*_max_window` are maxima over the scale-down window (stateless hysteresis), None unless
    the source's history covers the whole window; the `forecast_*` fields are what the same
    time yesterday / last week saw ahead of now (None when there is no history).
    """

    model: str
    known: bool = True
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    running: float = 0.0
    waiting: float = 0.0  # now: sizes a scale-up, never triggers one by itself
    # min of `waiting` over the last policy.queue_sustain_s, None if the history is shorter:
    # above policy.queue_waiting_threshold, a queue has lasted that long (the queue signal)
    waiting_min_recent: float | None = None
    kv_cache_usage_max: float = 0.0
    ttft_p95_s: float | None = None
    demand_tokens_per_s_max_window: float | None = None
    waiting_max_window: float | None = None
    waiting_min_window: float | None = None  # > 0 means the queue never emptied: sustained
    # the demand's mean and least-squares slope (per second) over the scale-down window, None
    # unless the window is covered, and its noise: the standard deviation of its 10-minute
    # changes over the last hour / sqrt(2) (metrics/forecast.py NOISE_*), None without that hour.
    # The planner estimates the load's level, trend and variability from them (capacity.Spread)
    demand_tokens_per_s_mean_window: float | None = None
    demand_trend_per_s_window: float | None = None
    demand_noise_tokens_per_s: float | None = None
    forecast_demand_tokens_per_s: float | None = None
    # forecast maximum over [now, now + lead + scale-down window]: a replica lent now must not
    # be needed back within the window (policy.forecast_demand computes both from history)
    forecast_demand_tokens_per_s_max_window: float | None = None


@dataclass(frozen=True)
class GpuReading:
    """One GPU's framebuffer memory as the site's GPU exporter last reported it."""

    index: int
    used_mib: int
    total_mib: int | None = None
    # "job 123" when the exporter names the job holding it ("job 12, job 13" when several
    # share it), else None: the exporter's allocation map, not the process holding the memory
    holder: str | None = None
    sample_ts: float | None = None  # unix seconds of the sample


@dataclass(frozen=True)
class NodeView:
    """One pool node as the planner sees it: Slurm facts + our phase + its replica's load."""

    node: SlurmNode
    model: str
    phase: Phase
    phase_since: float | None = None  # unix seconds the current phase started, if known
    pinned: bool = False
    jobs: tuple[SlurmJob, ...] = ()
    replica: ReplicaLoad | None = None  # the (first) replica headed on this node
    replicas: tuple[ReplicaLoad, ...] = ()  # every replica headed on it, when there are several
    # Its GPUs' memory per the site's GPU exporter, by index; None: no fresh series observed
    # (no exporter, Prometheus down, or GPU readings not asked for).
    gpus: tuple[GpuReading, ...] | None = None

    @property
    def name(self) -> str:
        return self.node.name

    def loads(self) -> tuple[ReplicaLoad, ...]:
        """The loads of the replicas headed on this node."""
        if self.replicas:
            return self.replicas
        return (self.replica,) if self.replica is not None else ()


@dataclass(frozen=True)
class GroupView:
    """One lend group as the planner and the node driver see it: its nodes' views and the one
    phase they share (topology.group_phase says how a group whose nodes disagree is read)."""

    group: LendGroup
    nodes: tuple[NodeView, ...]
    phase: Phase
    phase_since: float | None = None
    pinned: bool = False

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def jobs(self) -> tuple[SlurmJob, ...]:
        return tuple(j for v in self.nodes for j in v.jobs)

    @property
    def gpus_total(self) -> int:
        return sum(v.node.gpus_total for v in self.nodes)

    def load(self, replica: Replica) -> ReplicaLoad | None:
        """The replica's load, found on its head node's view (by name, url, or as its only one)."""
        if len(self.nodes) == 1 and len(self.group.replicas) == 1:  # a node, a replica: the fast path
            only = self.nodes[0]
            return only.replica if only.replica is not None or not only.replicas else only.replicas[0]
        head = next((v for v in self.nodes if v.name == replica.node), None)
        if head is None:
            return None
        loads = head.loads()
        for load in loads:
            if (load.name and load.name == replica.name) or (load.url and load.url == replica.url):
                return load
        if len(loads) == 1 and not loads[0].name and not loads[0].url:
            return loads[0]
        if len(loads) == 1 and sum(1 for r in self.group.replicas if r.node == replica.node) == 1:
            return loads[0]
        return None


@dataclass(frozen=True)
class JobReplica:
    """One replica of a `placement: jobs` model as Slurm shows it: its batch job (if any) and
    the phase that job's state and our Comment on it say (replicajobs.derive_job_phase).

    No job is LENT (its GPUs are Slurm's to give to the idle partition); a PENDING job is
    RECLAIMING; a running one is STARTING until our Comment says SERVING (or RETIRING);
    a COMPLETING one (cancelled by us) is LENDING. `duplicates` are further jobs of ours for
    the same replica (a lost race): the driver cancels them.
    """

    model: str
    index: int
    port: int
    phase: Phase
    phase_since: float | None = None
    job_id: int | None = None
    job_state: str = ""  # Slurm's state of the job, "" without one
    nodes: tuple[str, ...] = ()
    url: str = ""  # where the replica answers once placed ("" before)
    state_reason: str = ""  # Slurm's reason a job is PENDING (Resources, Priority, ...)
    duplicates: tuple[int, ...] = ()
    gpus: int = 0
    load: ReplicaLoad | None = None
    pinned: bool = False  # an admin's pin (in our Comment): never lent by the planner

    @property
    def name(self) -> str:
        """`model#index`: the replica's name in actions, journal lines and status."""
        return f"{self.model}#{self.index}"


@dataclass(frozen=True)
class Observation:
    """One consistent snapshot of the pool, built once per tick."""

    now: float
    nodes: tuple[NodeView, ...]
    models: tuple[ModelLoad, ...] = ()
    errors: tuple[str, ...] = ()  # observation problems worth reporting (e.g. metrics down)
    # Which metrics source answered: prometheus | scrape (the fallback) | none; "" when the
    # source does not say (a single configured source)
    metrics_source: str = ""
    # The replicas of `placement: jobs` models, every configured index (LENT when no job).
    replica_jobs: tuple[JobReplica, ...] = ()
    # The nodes of the partitions replica jobs run in, each with its lend-partition jobs (what a
    # replica job would preempt there): where the planner steers a reclaim (policy/jobs.py).
    placement_nodes: tuple[NodeView, ...] = ()
    # Jobs shaped like replica jobs that are not the agent's (replicatrust.py): ignored.
    foreign_replica_jobs: tuple[ForeignReplicaJob, ...] = ()
    # Replicas whose start or wake failed since they last served (engine_notes.py): a wake is
    # expected in seconds, so such a replica is not counted as coming back.
    failed_starts: frozenset[str] = frozenset()
    # Replicas whose lend was refused: their engine left more than gpu.max_residue_mib on a
    # GPU (engine_notes.py). Not lent again until an admin unpins them.
    lend_refused: frozenset[str] = frozenset()

    def model_load(self, model: str) -> ModelLoad | None:
        for load in self.models:
            if load.model == model:
                return load
        return None


class ActionKind(StrEnum):
    """What the agent is asked to do to a node."""

    LEND = "lend"  # start SERVING -> RETIRING -> LENDING -> LENT
    RECLAIM = "reclaim"  # start LENT -> RECLAIMING -> STARTING -> SERVING
    CONTINUE = "continue"  # carry on a transition already under way (after a crash or timeout)
    ABORT_LEND = "abort-lend"  # RETIRING back to SERVING: load rose before the replica stopped
    ADOPT = "adopt"  # bring an unmanaged pool node into SERVING (service first)
    # SERVING -> STARTING: its engine is gone or not ours; restart it (placement: jobs,
    # SERVING -> RETIRING: cancel its job, submitted again when needed)
    REPAIR = "repair"
    HAND_OVER = "hand-over"  # HELD -> ADMIN: a GPU still held past gpu_free_s; the admin's now


@dataclass(frozen=True)
class Action:
    """One decision of the planner, with the reason `explain` shows to humans."""

    kind: ActionKind
    node: str
    model: str
    from_phase: Phase
    to_phase: Phase
    reason: str
    details: dict[str, float | int | str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ModelPlan:
    """The planner's verdict for one model, reported by `status` and the agent's metrics."""

    model: str
    needed_replicas: int
    serving_replicas: int
    reason: str
