"""The doctor's checks: pure functions from what was read off the site (`SiteFacts`) and the
config to `Check` verdicts, each `ok`, `warn` or `fail` with the fix in one line.

Nothing here runs a command or opens a socket (gather.py does, once), so every verdict is
unit-tested on captured Slurm output of both releases. A part of the site that could not be
read at all (scontrol missing, Prometheus down) is a `fail` of the checks that need it, named
with the reading's own error, never a silent pass.

A little over 500 lines on purpose: every check is a short pure function of the same
`SiteFacts`, listed in the order `doctor` prints them; one file is that order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from slurm_idle import powersave
from slurm_idle.config import Config
from slurm_idle.lifecycle import derive_phase, takes_traffic
from slurm_idle.model import GpuReading, Phase, ReplicaLoad, SlurmNode
from slurm_idle.slurm.text import PartitionInfo, is_unset, parse_duration_s

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    """One verdict: `detail` says what was found and, unless ok, what to do."""

    name: str
    status: Status
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass(frozen=True)
class SubmitProbe:
    """`sbatch --test-only` on the lend partition, with --no-requeue and with --requeue."""

    no_requeue_rc: int
    no_requeue_output: str
    requeue_rc: int
    requeue_output: str


@dataclass(frozen=True)
class EngineFacts:
    """What was found about one replica's engine control (problems empty when all is well)."""

    node: str
    model: str
    kind: str
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # Why GET <url>/health did not answer 200 (replica_health.engine_down), None when it did.
    # A failure only where the replica should be serving: a lent replica's engine is stopped.
    down: str | None = None
    replica: str = ""  # the replica's name; "": the first replica headed on `node`


@dataclass(frozen=True)
class SiteFacts:
    """Everything the doctor read, each part None with an error when it could not be read."""

    slurm_config: Mapping[str, str] | None = None
    partitions: tuple[PartitionInfo, ...] | None = None
    nodes: tuple[SlurmNode, ...] | None = None
    submit: SubmitProbe | None = None
    replicas: Mapping[str, ReplicaLoad] | None = None  # replica name -> load, from the metrics source
    engines: tuple[EngineFacts, ...] = ()
    paths: tuple[tuple[str, str, str | None], ...] = ()  # (config key, path, problem)
    router_states: Mapping[str, str] | None = None  # replica -> in/out/missing/unknown (routers)
    # node -> its GPUs' fresh readings (nodes without series left out); None: not read
    gpus: Mapping[str, tuple[GpuReading, ...]] | None = None
    errors: Mapping[str, str] = field(default_factory=dict)  # part -> why it is missing


def _unread(name: str, facts: SiteFacts, part: str, what: str) -> Check:
    why = facts.errors.get(part, "not read")
    return Check(name, "fail", f"could not read {what}: {why}")


# --- Slurm configuration -------------------------------------------------------------------


def _partition(facts: SiteFacts, name: str) -> PartitionInfo | None:
    return next((p for p in facts.partitions or () if p.name == name), None)


def check_preemption(facts: SiteFacts, config: Config) -> list[Check]:
    """Slurm preempts (and requeues) lend-partition jobs for the serve partition's."""
    name = "slurm.preemption"
    if facts.slurm_config is None:
        return [_unread(name, facts, "slurm_config", "`scontrol show config`")]
    cfg = facts.slurm_config
    lend, serve = config.slurm.lend_partition, config.slurm.serve_partition
    ptype = cfg.get("PreemptType", "")
    problems = []
    if is_unset(ptype) or ptype.endswith("/none"):
        problems.append(f"PreemptType is {ptype or 'unset'}: set PreemptType=preempt/partition_prio")
    mode = cfg.get("PreemptMode", "").upper()
    if mode in {"", "OFF"}:
        problems.append(f"PreemptMode is {mode or 'unset'}: set PreemptMode=REQUEUE in slurm.conf")
    idle, inference = _partition(facts, lend), _partition(facts, serve)
    if idle is not None and idle.preempt_modes and "REQUEUE" not in idle.preempt_modes:
        problems.append(
            f"partition {lend} has PreemptMode={idle.preempt_mode}: its jobs are not requeued on "
            f"preemption; set PreemptMode=REQUEUE on it (scontrol update partitionname={lend} "
            "preemptmode=requeue, and in slurm.conf)")
    if (idle is not None and inference is not None and None not in
            (idle.priority_tier, inference.priority_tier)
            and (inference.priority_tier or 0) <= (idle.priority_tier or 0)):
        problems.append(
            f"PriorityTier of {serve} ({inference.priority_tier}) is not above {lend}'s "
            f"({idle.priority_tier}): {serve} jobs cannot preempt {lend} jobs; raise {serve}'s")
    if problems:
        return [Check(name, "fail", "; ".join(problems))]
    return [Check(name, "ok", f"{ptype}, PreemptMode={mode}; {lend} jobs are requeued on preemption")]


