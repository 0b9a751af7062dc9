"""PrometheusSource logic: constant fleet-wide queries, target mapping, staleness, errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import requests
from prometheus_api_client.exceptions import PrometheusApiClientException

from slurm_idle.config import Config, ReplicaConfig, parse_config
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.metrics.prometheus import (
    PrometheusSource,
    forecast_lead_s,
    match_target,
    queries_for,
    target_index,
)
from slurm_idle.metrics.synthetic import SyntheticPrometheus

CONFIG = """
metrics: {prometheus_url: "http://prom:9090", rate_window_s: 30, staleness_s: 60, job_label: vllm}
engine: {kind: command, start_command: "start", stop_command: "stop"}
policy: {scale_down_window_s: 600, prompt_token_weight: 0.1, forecast_lead_s: 300}
models:
  - name: llama
    nodes: gpu[1-3]
    url: "http://{node}.cluster:8000"
  - name: qwen
    replicas: [{node: inf9, url: "http://10.0.0.9:8001"}]
"""


def make(cfg: Config | None = None, **tables: Any) -> tuple[PrometheusSource, SyntheticPrometheus]:
    config = cfg or parse_config(CONFIG)
    fake = SyntheticPrometheus(
        queries_for(config),
        window_s=config.policy.scale_down_window_s,
        forecast_lead_s=forecast_lead_s(config, config.models) if config.policy.forecast else None,
        **tables,
    )
    return PrometheusSource(config, prom=fake), fake


def pairs(config: Config) -> list[tuple[str, ReplicaConfig]]:
    return [(m.name, r) for m in config.models for r in m.replicas]


FULL = {"waiting": 1.0, "kv": 0.5, "awake": 1.0, "prompt": 100.0, "generation": 40.0,
        "ttft": 0.2, "queue": 0.05}


def test_series_map_to_replicas_by_scrape_target() -> None:
    """instance=host:port of the replica URL (FQDN, short name or IP) finds the replica."""
    ts = 1_700_000_000.0
    src, _ = make(
        targets={
            "gpu1.cluster:8000": {"running": 3.0, "fresh": ts, **FULL},
            "gpu2:8000": {"running": {"0": 2.0, "1": 5.0}, "fresh": ts, **FULL},
            "10.0.0.9:8001": {"running": 1.0, "fresh": ts, **FULL, "awake": 0.0},
            "elsewhere:8000": {"running": 99.0, "fresh": ts, **FULL},
        },
        eval_ts=ts,
    )
    loads = {l.node: l for l in src.replica_loads(pairs(src.config))}
    assert loads["gpu1"].known and loads["gpu1"].running == 3.0
    assert loads["gpu1"].generation_tokens_per_s == 40.0 and loads["gpu1"].ttft_p95_s == 0.2
    assert loads["gpu2"].known and loads["gpu2"].running == 7.0  # DP engines summed
    assert src.last_engines["gpu2"] == ("0", "1")
    assert not loads["gpu3"].known  # no series at all
    assert loads["inf9"].sleeping and loads["inf9"].model == "qwen"


def test_stale_series_make_a_replica_unknown() -> None:
    """A target whose last sample is older than staleness_s is known=False."""
    ts = 1_700_000_000.0
    src, _ = make(
        targets={
            "gpu1.cluster:8000": {"running": 3.0, "fresh": ts - 61, **FULL},
            "gpu2.cluster:8000": {"running": 3.0, "fresh": ts - 5, **FULL},
        },
        eval_ts=ts,
    )
    loads = {l.node: l for l in src.replica_loads(pairs(src.config))}
    assert not loads["gpu1"].known
    assert loads["gpu2"].known


def test_missing_rate_makes_a_replica_unknown() -> None:
    """A replica with gauges but no token rate yet (just started) is not known."""
    ts = 1_700_000_000.0
    partial = {k: v for k, v in FULL.items() if k != "generation"}
    src, _ = make(targets={"gpu1.cluster:8000": {"running": 0.0, "fresh": ts, **partial}}, eval_ts=ts)
    [l1, *_] = src.replica_loads(pairs(src.config))
    assert not l1.known


def test_nan_percentile_is_none() -> None:
    """histogram_quantile over no requests (NaN) reads as None, not a number."""
    ts = 1_700_000_000.0
    src, _ = make(targets={"gpu1.cluster:8000": {"running": 0.0, "fresh": ts, **FULL, "ttft": math.nan}},
                  eval_ts=ts)
    assert src.replica_loads(pairs(src.config))[0].ttft_p95_s is None


def test_query_count_does_not_grow_with_the_fleet() -> None:
    """replica_loads + model_loads cost the same number of queries for 4 and 400 replicas."""
    counts = []
    for n in (4, 400):
        cfg = parse_config(CONFIG.replace("gpu[1-3]", f"gpu[1-{n}]"))
        src, fake = make(cfg)
        src.replica_loads(pairs(cfg))
        src.model_loads(cfg.models, 1_700_000_000.0)
        counts.append(src.queries)
        assert fake.calls == src.queries
    assert counts[0] == counts[1] == 9 + 10


def test_queries_are_restricted_to_the_job_and_use_the_window() -> None:
    """job_label selects the scrape job; rates use rate_window_s; hysteresis the scale-down window."""
    cfg = parse_config(CONFIG)
    q = queries_for(cfg)
    assert 'vllm:num_requests_running{job="vllm"}' in q.replica()["running"]
    assert "[30s]" in q.replica()["generation"]
    model_q = q.model(600, 300)
    assert "[600s:" in model_q["demand_max"] and "0.1 *" in model_q["demand_max"]
    assert "offset 86100s" in model_q["forecast"] and "offset 604500s" in model_q["forecast"]
    assert "offset 86400s" in model_q["forecast"] and '"kind", "ahead_7d"' in model_q["forecast"]
    assert 'sleep_state="awake"' in q.replica()["asleep"] and q.replica()["asleep"].endswith("< 0.5")
    assert q.replica()["stale"].endswith("> 60")  # only stale targets come back


def test_model_loads_carry_window_and_forecast_fields() -> None:
    """Fleet-wide per model: rates, window max/min and the forecast; missing model -> unknown."""
    src, fake = make(
        models={
            "llama": {"generation": 50.0, "prompt": 500.0, "running": 8.0, "waiting": 2.0, "kv": 0.7,
                      "ttft": 0.3, "demand_max": 400.0, "waiting_max": 5.0, "waiting_min": 0.0,
                      "forecast": {"then_1d": 100.0, "ahead_1d": 600.0, "then_7d": 90.0}},
        }
    )
    llama, qwen = src.model_loads(src.config.models, 1_700_000_100.0)
    assert llama.known and llama.generation_tokens_per_s == 50.0
    assert llama.demand_tokens_per_s_max_window == 400.0
    assert (llama.waiting_max_window, llama.waiting_min_window) == (5.0, 0.0)
    # today's demand (50 + 0.1*500 = 100) plus yesterday's rise over the lead (600 - 100);
    # last week has no `ahead` series, so it does not count
    assert llama.forecast_demand_tokens_per_s == pytest.approx(600.0)
    assert llama.kv_cache_usage_max == 0.7
    assert not qwen.known
    assert len(fake.seen) == 10


def test_window_max_never_below_current_demand() -> None:
    """If the subquery's last point predates a jump, the window max still covers the present."""
    src, _ = make(models={"llama": {"generation": 500.0, "prompt": 0.0, "running": 1.0,
                                    "demand_max": 100.0}})
    [llama, _] = src.model_loads(src.config.models, 1_700_000_100.0)
    assert llama.demand_tokens_per_s_max_window == 500.0


