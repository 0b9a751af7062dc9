"""Rows and text for `slurm-idle status`: what each node is doing and what each model needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slurm_idle.model import ModelPlan, Observation, Phase


def slurm_state(flags: frozenset[str], state: str) -> str:
    """`idle+DRAIN` style, as admins read it in sinfo."""
    return "+".join([state.upper(), *sorted(flags)]) if flags else state.upper()


def node_rows(obs: Observation) -> list[dict[str, Any]]:
    """One row per pool node; keys name, phase, slurm_state, reason are a stable interface."""
    rows = []
    for v in obs.nodes:
        rows.append({
            "name": v.name,
            "phase": v.phase.value,
            "slurm_state": slurm_state(v.node.flags, v.node.state),
            "reason": v.node.reason,
            "gpus": v.node.gpus_total,
            "gpus_used": v.node.gpus_used,
            "jobs": [j.job_id for j in v.jobs],
            "model": v.model,
            "pinned": v.pinned,
            "phase_since": v.phase_since,
            "running": v.replica.running if v.replica and v.replica.known else None,
            "waiting": v.replica.waiting if v.replica and v.replica.known else None,
        })
    return rows


def model_rows(obs: Observation, plans: Sequence[ModelPlan]) -> list[dict[str, Any]]:
    """Per model: serving/needed replicas and the load signals behind them."""
    by_model = {p.model: p for p in plans}
    rows = []
    for load in obs.models:
        plan = by_model.get(load.model)
        serving = sum(1 for v in obs.nodes if v.model == load.model and v.phase is Phase.SERVING)
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


def render_status(nodes: list[dict[str, Any]], models: list[dict[str, Any]], errors: Sequence[str]) -> str:
    """A table for humans."""
    lines = [f"{'NODE':<12} {'PHASE':<11} {'SLURM':<18} {'GPUS':<6} {'JOBS':<12} REASON"]
    for n in nodes:
        jobs = ",".join(map(str, n["jobs"])) or "-"
        gpus = f"{n['gpus_used']}/{n['gpus']}"
        phase = n["phase"] + ("*" if n["pinned"] else "")
        lines.append(f"{n['name']:<12} {phase:<11} {n['slurm_state']:<18} {gpus:<6} {jobs:<12} {n['reason']}")
    lines.append("")
    lines.append(f"{'MODEL':<28} {'SERVING':>7} {'NEEDED':>6}  LOAD")
    for m in models:
        load = (f"gen {m['generation_tokens_per_s']:.0f} tok/s, prompt {m['prompt_tokens_per_s']:.0f} tok/s, "
                f"running {m['running']:.0f}, waiting {m['waiting']:.0f}") if m["known"] else "metrics unknown"
        needed = "?" if m["needed"] is None else m["needed"]
        lines.append(f"{m['model']:<28} {m['serving']:>7} {needed:>6}  {load}")
        if m["reason"]:
            lines.append(f"{'':<28} {'':>7} {'':>6}  {m['reason']}")
    if any(n["pinned"] for n in nodes):
        lines.append("(* pinned: never lent)")
    for e in errors:
        lines.append(f"warning: {e}")
    return "\n".join(lines)