def check_job_requeue(facts: SiteFacts, config: Config) -> list[Check]:
    name = "slurm.job_requeue"
    if facts.slurm_config is None:
        return [_unread(name, facts, "slurm_config", "`scontrol show config`")]
    value = facts.slurm_config.get("JobRequeue", "")
    if value.strip() == "1":
        return [Check(name, "ok", "JobRequeue=1: batch jobs are requeueable by default")]
    return [Check(name, "warn",
                  f"JobRequeue={value or 'unset'}: jobs without --requeue are killed, not requeued, "
                  "unless job_submit.lua makes them requeueable; set JobRequeue=1")]


def check_partitions(facts: SiteFacts, config: Config) -> list[Check]:
    """Both partitions exist, are up and cover every pool node."""
    name = "slurm.partitions"
    if facts.partitions is None:
        return [_unread(name, facts, "partitions", "`scontrol show partition`")]
    pool = config.pool_nodes
    problems = []
    for part_name in (config.slurm.serve_partition, config.slurm.lend_partition):
        part = _partition(facts, part_name)
        if part is None:
            problems.append(f"partition {part_name} does not exist: add it over the pool nodes "
                            "(see etc/slurm.conf.snippet)")
            continue
        missing = [n for n in pool if n not in part.nodes]
        if missing:
            problems.append(f"partition {part_name} lacks pool node(s) {', '.join(missing)}: "
                            "add them to its Nodes=")
        if part.state and part.state != "UP":
            problems.append(f"partition {part_name} is {part.state}: scontrol update "
                            f"partitionname={part_name} state=up")
    if problems:
        return [Check(name, "fail", "; ".join(problems))]
    return [Check(name, "ok", f"{config.slurm.serve_partition} and {config.slurm.lend_partition} "
                  f"cover all {len(pool)} pool node(s)")]


def check_replica_job_partitions(facts: SiteFacts, config: Config) -> list[Check]:
    """`placement: jobs`: each model's replica jobs go to a partition that exists, is up, is
    never preempted itself (PreemptMode OFF), outranks the lend partition (PriorityTier: so a
    replica job preempts idle jobs) and shares nodes with it (or nothing is ever lent)."""
    from slurm_idle.replicajobs import partition_of

    name = "slurm.replica_job_partitions"
    models = [m for m in config.models if m.job is not None]
    if not models:
        return []
    if facts.partitions is None:
        return [_unread(name, facts, "partitions", "`scontrol show partition`")]
    lend = _partition(facts, config.slurm.lend_partition)
    problems = []
    for part_name in sorted({partition_of(config, m) for m in models}):
        part = _partition(facts, part_name)
        if part is None:
            problems.append(f"partition {part_name} (replica jobs) does not exist: add it over "
                            "the GPU nodes with PriorityTier above the lend partition's, PreemptMode=OFF")
            continue
        if part.state and part.state != "UP":
            problems.append(f"partition {part_name} is {part.state}: replica jobs cannot start")
        if part.preempt_modes and part.preempt_modes != {"OFF"}:
            problems.append(f"partition {part_name} has PreemptMode={part.preempt_mode}: replica "
                            "jobs could be preempted themselves; set PreemptMode=OFF")
        if lend is not None:
            if (None not in (lend.priority_tier, part.priority_tier)
                    and (part.priority_tier or 0) <= (lend.priority_tier or 0)):
                problems.append(f"PriorityTier of {part_name} ({part.priority_tier}) is not above "
                                f"{lend.name}'s ({lend.priority_tier}): a reclaim would wait for "
                                "idle jobs to end instead of preempting them")
            if not set(part.nodes) & set(lend.nodes):
                problems.append(f"partitions {part_name} and {lend.name} share no node: GPUs a "
                                "lend frees are never used")
    if problems:
        return [Check(name, "fail", "; ".join(problems))]
    return [Check(name, "ok", "replica jobs go to a never-preempted partition that outranks "
                  f"{config.slurm.lend_partition} over shared nodes")]


