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
    STARTING = "starting"  # drained and empty, vLLM starting/waking, waiting for health
    ADMIN = "admin"  # drained/down by someone else: never touched
    UNKNOWN = "unknown"  # not in a state we recognise (e.g. never adopted, or DOWN with our tag)


#: Phases in which the node is in the middle of a transition.
TRANSITIONAL = frozenset({Phase.RETIRING, Phase.LENDING, Phase.RECLAIMING, Phase.STARTING})


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
class NodeView:
    """One pool node as the planner sees it: Slurm facts + our phase + its replica's load."""

    node: SlurmNode
    model: str
    phase: Phase
    phase_since: float | None = None  # unix seconds the current phase started, if known
    pinned: bool = False
    jobs: tuple[SlurmJob, ...] = ()
    replica: ReplicaLoad | None = None

    @property
    def name(self) -> str:
        return self.node.name


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