def test_target_matching_prefers_exact_host_port() -> None:
    """Exact host:port wins; a node-name label (relabelled instance) also matches."""
    reps = [("m", ReplicaConfig(node="gpu1", url="http://gpu1:8000")),
            ("m", ReplicaConfig(node="gpu2", url="http://gpu2.x.y:8000"))]
    index = target_index(reps)
    assert match_target(index, "gpu1:8000") == "gpu1"
    assert match_target(index, "GPU2.x.y:8000") == "gpu2"
    assert match_target(index, "gpu2:8000") == "gpu2"
    assert match_target(index, "gpu2") == "gpu2"
    assert match_target(index, "gpu1:9999") == "gpu1"  # same host: the node's own vLLM
    assert match_target(index, "gpu7:8000") is None


class Failing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "needle"),
    [
        (requests.exceptions.ConnectionError("Connection refused"), "cannot connect to Prometheus"),
        (requests.exceptions.ReadTimeout("timed out"), "did not answer within"),
        (PrometheusApiClientException("HTTP Status Code 404 (b'<html>')"), "HTTP 404"),
        (ValueError("Expecting value"), "did not answer like a Prometheus server"),
    ],
)
def test_errors_become_metrics_unavailable(exc: Exception, needle: str) -> None:
    """Connection, timeout, HTTP and garbage answers raise MetricsUnavailable naming the fix."""
    cfg = parse_config(CONFIG)
    src = PrometheusSource(cfg, prom=Failing(exc))
    with pytest.raises(MetricsUnavailable, match=needle) as info:
        src.replica_loads(pairs(cfg))
    assert "metrics.prometheus_url" in str(info.value) or "query_timeout_s" in str(info.value)