def _closed_to_users(part: PartitionInfo, enforce: str) -> bool:
    """Closed by what a user cannot choose: RootOnly, AllowGroups, or AllowAccounts/AllowQos
    that Slurm checks against the user's associations (AccountingStorageEnforce)."""
    def limited(value: str | None) -> bool:
        return (value or "ALL").upper() != "ALL"

    accounts = limited(part.allow_accounts) and any(
        k in enforce for k in ("associations", "limits", "safe"))
    qos = limited(part.allow_qos) and "qos" in enforce
    return part.root_only or limited(part.allow_groups) or accounts or qos


def check_serve_access(facts: SiteFacts, config: Config) -> list[Check]:
    """The serve partition (and each `placement: jobs` partition) is closed to users: its jobs
    preempt the lend partition's, so a user's job there takes a lent node and holds its reclaim
    up (until the reclaim cancels it after slurm.requeue_grace_s: still a reclaim late by the
    grace, and a job lost)."""
    from slurm_idle.replicajobs import partition_of

    name = "slurm.serve_access"
    if facts.partitions is None:
        return [_unread(name, facts, "partitions", "`scontrol show partition`")]
    names = sorted({config.slurm.serve_partition}
                   | {partition_of(config, m) for m in config.models if m.job is not None})
    parts = [p for p in (_partition(facts, n) for n in names) if p is not None]
    open_ = [p.name for p in parts if p.open_to_all]
    if open_:
        return [Check(name, "fail",
                      f"partition(s) {', '.join(open_)} open to every user (AllowGroups=ALL, "
                      "AllowAccounts=ALL, AllowQos=ALL): a user's job there preempts lent jobs and "
                      "holds a reclaim of its node up; add AllowGroups=root (and the group of the "
                      "account slurm-idle runs as) to its PartitionName line in slurm.conf, then "
                      "`scontrol reconfigure` (see etc/slurm.conf.snippet)")]
    if not parts:
        return []  # missing partitions: slurm.partitions says so
    # AllowAccounts/AllowQos name what a job asks for (--account, --qos): without
    # AccountingStorageEnforce=associations (qos) Slurm does not check the user may ask for it.
    enforce = (facts.slurm_config or {}).get("AccountingStorageEnforce", "").lower()
    forgeable = [p.name for p in parts
                 if p.allow_groups is not None and not _closed_to_users(p, enforce)]
    if forgeable and facts.slurm_config is not None:
        return [Check(name, "warn",
                      f"partition(s) {', '.join(forgeable)} closed only by AllowAccounts/AllowQos, "
                      f"but AccountingStorageEnforce={enforce or 'none'}: any user may name that "
                      "account or QOS; set AccountingStorageEnforce=associations,qos or use "
                      "AllowGroups")]
    return [Check(name, "ok", f"{', '.join(p.name for p in parts)} closed to users "
                  "(AllowGroups/AllowAccounts/AllowQos or RootOnly)")]


