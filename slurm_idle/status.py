"""Rows and text for `slurm-idle status`: what each node is doing and what each model needs."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from slurm_idle.config import Config
from slurm_idle.fleetspec import format_gpus
from slurm_idle.lifecycle import DRAINED_PHASES, takes_traffic
from slurm_idle.model import GpuReading, ModelPlan, Observation, Phase, ReplicaLoad
from slurm_idle.replica_health import attention, unhealthy
from slurm_idle.topology import group_views
from slurm_idle.unhealthy_since import clock_time

if TYPE_CHECKING:
    from slurm_idle.engine import EngineHealth


def slurm_state(flags: frozenset[str], state: str) -> str:
    """`idle+DRAIN` style, as admins read it in sinfo."""
    return "+".join([state.upper(), *sorted(flags)]) if flags else state.upper()


def gpu_rows(readings: tuple[GpuReading, ...] | None) -> list[dict[str, Any]] | None:
    """A node's GPU memory as `status --json` shows it; None when not observed."""
    if readings is None:
        return None
    return [{"index": g.index, "used_mib": g.used_mib, "total_mib": g.total_mib, "holder": g.holder}
            for g in readings]


def node_rows(obs: Observation) -> list[dict[str, Any]]:
    """One row per pool node; keys name, phase, slurm_state, reason, gpus_total, gpus_used and
    gpus (each GPU's memory per the GPU exporter, null when not observed) are a stable
    interface."""
    rows = []
    for v in obs.nodes:
        rows.append({
            "name": v.name,
            "phase": v.phase.value,
            "slurm_state": slurm_state(v.node.flags, v.node.state),
            "reason": v.node.reason,
            "gpus_total": v.node.gpus_total,
            "gpus_used": v.node.gpus_used,
            "gpus": gpu_rows(v.gpus),
            "jobs": [j.job_id for j in v.jobs],
            "model": v.model,
            "pinned": v.pinned,
            "phase_since": v.phase_since,
            "running": v.replica.running if v.replica and v.replica.known else None,
            "waiting": v.replica.waiting if v.replica and v.replica.known else None,
        })
    return rows


def _healthy(load: ReplicaLoad | None, phase: Phase) -> bool | None:
    """Up and serving as far as this tick saw: its health check, else known awake metrics;
    None where it is not meant to serve (lent, or not checked)."""
    if load is None:
        return False if takes_traffic(phase) else None
    if load.healthy is not None:
        return load.healthy and not load.sleeping
    return load.known and not load.sleeping


def _with_health(row: dict[str, Any], load: ReplicaLoad | None,
                 health: Mapping[str, EngineHealth]) -> dict[str, Any]:
    """`health_reason` (the problem, naming the URL) and `health_summary` (its short form) of
    a replica meant to serve, both None when it is fine or not meant to serve; `healthy` is
    False whenever there is a reason (its /health asked now outranks the tick's metrics)."""
    problem = None
    if takes_traffic(Phase(row["phase"])) and row["url"]:
        problem = unhealthy(row["url"], health.get(row["name"]), load)
    if problem is not None:
        row["healthy"] = False
    row["health_reason"] = problem.detail if problem else None
    row["health_summary"] = problem.summary if problem else None
    return row


def replica_rows(obs: Observation, config: Config,
                 health: Mapping[str, EngineHealth] | None = None) -> list[dict[str, Any]]:
    """One row per replica; keys name, model, nodes, gpus, url, phase, healthy, health_reason,
    health_summary are a stable interface (`status --json` `replicas`). A replica's phase is
    its lend group's. `health`: replica name -> its /health answer now
    (replica_health.probe_serving); without it the reasons come from the tick's metrics alone."""
    health = health or {}
    rows = []
    for g in group_views(obs, config):
        for r in g.group.replicas:
            load = g.load(r)
            rows.append({
                "name": r.name,
                "model": r.model,
                "nodes": list(r.nodes),
                "gpus": format_gpus(r.gpus),
                "url": r.url,
                "phase": g.phase.value,
                "healthy": _healthy(load, g.phase),
                "running": load.running if load is not None and load.known else None,
                "waiting": load.waiting if load is not None and load.known else None,
                "placement": "nodes",
            })
            _with_health(rows[-1], load, health)
    for j in obs.replica_jobs:  # `placement: jobs`: one Slurm job per replica (replicajobs.py)
        rows.append({
            "name": j.name,
            "model": j.model,
            "nodes": list(j.nodes),
            "gpus": str(j.gpus) if j.gpus else "",
            "url": j.url,
            "phase": j.phase.value,
            "healthy": _healthy(j.load, j.phase) if j.nodes else None,
            "running": j.load.running if j.load is not None and j.load.known else None,
            "waiting": j.load.waiting if j.load is not None and j.load.known else None,
            "placement": "jobs",
            "job_id": j.job_id,
            "job_state": j.job_state or None,
            "pending_reason": j.state_reason or None,
            "port": j.port,
            "pinned": j.pinned,  # an admin's `slurm-idle pin MODEL#INDEX`
        })
        _with_health(rows[-1], j.load, health)
    return rows


def group_rows(obs: Observation, config: Config) -> list[dict[str, Any]]:
    """One row per lend group (`status --json` `groups`): its nodes, phase and replicas."""
    return [
        {"nodes": list(g.group.nodes), "phase": g.phase.value,
         "replicas": [r.name for r in g.group.replicas], "gpus": g.gpus_total}
        for g in group_views(obs, config)
    ]


