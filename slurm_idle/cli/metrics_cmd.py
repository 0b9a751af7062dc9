"""`slurm-idle metrics`: read vLLM engine metrics by direct scrape or through Prometheus."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx

#: The columns of the readable table (the JSON carries these keys and a few more).
COLUMNS = (
    ("model", "MODEL"),
    ("engine", "ENGINE"),
    ("running", "RUN"),
    ("waiting", "WAIT"),
    ("kv_cache_usage", "KV"),
    ("sleeping", "SLEEP"),
    ("generation_tokens_per_s", "GEN_TOK/S"),
    ("prompt_tokens_per_s", "PROMPT_TOK/S"),
    ("ttft_p95_s", "TTFT_P95"),
    ("queue_time_p95_s", "QUEUE_P95"),
)


def _num(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _table(rows: Sequence[Mapping[str, Any]], first: tuple[str, str],
           engine: Sequence[tuple[str, str]] = (("engine", "ENGINE"),)) -> str:
    """The rows as aligned columns; `engine`: what stands in the ENGINE column's place."""
    cols = [first]
    for col in COLUMNS:
        cols.extend(engine if col == ("engine", "ENGINE") else (col,))
    cells = [[h for _, h in cols]] + [[_cell(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


@main.group()
def metrics() -> None:
    """Read vLLM engine metrics (direct /metrics scrape or Prometheus)."""


@metrics.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Seconds between the two scrapes that give token rates and p95s (0: one scrape, no rates).",
)
@click.option("--timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="HTTP timeout per scrape, seconds.")
def scrape(url: str, as_json: bool, interval: float, timeout: float) -> None:
    """Scrape one vLLM server's /metrics page (URL of the server or of its metrics page).

    JSON: {"replicas": [{"url", "model", "engine", "version", "engine_index", "running",
    "waiting", "kv_cache_usage", "sleeping", "generation_tokens_per_s", "prompt_tokens_per_s",
    "ttft_p95_s", "queue_time_p95_s", ...}]}, one entry per model and data-parallel engine:
    "engine" is the server ("vllm": its metrics are vLLM's), "version" what its GET /version
    says (null when it does not answer), "engine_index" vLLM's `engine` label.
    """
    from slurm_idle.metrics.scrape import read_server, server_version

    readings = read_server(url, timeout_s=timeout, interval_s=interval)
    version = server_version(url, timeout_s=timeout)
    rows = []
    for r in readings:
        s = r.snapshot
        rows.append(
            {
                "url": url,
                "model": s.model,
                "engine": "vllm",
                "version": version,
                "engine_index": s.engine,
                "running": s.running,
                "waiting": s.waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "sleeping": s.sleeping,
                "sleep_state": s.sleep_state,
                "generation_tokens_per_s": _num(r.generation_tokens_per_s),
                "prompt_tokens_per_s": _num(r.prompt_tokens_per_s),
                "ttft_p95_s": _num(r.ttft_p95_s),
                "queue_time_p95_s": _num(r.queue_time_p95_s),
                "generation_tokens_total": s.generation_tokens_total,
                "prompt_tokens_total": s.prompt_tokens_total,
            }
        )
    if as_json:
        echo_json({"replicas": rows})
    else:
        click.echo(_table(rows, ("url", "URL"),
                          engine=(("engine_index", "ENGINE"), ("version", "VLLM"))))


@metrics.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def query(ctx: Context, as_json: bool) -> None:
    """Read every configured replica's metrics through Prometheus (metrics.prometheus_url).

    JSON: {"replicas": [...one per replica, keys as `metrics scrape` (but "version", which
    Prometheus does not have) plus "node", "known"...], "models": [...fleet-wide demand per
    model...], "queries": N}. "engine" is "vllm"; "engine_index" lists the data-parallel
    engines seen, comma-separated; a replica without fresh series has known=false.
    """
    import time

    from slurm_idle.metrics.prometheus import PrometheusSource

    config = ctx.config()
    source = PrometheusSource(config)
    pairs = [(m.name, r) for m in config.models for r in m.replicas]
    loads = source.replica_loads(pairs)
    models = source.model_loads(config.models, time.time())
    rows = [
        {
            "url": l.url,
            "node": l.node,
            "model": l.model,
            "engine": "vllm",
            "engine_index": ",".join(source.last_engines.get(l.url, ())),
            "known": l.known,
            "running": l.running,
            "waiting": l.waiting,
            "kv_cache_usage": _num(l.kv_cache_usage),
            "sleeping": l.sleeping,
            "generation_tokens_per_s": _num(l.generation_tokens_per_s),
            "prompt_tokens_per_s": _num(l.prompt_tokens_per_s),
            "ttft_p95_s": _num(l.ttft_p95_s),
            "queue_time_p95_s": _num(l.queue_time_p95_s),
        }
        for l in loads
    ]
    model_rows = [
        {
            "model": m.model,
            "known": m.known,
            "generation_tokens_per_s": _num(m.generation_tokens_per_s),
            "prompt_tokens_per_s": _num(m.prompt_tokens_per_s),
            "running": m.running,
            "waiting": m.waiting,
            "kv_cache_usage_max": _num(m.kv_cache_usage_max),
            "ttft_p95_s": _num(m.ttft_p95_s),
            "demand_tokens_per_s_max_window": _num(m.demand_tokens_per_s_max_window),
            "waiting_max_window": m.waiting_max_window,
            "waiting_min_window": m.waiting_min_window,
            "waiting_min_recent": m.waiting_min_recent,
            "forecast_demand_tokens_per_s": _num(m.forecast_demand_tokens_per_s),
            "forecast_demand_tokens_per_s_max_window": _num(m.forecast_demand_tokens_per_s_max_window),
        }
        for m in models
    ]
    if as_json:
        echo_json({"replicas": rows, "models": model_rows, "queries": source.queries})
        return
    for row in rows:
        if not row["known"]:
            row["model"] = f"{row['model']} (unknown)"
    click.echo(_table(rows, ("node", "NODE"), engine=(("engine_index", "ENGINE"),)))