def check_grace_time(facts: SiteFacts, config: Config) -> list[Check]:
    """GraceTime (Slurm's preemption) vs requeue_grace_s (our reclaim) vs the tick budget."""
    name = "slurm.grace_time"
    budget = config.timeouts.tick_budget_s
    grace = config.slurm.requeue_grace_s
    kill_wait = parse_duration_s((facts.slurm_config or {}).get("KillWait")) or 0.0
    part = _partition(facts, config.slurm.lend_partition)
    slurm_grace = part.grace_time_s if part is not None else None
    fails, warns = [], []
    if grace >= budget:
        fails.append(f"slurm.requeue_grace_s ({grace:g} s) >= timeouts.tick_budget_s ({budget:g} s): "
                     "a reclaim can never finish within one tick; lower requeue_grace_s")
    elif grace + kill_wait > budget:
        warns.append(f"requeue_grace_s + KillWait ({grace:g} + {kill_wait:g} s) exceeds the tick "
                     f"budget ({budget:g} s): reclaims spill into the next tick; lower one of them")
    if part is not None and not slurm_grace:
        warns.append(f"partition {config.slurm.lend_partition} has GraceTime=0: jobs Slurm preempts "
                     "get no time to checkpoint; set GraceTime (e.g. 60)")
    elif slurm_grace and slurm_grace > grace:
        warns.append(f"GraceTime of {config.slurm.lend_partition} ({slurm_grace:g} s) is longer than "
                     f"slurm.requeue_grace_s ({grace:g} s): a job that needs its GraceTime to "
                     "checkpoint is cut short at a reclaim; raise requeue_grace_s")
    if fails:
        return [Check(name, "fail", "; ".join(fails + warns))]
    if warns:
        return [Check(name, "warn", "; ".join(warns))]
    return [Check(name, "ok", f"GraceTime {slurm_grace or 0:g} s <= requeue_grace_s {grace:g} s; "
                  f"+ KillWait {kill_wait:g} s within the tick budget {budget:g} s")]


def preempt_sends_user_signal(slurm_config: Mapping[str, str]) -> bool:
    """Slurm sends a preempted job its own `--signal` instead of SIGTERM: PreemptParameters=
    send_user_signal (23.02+), SlurmctldParameters=preempt_send_user_signal (22.05)."""
    words = {w.strip() for key in ("PreemptParameters", "SlurmctldParameters")
             for w in slurm_config.get(key, "").split(",")}
    return bool({"send_user_signal", "preempt_send_user_signal"} & words)


def check_preempt_user_signal(facts: SiteFacts, config: Config) -> list[Check]:
    """`placement: jobs` reclaims by Slurm's preemption, which sends SIGTERM: submitit (USR2)
    and jobs with their own `--signal` checkpoint only on their signal."""
    name = "slurm.preempt_user_signal"
    if not any(m.job is not None for m in config.models):
        return []  # node placement: the agent's reclaim sends each job its own signal itself
    if facts.slurm_config is None:
        return [_unread(name, facts, "slurm_config", "`scontrol show config`")]
    if preempt_sends_user_signal(facts.slurm_config):
        return [Check(name, "ok", "a job preempted for a replica job gets its own --signal "
                      "(submitit: USR2) at once, then GraceTime to checkpoint")]
    return [Check(name, "warn",
                  "replica jobs (placement: jobs) preempt idle jobs with SIGTERM only: submitit "
                  "(checkpoints on USR2) and jobs with their own --signal lose their work since "
                  "the last checkpoint; set PreemptParameters=send_user_signal in slurm.conf "
                  "(22.05: SlurmctldParameters=preempt_send_user_signal), scontrol reconfigure")]


def check_job_submit(facts: SiteFacts, config: Config) -> list[Check]:
    """job_submit.lua is configured and rejects --no-requeue on the lend partition."""
    name = "slurm.job_submit"
    lend = config.slurm.lend_partition
    plugins = (facts.slurm_config or {}).get("JobSubmitPlugins", "")
    if facts.slurm_config is not None and "lua" not in plugins.lower():
        return [Check(name, "fail",
                      f"JobSubmitPlugins={plugins or 'unset'}: --no-requeue jobs on {lend} would be "
                      "killed at a reclaim; install etc/job_submit.lua beside slurm.conf and set "
                      "JobSubmitPlugins=lua")]
    probe = facts.submit
    if probe is None:
        return [_unread(name, facts, "submit", f"`sbatch --test-only -p {lend}`")]
    if probe.no_requeue_rc == 0:
        return [Check(name, "fail",
                      f"`sbatch --test-only -p {lend} --no-requeue` was accepted: job_submit.lua is "
                      f"not effective; check its LEND_PARTITION ({lend!r}) and slurmctld's log")]
    if probe.requeue_rc != 0:
        last = (probe.requeue_output.strip().splitlines() or ["no output"])[-1]
        return [Check(name, "warn",
                      f"--no-requeue was refused, but so was a plain --requeue test job ({last}): "
                      "cannot tell the lua plugin's refusal apart; submit to "
                      f"{lend} by hand to check")]
    return [Check(name, "ok", f"job_submit.lua refuses --no-requeue on {lend} (sbatch --test-only)")]