def model_rows(obs: Observation, plans: Sequence[ModelPlan]) -> list[dict[str, Any]]:
    """Per model: serving/needed replicas and the load signals behind them. Without a plan,
    `serving` counts what takes traffic (SERVING and RETIRING), as the planner does."""
    by_model = {p.model: p for p in plans}
    rows = []
    for load in obs.models:
        plan = by_model.get(load.model)
        serving = sum(1 for v in obs.nodes if v.model == load.model and takes_traffic(v.phase))
        rows.append({
            "model": load.model,
            "serving": plan.serving_replicas if plan else serving,
            "needed": plan.needed_replicas if plan else None,
            "reason": plan.reason if plan else "",
            "known": load.known,
            "generation_tokens_per_s": round(load.generation_tokens_per_s, 2),
            "prompt_tokens_per_s": round(load.prompt_tokens_per_s, 2),
            "running": load.running,
            "waiting": load.waiting,
            "kv_cache_usage_max": load.kv_cache_usage_max,
            "ttft_p95_s": load.ttft_p95_s,
        })
    return rows


def _held_gpus(node: Mapping[str, Any]) -> list[str]:
    """`  └ GPU 0: 20480/81559 MiB, holder job 123` for each GPU the exporter says a job holds
    on a node drained for serving (a lent node's GPUs are its jobs' to hold), and on a `held`
    node every GPU in use, holder or not (a leftover Slurm no longer tracks has no job)."""
    phase = Phase(node["phase"])
    if phase not in DRAINED_PHASES:
        return []
    return [f"  └ GPU {g['index']}: {g['used_mib']}/{g['total_mib'] or '?'} MiB, "
            f"holder {g['holder'] or 'unknown'}"
            for g in node.get("gpus") or ()
            if g["holder"] or (phase is Phase.HELD and g["used_mib"])]


def _unhealthy(row: Mapping[str, Any], now: float) -> str:
    """`unhealthy: why since 12:01` (no since when no tick has seen it unhealthy yet)."""
    since = row.get("unhealthy_since")
    return f"unhealthy: {row['health_reason']}" + (f" since {clock_time(since, now)}" if since else "")


def render_status(
    nodes: list[dict[str, Any]],
    models: list[dict[str, Any]],
    errors: Sequence[str],
    replicas: Sequence[dict[str, Any]] = (),
    now: float | None = None,
) -> str:
    """A table for humans; with several replicas on a node (or one spanning nodes), each is
    listed under its head node, as is any replica meant to serve that is unhealthy (with why,
    and since when a tick first saw it so), and any GPU a job holds on a node drained for us; `attention:` lines close it, one per such replica,
    so the last lines say what to look at. `now`: what "today" is for the since times."""
    now = time.time() if now is None else now
    lines = [f"{'NODE':<12} {'PHASE':<11} {'SLURM':<18} {'GPUS':<6} {'JOBS':<12} REASON"]
    under: dict[str, list[dict[str, Any]]] = {}
    for r in replicas:
        if r.get("placement") != "jobs":
            under.setdefault(r["nodes"][0], []).append(r)
    show = any(len(rs) > 1 or len(rs[0]["nodes"]) > 1 for rs in under.values())
    for n in nodes:
        jobs = ",".join(map(str, n["jobs"])) or "-"
        gpus = f"{n['gpus_used']}/{n['gpus_total']}"
        phase = n["phase"] + ("*" if n["pinned"] else "")
        lines.append(f"{n['name']:<12} {phase:<11} {n['slurm_state']:<18} {gpus:<6} {jobs:<12} {n['reason']}")
        lines += _held_gpus(n)
        for r in under.get(n["name"], []):
            if show:
                health = (_unhealthy(r, now) if r.get("health_reason") else
                          {True: "healthy", False: "not healthy", None: "-"}[r["healthy"]])
                span = f" on {','.join(r['nodes'])}" if len(r["nodes"]) > 1 else ""
                lines.append(f"  └ {r['name']:<20} {r['model']} gpus {r['gpus']}{span} {r['url']} {health}")
            elif r.get("health_reason"):
                lines.append(f"  └ {r['name']} {r['phase']} ({_unhealthy(r, now)})")
    job_rows = [r for r in replicas if r.get("placement") == "jobs"]
    if job_rows:
        lines.append("")
        lines.append(f"{'REPLICA':<24} {'PHASE':<11} {'JOB':<8} {'STATE':<10} {'NODES':<12} URL")
        for r in job_rows:
            state = (r["job_state"] or "-") + (f" ({r['pending_reason']})" if r["pending_reason"] else "")
            phase = r["phase"] + ("*" if r.get("pinned") else "")
            lines.append(f"{r['name']:<24} {phase:<11} {r['job_id'] or '-'!s:<8} {state:<10} "
                         f"{','.join(r['nodes']) or '-':<12} {r['url'] or '-'}")
            if r.get("health_reason"):
                lines.append(f"  └ {r['phase']} ({_unhealthy(r, now)})")
    lines.append("")
    lines.append(f"{'MODEL':<28} {'SERVING':>7} {'NEEDED':>6}  LOAD")
    for m in models:
        load = (f"gen {m['generation_tokens_per_s']:.0f} tok/s, prompt {m['prompt_tokens_per_s']:.0f} tok/s, "
                f"running {m['running']:.0f}, waiting {m['waiting']:.0f}") if m["known"] else "metrics unknown"
        needed = "?" if m["needed"] is None else m["needed"]
        lines.append(f"{m['model']:<28} {m['serving']:>7} {needed:>6}  {load}")
        if m["reason"]:
            lines.append(f"{'':<28} {'':>7} {'':>6}  {m['reason']}")
    if any(n["pinned"] for n in nodes) or any(r.get("pinned") for r in job_rows):
        lines.append("(* pinned: never lent)")
    for e in errors:
        lines.append(f"warning: {e}")
    lines += [f"attention: {line}" for line in attention(replicas)]
    return "\n".join(lines)