def check_power_save(facts: SiteFacts, config: Config) -> list[Check]:
    """Pool nodes that serve must never be suspended by Slurm."""
    name = "slurm.power_save"
    if facts.slurm_config is None:
        return [_unread(name, facts, "slurm_config", "`scontrol show config`")]
    cfg = facts.slurm_config
    if not powersave.power_saving_enabled(cfg):
        return [Check(name, "ok", "power saving is off (no SuspendProgram)")]
    pool = set(config.pool_nodes)
    nodes = [n for n in facts.nodes or () if n.name in pool]
    if facts.nodes is None:  # judge by name alone: partitions unknown
        nodes = [SlurmNode(name=n, state="unknown") for n in config.pool_nodes]
    gaps = powersave.unprotected(cfg, nodes)
    if not gaps:
        return [Check(name, "ok", "power saving is on and every pool node is excluded while it serves")]
    status: Status = "fail" if powersave.automatic_suspend(cfg) else "warn"
    has_states = "SuspendExcStates" in cfg
    fix = ("add SuspendExcStates=DRAIN (our serving nodes are drained)" if has_states
           else "add them to SuspendExcNodes (or the serve partition to SuspendExcParts)")
    return [Check(name, status,
                  f"Slurm may power down serving pool node(s) {', '.join(gaps)}: {fix}")]


def check_accounting(facts: SiteFacts, config: Config) -> list[Check]:
    name = "slurm.accounting"
    if facts.slurm_config is None:
        return [_unread(name, facts, "slurm_config", "`scontrol show config`")]
    storage = facts.slurm_config.get("AccountingStorageType", "")
    if is_unset(storage) or storage.endswith("/none"):
        return [Check(name, "warn", f"AccountingStorageType={storage or 'unset'}: `slurm-idle report` "
                      "needs accounting; set up slurmdbd (AccountingStorageType=accounting_storage/slurmdbd)")]
    tres = facts.slurm_config.get("AccountingStorageTRES", "")
    if "gres/gpu" not in tres:
        return [Check(name, "warn", f"{storage} records no GPUs: add gres/gpu to AccountingStorageTRES "
                      "so report can count GPU-hours")]
    return [Check(name, "ok", f"{storage}, GPUs recorded")]


def check_nodes(facts: SiteFacts, config: Config) -> list[Check]:
    """Every pool node is known to Slurm with the GPUs its replicas need (all of them: two
    4-GPU replicas on a node need 8; a whole-node replica over two nodes its share of each)."""
    from slurm_idle.topology import config_node_gpus

    name = "slurm.nodes"
    if facts.nodes is None:
        return [_unread(name, facts, "nodes", "the nodes (sinfo/scontrol show node)")]
    known = {n.name: n for n in facts.nodes}
    fails, warns = [], []
    uses = config_node_gpus(config)
    models = {n: m.name for m in reversed(config.models) for r in m.replicas for n in r.nodes}
    for pool_node in config.pool_nodes:
        want, model_name = uses[pool_node], models[pool_node]
        node = known.get(pool_node)
        if node is None:
            fails.append(f"{pool_node} is not known to Slurm: fix the config or slurm.conf")
        elif node.gpus_total < want:
            fails.append(f"{pool_node} has {node.gpus_total} GPU(s) in Slurm, model {model_name} "
                         f"needs {want}: fix its Gres= in slurm.conf/gres.conf or gpus_per_replica")
        elif node.gpus_total > want:
            warns.append(f"{pool_node} has {node.gpus_total} GPUs, model {model_name} uses {want}: "
                         "the rest are lent only with the node")
        elif node.down and not powersave.power_flags(node):
            warns.append(f"{pool_node} is {node.state.upper()} in Slurm ({node.reason or 'no reason'})")
    if fails:
        return [Check(name, "fail", "; ".join(fails + warns))]
    if warns:
        return [Check(name, "warn", "; ".join(warns))]
    return [Check(name, "ok", f"all {len(config.pool_nodes)} pool node(s) known with their GPUs")]


# --- metrics, engines, files ---------------------------------------------------------------


def check_metrics(facts: SiteFacts, config: Config) -> list[Check]:
    """Prometheus (or the scrape URLs) answers, and every serving replica's series are fresh."""
    name = "metrics"
    source = config.metrics.source
    where = config.metrics.prometheus_url if source == "prometheus" else "the replicas' /metrics"
    if facts.replicas is None:
        return [Check(name, "fail", f"{source} at {where} did not answer: "
                      f"{facts.errors.get('replicas', 'not read')}")]
    phases = {n.name: derive_phase(n, config.slurm.tag).phase for n in facts.nodes or ()}
    serving = [r.name for m in config.models for r in m.replicas
               if all(takes_traffic(phases.get(n, Phase.UNKNOWN)) for n in r.nodes)]
    missing = [n for n in serving if n not in facts.replicas or not facts.replicas[n].known]
    # A dead engine has no series whatever the scrape config says: the engine check names it.
    dead = [n for n in missing if n in _engines_down(facts)]
    blind = [n for n in missing if n not in dead]
    if blind:
        return [Check(name, "fail",
                      f"no fresh series for serving replica(s) {', '.join(blind)} from {where}: "
                      "check the scrape config (etc/prometheus.yml), metrics.instance_label and the URLs"
                      + (f" ({', '.join(dead)}: engine down, see the engine check)" if dead else ""))]
    if dead:
        return [Check(name, "warn", f"no fresh series for {', '.join(dead)}: its engine is down "
                      f"(see the engine check); {source} has fresh series for the other "
                      f"{len(serving) - len(dead)} serving replica(s)")]
    return [Check(name, "ok", f"{source}: fresh series for all {len(serving)} serving replica(s)")]


#: What is lost on a node whose GPUs are not observed (the check's and the docs' one wording).
GPUS_UNSEEN = ("a leftover process on these GPUs is not seen: engines would be woken on held GPUs "
               "(vLLM: CUDA out of memory) and lends not measured")


def check_gpus(facts: SiteFacts, config: Config) -> list[Check]:
    """Every pool node, and every node `placement: jobs` replicas may run on, has fresh GPU
    memory series (the `gpu` section's names) in Prometheus."""
    from slurm_idle.replicajobs import placement_nodes_of

    name = "gpus"
    gpu = config.gpu
    series = f"{gpu.used_metric} by {gpu.node_label}"
    wanted = list(dict.fromkeys([*config.pool_nodes,
                                 *(n.name for n in placement_nodes_of(config, facts.nodes or ()))]))
    if facts.gpus is None:
        why = facts.errors.get("gpus", "not read")
        return [Check(name, "fail", f"no GPU memory series read ({why}): {GPUS_UNSEEN}")]
    blind = [n for n in wanted if not facts.gpus.get(n)]
    if blind:
        return [Check(name, "fail",
                      f"no fresh GPU memory series ({series}) for node(s) {', '.join(blind)}: "
                      f"{GPUS_UNSEEN}; run the GPU exporter there and scrape it "
                      "(docs/admin.md 'GPU memory, observed'), or name its metrics and labels in `gpu:`")]
    count = sum(len(facts.gpus[n]) for n in wanted)
    return [Check(name, "ok", f"fresh GPU memory series ({series}) for all {len(wanted)} "
                  f"node(s), {count} GPU(s)")]


def _engines_down(facts: SiteFacts) -> set[str]:
    """Names of the replicas whose engine did not answer /health."""
    return {e.replica or e.node for e in facts.engines if e.down}


def _serving_engines_down(facts: SiteFacts, config: Config) -> list[str]:
    """`REPLICA: why` for each replica whose engine should answer /health and does not: one
    that should be serving (every node of it takes traffic, as Slurm says; none when Slurm
    could not be read), or any http-sleep one."""
    phases = {n.name: derive_phase(n, config.slurm.tag).phase for n in facts.nodes or ()}
    out = []
    for e in facts.engines:
        replica = next((r for m in config.models if m.name == e.model for r in m.replicas
                        if (r.name == e.replica if e.replica else r.node == e.node)), None)
        nodes = replica.nodes if replica is not None else (e.node,)
        # http-sleep never stops its engine (a lent one sleeps): down is a failure in any phase.
        if e.down and (e.kind == "http-sleep" or all(
                takes_traffic(phases.get(n, Phase.UNKNOWN)) for n in nodes)):
            out.append(f"{e.replica or e.node}: {e.down}")
    return out


def check_engines(facts: SiteFacts, config: Config) -> list[Check]:
    """Each engine control can work (commands found, containers made, sleep mode on), and each
    engine that should be serving answers /health: named by its URL, the cause of any stale
    series the metrics check sees for it."""
    name = "engine"
    problems = [*_serving_engines_down(facts, config),
                *(f"{e.node}: {p}" for e in facts.engines for p in e.problems)]
    warnings = [f"{e.node}: {w}" for e in facts.engines for w in e.warnings]
    if problems:
        return [Check(name, "fail", "; ".join(problems + warnings))]
    if warnings:
        return [Check(name, "warn", "; ".join(warnings))]
    kinds = sorted({e.kind for e in facts.engines})
    return [Check(name, "ok", f"{', '.join(kinds) or 'no'} engine control present for "
                  f"{len(facts.engines)} replica(s)")]


def check_paths(facts: SiteFacts, config: Config) -> list[Check]:
    name = "paths"
    problems = [f"{key} {path}: {problem}" for key, path, problem in facts.paths if problem]
    if problems:
        return [Check(name, "fail", "; ".join(problems))]
    return [Check(name, "ok", ", ".join(f"{key} {path}" for key, path, _ in facts.paths)
                  + " writable and safely owned")]


def check_router(facts: SiteFacts, config: Config) -> list[Check]:
    """The request router: `none` is a warning (clients see errors at every lend); a configured
    router must answer and know every pool replica (a replica it lacks can never be drained
    through it, nor rejoin it)."""
    from slurm_idle.router.none import WARNING

    name = "router"
    bare = [m.name for m in config.models if config.router_for(m.name).kind == "none"]
    routed = [m.name for m in config.models if m.name not in bare]
    checks = []
    if bare:
        checks.append(Check(name, "warn", f"{WARNING} (models: {', '.join(bare)})"))
    if not routed:
        return checks
    if facts.router_states is None:
        return [*checks, _unread(name, facts, "router", "the request router's state")]
    nodes = {r.name for m in config.models if m.name in routed for r in m.replicas}  # replicas
    unknown = sorted(n for n in nodes if facts.router_states.get(n, "unknown") == "unknown")
    missing = sorted(n for n in nodes if facts.router_states.get(n) == "missing")
    if unknown:
        checks.append(Check(name, "fail", f"router state unreadable for {', '.join(unknown)}: "
                            "check the router section (admin socket, path) and that it runs"))
    elif missing:
        checks.append(Check(name, "fail", f"the router has no server for {', '.join(missing)}: "
                            "add them to its backend (server names from router.server)"))
    else:
        kinds = sorted({config.router_for(m).kind for m in routed})
        checks.append(Check(name, "ok", f"{'/'.join(kinds)} router knows all {len(nodes)} "
                            "pool replica(s)"))
    return checks


CHECKS: tuple[Callable[[SiteFacts, Config], list[Check]], ...] = (
    check_preemption,
    check_job_requeue,
    check_partitions,
    check_replica_job_partitions,
    check_serve_access,
    check_grace_time,
    check_preempt_user_signal,
    check_job_submit,
    check_power_save,
    check_accounting,
    check_nodes,
    check_metrics,
    check_gpus,
    check_engines,
    check_paths,
    check_router,
)


def run_checks(facts: SiteFacts, config: Config) -> list[Check]:
    """Every check, in a fixed order."""
    return [check for fn in CHECKS for check in fn(facts, config)]


def exit_code(checks: list[Check]) -> int:
    """0 when nothing fails (warnings allowed), 1 otherwise."""
    return 1 if any(c.status == "fail" for c in checks) else 0
